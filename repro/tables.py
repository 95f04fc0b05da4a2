"""The paper's tables beside ours: reading the paper's figures, tallying seeds, and writing
results/<name>.{json,md,tex} and figures atomically.

The Markdown and LaTeX tables are rendered by tabulate (``markdown_table``, ``latex_table``);
the JSON is strict (``mari_eval.files.write_results_json``: a missing number is null, never a
bare NaN), and such a cell reads "n/a" in the tables."""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path

from tabulate import LATEX_ESCAPE_RULES, tabulate

from mari_eval.files import atomic_write, write_results_json
from repro.cache import Store, resolved_dtype
from repro.profiles import COLUMN_DIGITS, PAPER, PERCENT_COLUMNS, Profile, describe


# ----------------------------------------------------------------------------- the paper's tables


def paper_rows(name: str) -> list[dict[str, str]]:
    """Rows of one of the paper's tables (results/paper/<name>.csv, copied from ../shared/paper)."""
    path = PAPER / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: copy it from ../shared/paper/{name}.csv")
    with open(path) as fh:
        return list(csv.DictReader(fh))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    import statistics

    if not values:
        return float("nan"), None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(mean: float, std: float | None, digits: int = 2) -> str:
    if mean != mean:  # NaN
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def add_gate_rates(scores: dict[str, dict], columns: dict[str, str]) -> dict[str, dict]:
    """``scores`` plus a column per {new column: benchmark column}: the fraction of that
    benchmark's documents on which MARI's energy gate opened (from its evaluation's
    diagnostics; NaN where there is no gate)."""
    for gate_column, column in columns.items():
        rate = (scores[column]["diagnostics"] or {}).get("gate_rate")
        scores[gate_column] = {"value": float("nan") if rate is None else rate, "n": scores[column]["n"]}
    return scores


def tally(cells: dict, model: str, label: str, scores: dict[str, dict]) -> None:
    """Add one seed's ``score`` results to ``cells`` = {model: {row label: {column: {"values", "n"}}}}."""
    for column, result in scores.items():
        cell = cells.setdefault(model, {}).setdefault(label, {}).setdefault(column, {"values": [], "n": result["n"]})
        cell["values"].append(result["value"])


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display on CI or servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------- writing tables


def cost(store: Store) -> str:
    """What the steps behind a table cost, whether this run computed them or read them back."""
    reused = sum(1 for name in store.step_seconds if name not in store.computed)
    return (f"its {len(store.step_seconds)} training and evaluation steps took {store.compute_seconds():.0f} s of "
            f"computation ({reused} of them read back from the cache under runs/)")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown (GitHub pipe) table of ``rows`` under ``headers``, cells as given (strings,
    never re-parsed as numbers), a "|" inside one escaped."""
    cell = lambda c: str(c).replace("\n", " ").replace("|", "\\|")  # noqa: E731
    return tabulate([[cell(c) for c in row] for row in rows], headers=[cell(h) for h in headers], tablefmt="pipe",
                    disable_numparse=True)


def latex_escape(text: str) -> str:
    """``text`` for LaTeX's text mode: the characters LaTeX reads as commands escaped as
    tabulate's LaTeX formats escape them (%, _, &, #, $, braces, ...), "±" as $\\pm$."""
    return "".join(LATEX_ESCAPE_RULES.get(c, c) for c in str(text).replace("\n", " ")).replace("±", "$\\pm$")


def latex_table(headers: list[str], blocks: list[tuple[str | None, list[list[str]]]]) -> str:
    """A booktabs ``tabular`` (first column left, the others centred) of the rows of ``blocks``
    = [(title, rows)], each block under a row spanning the table with its title in italics
    (none for a title None). Every cell and title is escaped (``latex_escape``)."""
    rows = [[latex_escape(c) for c in row] for _, block in blocks for row in block]
    # Escaped before tabulate lays the columns out (its raw format), so that they line up as written.
    text = tabulate(rows, headers=[latex_escape(h) for h in headers], tablefmt="latex_raw", disable_numparse=True,
                    colalign=["left"] + ["center"] * (len(headers) - 1))
    lines = text.split("\n")  # \begin{tabular}, a rule, the header, a rule, a line per row, a rule, \end{tabular}
    head, body, tail = lines[:4], lines[4:-2], lines[-2:]
    if len(body) != len(rows) or not head[0].startswith("\\begin{tabular}") or tail[1] != "\\end{tabular}":
        raise RuntimeError(f"unexpected LaTeX from tabulate:\n{text}")
    out, start = [head[0], "\\toprule", head[2], "\\midrule"], 0
    for title, block in blocks:
        if title is not None:
            out.append(f"\\multicolumn{{{len(headers)}}}{{c}}{{\\textit{{{latex_escape(title)}}}}} \\\\")
        out += body[start:start + len(block)]
        start += len(block)
    return "\n".join(out + ["\\bottomrule", tail[1]]) + "\n"


