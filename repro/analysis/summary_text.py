"""A table's summary (``repro.analysis.summary``) as text: NAME_summary.md, at most ``WIDTH`` characters a line.

A grid wider than that is cut into several grids of the same rows, each as wide as fits. Each column
shows its decimals from its intervals' typical half-width (two significant digits of it), so a
percentage and a KL in nats read alike."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tabulate import tabulate

from mari_eval.storage.files import atomic_write

from repro.analysis.summary import MARKS, WIDTH, Cell, ModelSummary, TableSummary, _digits, load

NOT_COMPUTED = "not computed"
NBSP = "\u00a0"


def cell_text(cell: Cell | None, digits: int) -> str:
    if cell is None:
        return NOT_COMPUTED
    interval = f" [{cell.interval[0]:.{digits}f}, {cell.interval[1]:.{digits}f}]" if cell.interval else ""
    return f"{cell.mean:+.{digits}f}{interval}{cell.mark}"


def column_digits(cells: list[Cell | None]) -> int:
    return _digits([(c.interval[1] - c.interval[0]) / 2 for c in cells if c is not None and c.interval])


def grid(label: str, rows: list[str], columns: list[tuple[str, list[str]]]) -> list[str]:
    """Pipe tables of ``rows`` x ``columns`` ([(header, a text per row)]), cut so that none is wider than ``WIDTH``."""
    out, start = [], 0
    while start < len(columns):
        end = start + 1
        while end < len(columns) and _width(label, rows, columns[start:end + 1]) <= WIDTH:
            end += 1
        out.append(_pipe(label, rows, columns[start:end]))
        start = end
    return out


def _pipe(label: str, rows: list[str], columns: list[tuple[str, list[str]]]) -> str:
    body = [[row, *(texts[i] for _, texts in columns)] for i, row in enumerate(rows)]
    return tabulate(body, headers=[label, *(h for h, _ in columns)], tablefmt="pipe", disable_numparse=True)


def _width(label: str, rows: list[str], columns: list[tuple[str, list[str]]]) -> int:
    return max(len(line) for line in _pipe(label, rows, columns).split("\n"))


def wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def _headers(model: ModelSummary) -> dict[str, str]:
    """Each column's header, "(1 seed)" added where its cells are the table's conditional difference and
    other columns' are seed-level."""
    sources = {c.header: {cell.source for (_, h), cell in model.cells.items() if h == c.header} for c in model.shown}
    mixed = len(set().union(*sources.values())) > 1 if sources else False
    return {h: f"{h} (1 seed)" if mixed and found == {"conditional"} else h for h, found in sources.items()}


