"""results/index.html: every table's summary, forest plots, costs, gate rates and stored completions on one
self-contained page (issue 82.2).

Built from the committed files only: each table's summary (``repro.analysis.summary``: its JSON, seeds and
primary-family files) and, where a table has them, its stored completions (NAME_completions.parquet).
Nothing is fetched when the page is viewed: the figures are inline SVG (``forest_svg``), the style is
inline, and there is no script. The same files give the same bytes (no date; figures as
``forest_svg`` makes them), so ``python -m repro.report --check`` can compare it with the committed page.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from repro.analysis.forest_svg import forest_svg
from repro.analysis.summary import MARKS, RESULTS, ModelSummary, TableSummary, anchor, find_tables, load
from repro.analysis.summary_text import NOT_COMPUTED, differences, flatten, gate_rows, write_summary

COMMAND = "python -m repro.report"
COMPLETIONS_PER_ROW = 2  # the first ones by task, seed and document
COMPLETION_CHARS = 300  # a prompt or completion cut to this many characters
# Of NAME_completions.parquet (repro/analysis/completions_file.py), the columns the page shows.
COMPLETION_COLUMNS = ("model", "row", "task", "seed", "document", "prompt", "completion")
STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1280px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-top: 2px solid #ccc; padding-top: 0.6em; margin-top: 2em; }
h2 small, figcaption, .note { color: #555; font-weight: normal; font-size: 0.85em; }
code { background: #f3f3f3; padding: 0 0.2em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.15em 0.5em; text-align: left; vertical-align: top; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { white-space: pre-wrap; max-width: 40em; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0; border: 1px solid #ddd; padding: 0.4em; flex: 0 1 380px; }
figure svg { display: block; width: 100%; height: auto; }
""".strip()


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _table(label: str, rows: list[str], columns: list[tuple[str, list[str]]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in [label, *(h for h, _ in columns)])
    body = "\n".join("<tr><th>" + _e(row) + "</th>" + "".join(f'<td class="num">{_e(texts[i])}</td>' for _, texts in columns)
                     + "</tr>" for i, row in enumerate(rows))
    return f"<table>\n<tr>{head}</tr>\n{body}\n</table>"


def _link(path: Path, index: Path, text: str | None = None) -> str:
    return f'<a href="{_e(Path(os.path.relpath(path, index.parent)).as_posix())}">{_e(text or path.name)}</a>'


def _figures(summary: TableSummary, model: ModelSummary, kind: str, number: list[int]) -> str:
    out = []
    for column in (c for c in model.shown if c.kind == kind):
        cells = [model.cells.get((row, column.header)) for row in model.rows]
        number[0] += 1
        salt = f"{anchor(summary.table)}-f{number[0]}"
        svg = forest_svg(column.header, f"row - {model.reference}", model.rows, cells, salt)
        out.append(f'<figure id="{_e(salt)}">{svg}<figcaption>{_e(column.header)}: each row minus '
                   f"{_e(model.reference)}; dot: mean over seeds (filled: rejected), bar: 95% interval, cross: each "
                   f'seed. Regenerate: <code>{COMMAND}</code>, from <a href="#{_e(anchor(summary.table))}-sources">'
                   "these files</a>.</figcaption></figure>")
    return '<div class="figures">\n' + "\n".join(out) + "\n</div>" if out else ""


def _sources(summary: TableSummary, index: Path) -> str:
    """Which files the section reads and the command that wrote each."""
    name, path = summary.table.name, summary.shown_path
    files = [(f"{name}.json", summary.command), (f"{name}_seeds.json", f"python -m repro.seed_level {path}"),
             (f"{name}_primary.json", f"python -m repro.primary_family {path}")]
    found = [f"{_link(summary.table.with_name(f), index)} (<code>{_e(c)}</code>)" for f, c in files
             if summary.table.with_name(f).is_file()]
    return (f'<p class="note" id="{_e(anchor(summary.table))}-sources">Read from ' + ", ".join(found)
            + f"; this section and its figures by <code>{COMMAND}</code>.</p>")


def read_completions(path: Path) -> list[dict]:
    """The rows of a NAME_completions.parquet; ValueError naming it when it lacks a column the page shows."""
    import pyarrow.parquet as pq  # deferred: only a table with stored completions needs it

    found = pq.read_table(path)
    missing = [c for c in COMPLETION_COLUMNS if c not in found.column_names]
    if missing:
        raise ValueError(f"{path} lacks the columns {missing} (it has {found.column_names}): the report shows "
                         f"{list(COMPLETION_COLUMNS)}; write them under these names")
    return found.select(list(COMPLETION_COLUMNS)).to_pylist()


def _cut(text) -> str:
    text = str(text)
    return _e(text[:COMPLETION_CHARS] + ("…" if len(text) > COMPLETION_CHARS else ""))


def _completions(summary: TableSummary, index: Path) -> str:
    path = summary.table.with_name(f"{summary.table.name}_completions.parquet")
    if not path.is_file():
        return f'<p class="note">{NOT_COMPUTED}: no {_e(path.name)} beside the table.</p>'
    records = sorted(read_completions(path), key=lambda r: (str(r["model"]), str(r["row"]), str(r["task"]),
                                                            -1 if r["seed"] is None else r["seed"], str(r["document"])))
    shown, counts = [], {}
    for r in records:
        key = (r["model"], r["row"])
        if counts.setdefault(key, 0) < COMPLETIONS_PER_ROW:
            counts[key] += 1
            shown.append("<tr>" + "".join(f"<td>{_e(r[c])}</td>" for c in COMPLETION_COLUMNS[:5])
                         + "".join(f'<td class="text">{_cut(r[c])}</td>' for c in COMPLETION_COLUMNS[5:]) + "</tr>")
    head = "".join(f"<th>{c}</th>" for c in COMPLETION_COLUMNS)
    markdown = path.with_suffix(".md")
    return (f"<p>The first {COMPLETIONS_PER_ROW} of each row (by task, seed and document) of the {len(records)} in "
            f"{_link(path, index)}" + (f"; more in {_link(markdown, index)}" if markdown.is_file() else "")
            + f".</p>\n<table>\n<tr>{head}</tr>\n" + "\n".join(shown) + "\n</table>")


def _gates(model: ModelSummary) -> str:
    parts = []
    if model.gates:
        rows, columns = gate_rows(model)
        parts.append("<p>Mean over seeds (each seed).</p>\n" + _table("row", rows, columns))
    if model.gate_open is not None:
        parts.append(_table("gate_open", [k for k, _ in flatten(model.gate_open)],
                            [("value", [v for _, v in flatten(model.gate_open)])]))
    return "\n".join(parts) or f'<p class="note">{NOT_COMPUTED} in this table.</p>'


def section(summary: TableSummary, index: Path, number: list[int]) -> str:
    links = " · ".join(_link(summary.table.with_name(name), index, what) for what, name in summary.links.items()
                       if what != "report")
    out = [f'<section id="{_e(anchor(summary.table))}">',
           f"<h2>{_e(summary.title)} <small>{_e(summary.shown_path)}</small></h2>",
           f"<p>{_link(summary.table.with_name(f'{summary.table.name}_summary.md'), index, 'summary')} · {links}. "
           f"Profile <code>{_e(summary.profile)}</code>, seeds {_e(', '.join(map(str, summary.seeds)))}.</p>",
           f'<p class="note">{_e(summary.verdicts)}</p>', *(f'<p class="note">Note: {_e(n)}</p>' for n in summary.notes),
           _sources(summary, index)]
    for model in summary.models:
        prefix = f"{model.model}: " if len(summary.models) > 1 else ""
        if model.means:
            columns = list(dict.fromkeys(c for _, by in model.means for c in by))
            out += [f"<h3>{_e(prefix)}each row's figure (no {_e(model.reference)} row to compare with)</h3>",
                    _table("row", [r for r, _ in model.means], [(c, [by.get(c, "n/a") for _, by in model.means])
                                                              for c in columns])]
            continue
        for kind, heading in (("effect", "Effect on each attribute"), ("cost", "Costs")):
            rows, columns = differences(model, kind)
            out += [f"<h3>{_e(prefix)}{heading} (row - {_e(model.reference)})</h3>",
                    _table("row", rows, columns) + "\n" + _figures(summary, model, kind, number)
                    if columns else f'<p class="note">{NOT_COMPUTED} in this table.</p>']
        rows, columns = differences(model, None)
        if columns:
            out += [f"<h3>{_e(prefix)}Between rows</h3>", _table("rows", rows, columns)]
        out += [f"<h3>{_e(prefix)}Gate open rate</h3>", _gates(model)]
    if summary.missing:
        out.append(f'<p class="note">{NOT_COMPUTED.capitalize()} in this table: {_e(", ".join(summary.missing))}.</p>')
    out += ["<h3>Stored completions</h3>", _completions(summary, index), "</section>"]
    return "\n".join(out)


def build(root: Path = RESULTS, index: Path | None = None) -> tuple[str, list[TableSummary]]:
    """The page for every table under ``root`` (``find_tables``), and their summaries."""
    index = index or root / "index.html"
    summaries = [load(table) for table in find_tables(root)]
    number = [0]
    sections = [section(s, index, number) for s in summaries]
    marks = "; ".join(f"{_e(m)} {_e(meaning)}" for m, meaning in MARKS.items())
    nav = "\n".join(f'<li><a href="#{_e(anchor(s.table))}">{_e(s.shown_path)}</a>: {_e(s.title)}</li>' for s in summaries)
    page = ["<!DOCTYPE html>", '<html lang="en">', '<head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<title>mari-eval: the results at a glance</title>", f"<style>\n{STYLE}\n</style>", "</head>", "<body>",
            "<h1>mari-eval: the results at a glance</h1>",
            f"<p>Written by <code>{COMMAND}</code> from the committed tables under results/ (their JSON, seed-level "
            "and primary-family files, and stored completions where a table has them); <code>"
            f"{COMMAND} --check</code> says whether this page and every table's summary are what the code gives. "
            "Each table's section: its summary (each row minus the reference row: mean over seeds, 95% interval, "
            f"verdict), a forest plot per column, the gate's open rates and a few stored completions. Marks: {marks}. "
            "Nothing here is fetched from the network.</p>", f"<nav><ul>\n{nav}\n</ul></nav>", *sections,
            "</body>", "</html>"]
    return "\n".join(page) + "\n", summaries


def write_readings(table: Path, root: Path = RESULTS) -> None:
    """What a reader opens first, written again after ``table``'s files: its NAME_summary.md, and ``root``/index.html
    when the table lies under ``root`` (a table written elsewhere, as ``repro.rerender --check`` does, leaves it)."""
    from mari_eval.storage.files import atomic_write  # deferred: only writing needs it

    write_summary(table)
    if table.resolve().is_relative_to(root.resolve()):
        atomic_write(root / "index.html", build(root)[0])