def write_tables(out: Path, name: str, title: str, intro: str, cells: dict, columns: list[str], paper_lookup,
                 profile: Profile, command: str, wall: float, store: Store, notes: dict | None = None) -> dict:
    """results/<name>.{json,md,tex} from ``cells`` = {model: {row label: {column: {"values", "n"}}}}.

    ``paper_lookup(model) -> (paper model, {row label: {column: figure}})`` gives the paper's
    figures, shown in their own column beside ours and never mixed into them. ``notes`` =
    {model: {row label: [lines]}}: what a row was made with (the baselines' recipes), listed
    under the Markdown table and kept in the row's JSON ("notes").
    """
    record = {"command": command, "profile": profile.name, "seeds": profile.seeds, "max_train": profile.max_train,
              "max_ctrl": profile.max_ctrl, "limits": profile.limits, "gen_tokens": profile.gen_tokens, "tasks": profile.tasks,
              "placement": asdict(store.placement),
              "wall_time_s": round(wall, 1), "compute_time_s": store.compute_seconds(), "computed_now": store.computed,
              "models": {}}
    md = [f"# {title}\n", f"Generated by `{command}` (profile `{profile.name}`, seeds {profile.seeds}, "
          f"{describe(store.placement)}) in {wall:.0f} s; "
          f"{cost(store)}. {intro}\n"]
    tex_blocks = []
    for model, rows in cells.items():
        paper_model, paper = paper_lookup(model)
        entry = record["models"][model] = {"paper_model": paper_model, "dtype": resolved_dtype(store.placement.dtype, model),
                                           "rows": []}
        md_rows, tex_rows = [], []
        for label, by_column in rows.items():
            row = {"row": label, "ours": {}, "n": {}, "paper": {}}
            if (notes or {}).get(model, {}).get(label):
                row["notes"] = notes[model][label]
            md_cells, tex_cells = [label], [label]
            for column in columns:
                cell = by_column.get(column, {"values": [], "n": 0})
                mean, std = mean_std([v for v in cell["values"] if v is not None and v == v])  # NaN, None: missing
                figure = paper.get(label, {}).get(column)
                row["ours"][column] = {"mean": mean, "std": std, "values": cell["values"]}
                row["n"][column] = cell["n"]
                row["paper"][column] = float(figure) if figure not in (None, "") else None
                digits = 2 if column in PERCENT_COLUMNS or column not in COLUMN_DIGITS else COLUMN_DIGITS[column]
                md_cells += [f"{fmt(mean, std, digits)} (n={cell['n']})", figure or "-"]
                tex_cells.append(fmt(mean, std, digits))
            entry["rows"].append(row)
            md_rows.append(md_cells)
            tex_rows.append(tex_cells)
        md += [f"\n## {model} ({entry['dtype']}; paper column: {paper_model})\n",
               markdown_table(["row"] + [f"{c} ({who})" for c in columns for who in ("ours", "paper")], md_rows)]
        md += [f"\n- {label}: {'; '.join(lines)}" for label, lines in (notes or {}).get(model, {}).items()]
        tex_blocks.append((model, tex_rows))
    write_results_json(out / f"{name}.json", record)  # strict: a missing number (NaN) is null
    atomic_write(out / f"{name}.md", "\n".join(md) + "\n")
    atomic_write(out / f"{name}.tex", latex_table(["Row"] + columns, tex_blocks))
    print("\n".join(md))
    return record