def differences(model: ModelSummary, kind: str | None) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(rows, columns) of the grid of ``kind`` ("effect", "cost"; None: between rows)."""
    headers = _headers(model)
    if kind is None:
        rows = [label for label, _ in model.between]
        shown = [c for c in model.shown if any(c.header in cells for _, cells in model.between)]
        found = {(label, h): cell for label, cells in model.between for h, cell in cells.items()}
    else:
        rows, shown, found = model.rows, [c for c in model.shown if c.kind == kind], model.cells
    columns = []
    for column in shown:
        cells = [found.get((row, column.header)) for row in rows]
        digits = column_digits(cells)
        columns.append((headers.get(column.header, column.header), [cell_text(c, digits) for c in cells]))
    return rows, columns


def gate_rows(model: ModelSummary) -> tuple[list[str], list[tuple[str, list[str]]]]:
    rows = [row for row, _ in model.gates]
    columns = sorted({c for _, by in model.gates for c in by})
    text = lambda vs: ("n/a" if not vs or None in vs else f"{sum(vs) / len(vs):.3f}"  # noqa: E731
                       + (f" ({' / '.join(f'{v:.3f}' for v in vs)})" if vs and None not in vs and len(vs) > 1 else ""))
    return rows, [(c, [text(by.get(c)) for _, by in model.gates]) for c in columns]


def flatten(block, path: str = "") -> list[tuple[str, str]]:
    """A nested JSON block as (key path, value) lines: the gate_open block, whatever its nesting."""
    if isinstance(block, dict):
        return [line for key, value in block.items() for line in flatten(value, f"{path}.{key}" if path else str(key))]
    if isinstance(block, float):
        return [(path, f"{block:.3f}")]
    if isinstance(block, list) and all(isinstance(v, (int, float)) for v in block):
        return [(path, " / ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in block))]
    return [(path, json_text(block))]


def json_text(value) -> str:
    import json  # deferred: only an unusual gate_open value needs it

    return json.dumps(value)


def intro(summary: TableSummary) -> list[str]:
    # No-break spaces inside a link's text: a wrapped line never cuts one.
    links = " · ".join(f"[{what.replace(' ', NBSP)}]({name})" for what, name in summary.links.items())
    reference = next((m.reference for m in summary.models if m.reference), "the reference row")
    used = {c.mark for m in summary.models for c in [*m.cells.values(), *(c for _, by in m.between for c in by.values())]}
    marks = "; ".join(f"{mark} {meaning}" for mark, meaning in MARKS.items() if mark in used)
    return [f"# Summary: {summary.shown_path}\n",
            wrap(f"{summary.title}. {links}. From `{summary.shown_path}` (profile `{summary.profile}`, seeds "
                 f"{', '.join(map(str, summary.seeds))}). Written with the table (repro/analysis/summary.py); "
                 f"`python -m repro.summary {summary.shown_path}` prints it.") + "\n",
            wrap(f"Each cell: the row minus {reference}, {_what(summary)} {summary.verdicts}"
                 + (f" Marks: {marks}." if marks else "")) + "\n"
            if any(not m.means for m in summary.models) else
            wrap("Each cell: the row's figure, the mean over seeds, with its 95% interval where the table has one; "
                 "the table has no reference row to take differences from.") + "\n",
            *(wrap(f"Note: {note}") + "\n" for note in summary.notes)]


def _what(summary: TableSummary) -> str:
    """What a difference cell holds: seed-level figures, the table's own (one seed), or both by column."""
    sources = {c.source for m in summary.models for c in m.cells.values()}
    seed_level = ("the mean over seeds of each seed's difference, with its 95% seed-level t interval (seeds - 1 "
                  "degrees of freedom)")
    if sources == {"conditional"}:
        return "paired on the same documents, with the table's own 95% interval (one seed)."
    return seed_level + ("; a column under one seed: the table's own paired difference." if "conditional" in sources
                         else ".")


def markdown(summary: TableSummary) -> str:
    lines = intro(summary)
    for model in summary.models:
        if model.means:
            lines += [f"## {model.model}: each row's figure (no {model.reference} row to compare with)\n"]
            columns = list(dict.fromkeys(c for _, by in model.means for c in by))
            lines += [g + "\n" for g in grid("row", [r for r, _ in model.means],
                                             [(c, [by.get(c, "n/a") for _, by in model.means]) for c in columns])]
        for kind, heading in (("effect", "effect on each attribute"), ("cost", "costs")):
            rows, columns = differences(model, kind)
            if columns:
                lines += [f"## {model.model}: {heading} (row - {model.reference})\n"]
                lines += [g + "\n" for g in grid("row", rows, columns)]
        chance = [c for c in model.at_chance if any(c in col.columns for col in model.shown)]
        if chance:
            lines.append(wrap(f"At chance under {model.reference} (its interval holds the accuracy of guessing): "
                              f"{', '.join(chance)}; a difference there is not a change of capability.") + "\n")
        rows, columns = differences(model, None)
        if columns:
            lines += [f"## {model.model}: between rows\n"] + [g + "\n" for g in grid("rows", rows, columns)]
        if model.gates:
            rows, columns = gate_rows(model)
            lines += [f"## {model.model}: gate open rate (mean over seeds, each seed)\n"]
            lines += [g + "\n" for g in grid("row", rows, columns)]
        if model.gate_open is not None:
            lines += [f"## {model.model}: gate_open\n"] + [wrap(f"- {key}: {value}") for key, value in flatten(model.gate_open)]
            lines.append("")
    combined = {c.header: c.columns for m in summary.models for c in m.shown if len(c.columns) > 1}
    lines += [wrap(f"{header}: per seed, the mean of the differences on {', '.join(columns)} (a cost of the primary "
                   "family).") + "\n" for header, columns in combined.items()]
    if summary.missing:
        lines.append(wrap(f"{NOT_COMPUTED.capitalize()} in this table: {', '.join(summary.missing)}.") + "\n")
    if summary.others:
        lines.append(wrap(f"In the full table only: {', '.join(summary.others)}.") + "\n")
    return "\n".join(lines).rstrip("\n") + "\n"


def write_summary(table: Path) -> Path:
    """NAME_summary.md beside ``table`` (a results path without suffix): what the table scripts,
    ``repro.seed_level`` and ``repro.report`` write."""
    path = table.with_name(f"{table.name}_summary.md")
    atomic_write(path, markdown(load(table)))
    return path
