"""One screen per table: NAME_summary.md, the cells a reader looks for first (issue 82).

One row per method; one column per attribute's primary metric and per cost column; each cell the row
minus the reference row (Vanilla): the mean over seeds of each seed's difference, its 95% interval and
a mark for the verdict of the family of tests that decides it. Read from JSON only (the table's
NAME.json, NAME_seeds.json of ``python -m repro.seed_level``, NAME_primary.json of ``python -m
repro.primary_family``), so that ``python -m repro.summary`` prints it in well under a second: this
module imports nothing heavier than tabulate.

Where each cell comes from, first found first:

* the primary family (NAME_primary.json): its member for this row and column(s), verdict "rejected";
* the seed-level tests (NAME_seeds.json): the t interval over the seeds' differences, verdict Holm over
  the table's own family (every difference from the reference row); where every seed gave the same
  difference there is no t test and the interval is the hierarchical bootstrap's (repro/seed_level.py);
* the table's own paired difference (NAME.json), for a column scored under one seed: conditional on the
  trained bundles, its verdict Holm over the table's tests.

A seeds or primary file whose per-seed differences do not match the table's per-seed figures was
computed from another run of the table: it is set aside and the summary says so and names the command.

The primary metric per attribute and the costs tested are those of the primary family's file
(repro/primary_family.json, the one place they are defined); ``EXTRA_COSTS`` adds the cost columns the
tables carried before it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
FAMILY_SPEC = REPO / "repro" / "primary_family.json"
JUDGE_AGREEMENT = RESULTS / "judge_agreement.json"
# Costs shown beside the primary family's own: over-refusal on XSTest's safe prompts, KL on general text
# under the TruthfulQA bundle, and general capability (MMLU; GSM8K in the transfer table).
EXTRA_COSTS = ("xstest_safe_refusal", "kl", "mmlu", "gsm8k")
GATE_PREFIX = "gate_"  # columns holding MARI's gate open rate on a task (the sensitivity and transfer tables)
WIDTH = 100  # the widest line of a summary
ALPHA = 0.05
# The tables first in a folder (the others follow by name): the report and ``find_tables`` list them so.
TABLE_ORDER = ("main_table", "ablation_table", "baseline_recipes", "sensitivity", "transfer_gsm8k", "latency")
MARKS = {"†": "rejected after Holm", "*": "p < 0.05 before correction, not rejected after",
         "=": "every seed gave the same difference: no t test (hierarchical bootstrap interval)"}


@dataclass(frozen=True)
class Cell:
    """One difference: its mean, 95% interval (None: none), each seed's difference and the verdict mark."""

    mean: float
    interval: tuple[float, float] | None
    per_seed: tuple[float, ...]
    mark: str
    source: str  # "primary", "seeds" or "conditional"


@dataclass(frozen=True)
class Column:
    """A summary column: a table column, or a cost of the primary family averaging several (kl_benign's three)."""

    header: str
    kind: str  # "effect" or "cost"
    columns: tuple[str, ...]


@dataclass
class ModelSummary:
    model: str
    reference: str | None
    rows: list[str]  # the table's rows but the reference, in order
    shown: list[Column]
    cells: dict[tuple[str, str], Cell]  # (row, header)
    between: list[tuple[str, dict[str, Cell]]]  # ("A - B", {header: cell})
    gates: list[tuple[str, dict[str, list[float]]]]  # (row, {gate column: per-seed rates})
    gate_open: dict | None  # the table's gate_open block, as written
    at_chance: dict[str, float]
    means: list[tuple[str, dict[str, str]]]  # a table without a reference row: (row, {column: "mean [ci]"})


@dataclass
class TableSummary:
    table: Path
    shown_path: str
    title: str
    command: str  # what computed the table
    profile: str
    seeds: list
    verdicts: str
    notes: list[str] = field(default_factory=list)
    models: list[ModelSummary] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # the family's columns, and the gate's rates, the table lacks
    links: dict[str, str] = field(default_factory=dict)  # what -> file name beside the table


def shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (as the commands name tables)."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return path.as_posix()


def anchor(table: Path) -> str:
    """The id of ``table``'s section in results/index.html: its path with "-" for "/"."""
    return shown(table).replace("/", "-")


def is_table(path: Path) -> bool:
    """A table of ``repro.analysis.tables.write_tables``: NAME.json beside NAME_documents.parquet."""
    return path.suffix == ".json" and (path.parent / f"{path.stem}_documents.parquet").is_file()


def find_tables(root: Path = RESULTS) -> list[Path]:
    """Every table under ``root``, at any depth, as stems: ``root``'s own first, then each folder's by path;
    in a folder ``TABLE_ORDER`` first, then by name."""
    rank = lambda p: (p.parent != root, p.parent.as_posix(),  # noqa: E731
                      TABLE_ORDER.index(p.stem) if p.stem in TABLE_ORDER else len(TABLE_ORDER), p.stem)
    found = [p.with_name(p.name.removesuffix("_documents.parquet") + ".json") for p in root.rglob("*_documents.parquet")]
    return [p.with_suffix("") for p in sorted(found, key=rank) if is_table(p)]


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def family_spec() -> dict:
    if not FAMILY_SPEC.is_file():
        raise FileNotFoundError(f"{FAMILY_SPEC} is missing: the primary family names each attribute's primary column")
    return json.loads(FAMILY_SPEC.read_text())


def judged_sorry(spec: dict) -> tuple[str, str]:
    """The primary family's rule for SORRY-Bench's primary column, and why: the judged rate when
    results/judge_agreement.json names a judge whose held-out kappa reaches its floor (``judged_column``:
    {"passes": true, ...}), else the keyword rate. Read here and by repro/primary_family.py."""
    entry = spec["primary"]["sorry_bench"]
    judged = (_read(JUDGE_AGREEMENT) or {}).get("judged_column") or {}
    if judged.get("passes"):
        return entry["column"], f"judged: {judged.get('judge')} held-out kappa {judged.get('kappa')} >= {judged.get('floor')}"
    return entry["fallback"], ("keyword judge: no LLM judge in results/judge_agreement.json reaches the kappa floor"
                               + (f" ({judged.get('judge')}: kappa {judged.get('kappa')})" if judged else ""))


def sorry_column(spec: dict, primary: dict | None) -> str:
    """SORRY-Bench's primary column: as the table's primary-family file resolved it, else by the family's
    rule (``judged_sorry``)."""
    if primary and primary.get("sorry_primary"):
        return primary["sorry_primary"]["column"]
    return judged_sorry(spec)[0]


def _values_difference(rows: dict, row: str, against: str, columns: tuple[str, ...]) -> list[float] | None:
    """Per seed, the mean over ``columns`` of the row's figure minus the other row's (None: a figure missing)."""
    try:
        pairs = [(rows[row]["ours"][c]["values"], rows[against]["ours"][c]["values"]) for c in columns]
    except KeyError:
        return None
    if any(len(a) != len(b) or None in a or None in b for a, b in pairs):
        return None
    return [sum(a[s] - b[s] for a, b in pairs) / len(pairs) for s in range(len(pairs[0][0]))]


def _matches(per_seed, expected) -> bool:
    return expected is not None and len(per_seed) == len(expected) and all(
        math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) for x, y in zip(per_seed, expected))


def _stale(entries: list[dict], rows: dict) -> list[str]:
    """The entries whose per-seed differences do not match the table's figures."""
    return [f"{e['row']} - {e['against']} {'+'.join(e['columns'])}" for e in entries if e.get("per_seed") is not None
            and not _matches(e["per_seed"], _values_difference(rows, e["row"], e["against"], tuple(e["columns"])))]


def _mark(p: float | None, holm: float | None, decides: bool) -> str:
    if p is None:
        return "="
    if decides and holm is not None and holm < ALPHA:
        return "†"
    return "*" if p < ALPHA else ""


def _from_primary(member: dict, seeds_entry: dict | None) -> Cell:
    interval = member["t_ci"] or (seeds_entry or {}).get("hierarchical_ci")
    mark = "†" if member["rejected"] else ("=" if member["t_p"] is None else "*" if member["t_p"] < ALPHA else "")
    return Cell(member["mean"], tuple(interval) if interval else None, tuple(member["per_seed"]), mark, "primary")


def _from_seeds(entry: dict, decides: bool) -> Cell:
    interval = entry["t_ci"] or entry["hierarchical_ci"]
    return Cell(entry["mean"], tuple(interval), tuple(entry["per_seed"]),
                _mark(entry["t_p"], entry.get("t_p_holm"), decides), "seeds")


def _from_table(difference: dict, per_seed: list[float] | None) -> Cell:
    mark = "†" if difference["significant_holm"] else "*" if difference["significant"] else ""
    interval = tuple(difference["ci"]) if difference.get("ci") else None
    return Cell(difference["mean"], interval, tuple(per_seed or ()), mark, "conditional")


def _columns(spec: dict, sorry: str, present: list[str], primary_members: list[dict], reference: str) -> list[Column]:
    effects = [spec["primary"][a]["column"] if a != "sorry_bench" else sorry for a in spec["primary"]]
    out = [Column(c, "effect", (c,)) for c in effects if c in present]
    for name, cost in spec["costs"].items():
        members = [m for m in primary_members if m["against"] == reference and tuple(m["columns"]) == tuple(cost["columns"])
                   and m.get("per_seed") is not None]
        if members and len(cost["columns"]) > 1:
            out.append(Column(f"{name} (mean)", "cost", tuple(cost["columns"])))
        else:
            out += [Column(c, "cost", (c,)) for c in cost["columns"] if c in present]
    taken = {c for col in out for c in col.columns}
    return out + [Column(c, "cost", (c,)) for c in EXTRA_COSTS if c in present and c not in taken]


def _model(name: str, entry: dict, reference: str | None, spec: dict, sorry: str, seeds: list[dict] | None,
           primary: list[dict] | None) -> ModelSummary:
    rows = {r["row"]: r for r in entry["rows"]}
    present = list(dict.fromkeys(c for r in entry["rows"] for c in r["ours"]))
    gate_columns = [c for c in present if c.startswith(GATE_PREFIX)]
    gates = [(label, {c: r["ours"][c]["values"] for c in gate_columns}) for label, r in rows.items()
             if any(v is not None for c in gate_columns for v in r["ours"][c]["values"])]
    summary = ModelSummary(name, reference, [r for r in rows if r != reference], [], {}, [], gates,
                           entry.get("gate_open"), dict(entry.get("at_chance") or {}), [])
    if reference not in rows:
        summary.means = _means(rows, [c for c in present if c not in gate_columns])
        return summary
    by_seeds = {(e["row"], e["against"], e["column"]): e for e in seeds or []}
    by_primary = {(m["row"], m["against"], tuple(m["columns"])): m for m in primary or [] if m.get("per_seed") is not None}
    summary.shown = _columns(spec, sorry, present, primary or [], reference)

    def cell(row: str, against: str, column: Column) -> Cell | None:
        member = by_primary.get((row, against, column.columns))
        single = column.columns[0] if len(column.columns) == 1 else None
        found = by_seeds.get((row, against, single))
        if member is not None:
            return _from_primary(member, found)
        if found is not None:
            return _from_seeds(found, decides=primary is None and against == reference)
        if single is None or row not in rows:
            return None
        if against == reference:
            difference = rows[row]["ours"].get(single, {}).get("difference")
        else:
            difference = next((c["columns"].get(single) for c in entry.get("comparisons", [])
                               if c["row"] == row and c["against"] == against), None)
        return None if difference is None else _from_table(difference, _values_difference(rows, row, against, (single,)))

    for row in summary.rows:
        for column in summary.shown:
            found = cell(row, reference, column)
            if found is not None:
                summary.cells[row, column.header] = found
    if primary is not None:
        pairs = list(dict.fromkeys((m["row"], m["against"]) for m in primary if m["against"] != reference))
    else:
        pairs = list(dict.fromkeys([(e["row"], e["against"]) for e in seeds or [] if e["against"] != reference]
                                   + [(c["row"], c["against"]) for c in entry.get("comparisons", [])]))
    for row, against in pairs:
        cells = {c.header: found for c in summary.shown if (found := cell(row, against, c)) is not None}
        if cells:
            summary.between.append((f"{row} - {against}", cells))
    return summary


def _means(rows: dict, columns: list[str]) -> list[tuple[str, dict[str, str]]]:
    """Each row's figure per column, "mean [ci]", with the column's decimals: two significant digits of its
    intervals' typical half-width, else of a tenth of its typical figure."""
    digits = {}
    for c in columns:
        cells = [r["ours"][c] for r in rows.values() if r["ours"].get(c, {}).get("mean") is not None]
        widths = [(o["ci"][1] - o["ci"][0]) / 2 for o in cells if o.get("ci")]
        digits[c] = _digits(widths or [abs(o["mean"]) / 10 for o in cells])
    text = lambda o, d: ("n/a" if o.get("mean") is None else f"{o['mean']:.{d}f}"  # noqa: E731
                         + (f" [{o['ci'][0]:.{d}f}, {o['ci'][1]:.{d}f}]" if o.get("ci") else ""))
    return [(label, {c: text(r["ours"].get(c, {}), digits[c]) for c in columns}) for label, r in rows.items()]


def load(table: Path) -> TableSummary:
    """The summary of ``table`` (a results path without suffix) from its JSON files."""
    record = _read(table.with_suffix(".json"))
    if not record or "models" not in record or "uncertainty" not in record:
        raise ValueError(f"{table}.json is not a table of repro.analysis.tables.write_tables (no 'models' and "
                         "'uncertainty'): name a table's results path, e.g. results/main_table")
    spec = family_spec()
    name = table.name
    seeds_file, primary_file = _read(table.with_name(f"{name}_seeds.json")), _read(table.with_name(f"{name}_primary.json"))
    md = table.with_suffix(".md")
    title = md.read_text().split("\n", 1)[0].lstrip("# ").strip() if md.is_file() else name
    reference = record["uncertainty"]["reference"]
    out = TableSummary(table, shown(table), title, record.get("command", "?"), record.get("profile", "?"),
                       record.get("seeds", []), "")
    out.links = {what: f"{name}{suffix}" for what, suffix in
                 (("full table", ".md"), ("seed-level tests", "_seeds.md"), ("primary family", "_primary.md"))
                 if table.with_name(f"{name}{suffix}").is_file()}
    if table.resolve().is_relative_to(RESULTS):  # the report's section of this table
        out.links["report"] = f"{os.path.relpath(RESULTS / 'index.html', table.resolve().parent)}#{anchor(table)}"
    refresh = {"seeds": f"python -m repro.seed_level {out.shown_path}", "primary": f"python -m repro.primary_family {out.shown_path}"}
    for kind, found in (("seeds", seeds_file), ("primary", primary_file)):
        if found is None:
            continue
        entries = [{**e, "columns": e.get("columns") or [e["column"]]} for m in found["models"].values()
                   for e in (m["members"] if kind == "primary" else m)]
        stale = [s for model, entry in record["models"].items() for s in
                 _stale([e for e in entries], {r["row"]: r for r in entry["rows"]})]
        if stale:
            out.notes.append(f"{name}_{kind}.json does not match {name}.json ({stale[0]}: other per-seed differences): "
                             f"set aside; `{refresh[kind]}` computes it again.")
            seeds_file, primary_file = (None, primary_file) if kind == "seeds" else (seeds_file, None)
    sorry = sorry_column(spec, primary_file)
    for model, entry in record["models"].items():
        seeds = (seeds_file or {}).get("models", {}).get(model)
        primary = (primary_file or {}).get("models", {}).get(model, {}).get("members") if primary_file else None
        out.models.append(_model(model, entry, reference, spec, sorry, seeds, primary))
    shown_columns = {c for m in out.models for col in m.shown for c in col.columns}
    out.others = [c for c in dict.fromkeys(c for m in record["models"].values() for r in m["rows"] for c in r["ours"])
                  if c not in shown_columns and not c.startswith(GATE_PREFIX)]
    if any(m.reference in (r["row"] for r in record["models"][m.model]["rows"]) for m in out.models):
        wanted = [c for cost in spec["costs"].values() for c in cost["columns"]]
        present = {c for m in record["models"].values() for r in m["rows"] for c in r["ours"]}
        out.missing = [c for c in dict.fromkeys(wanted) if c not in present]
        if not any(m.gates or m.gate_open is not None for m in out.models):
            out.missing.append("gate open rates (gate_open)")
    multi_seed = any(len(o["values"]) > 1 for m in record["models"].values() for r in m["rows"] for o in r["ours"].values())
    out.verdicts = _verdicts(out, seeds_file, primary_file, refresh, multi_seed)
    return out


def _verdicts(out: TableSummary, seeds_file: dict | None, primary_file: dict | None, refresh: dict,
              multi_seed: bool) -> str:
    name = out.table.name
    if primary_file:
        return (f"Verdicts: the primary family ({primary_file['size']} tests fixed in {primary_file['family']}; "
                f"{name}_primary.md) for its members; the other cells carry no † (their seed-level tests: {name}_seeds.md).")
    reference = out.models[0].reference if out.models else None
    tested = sum(1 for m in (seeds_file or {}).get("models", {}).values() for e in m
                 if e["against"] == reference and e["t_p"] is not None)
    sources = {c.source for m in out.models for c in m.cells.values()}
    own = "the table's own paired tests, Holm over its tests (one seed: conditional on the trained bundles)"
    if seeds_file:
        where = f"Holm over this table's {tested} seed-level tests of a difference from the reference row ({name}_seeds.md)"
    elif multi_seed:
        where = f"seed-level tests not computed (`{refresh['seeds']}`); meanwhile {own}"
    else:
        where = f"{own}; no seed-level test with one seed"
    primary = f"the primary family not computed for this table (`{refresh['primary']}`)" if multi_seed else ""
    mixed = ("A column under one seed (marked so where others have more): the table's own paired test, Holm over its "
             "tests." if seeds_file and "conditional" in sources else "")
    return " ".join(part for part in (f"Verdicts: {where}" + (f"; {primary}." if primary else "."), mixed) if part)


def _digits(half_widths: list[float]) -> int:
    """Decimals that show two significant digits of the typical interval half-width (0 to 4)."""
    widths = sorted(w for w in half_widths if w and w > 0 and math.isfinite(w))
    if not widths:
        return 2
    return max(0, min(4, 1 - math.floor(math.log10(widths[len(widths) // 2]))))
