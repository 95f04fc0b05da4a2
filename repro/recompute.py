"""Every cell of a table recomputed from its per-document scores, results/NAME_documents.parquet.

    python -m repro.recompute results/main_table     # or main_table, or the .json or .parquet path

The file (one record per model, row, column, seed and document) is described in
``repro.analysis.documents_file``, which writes and reads it. ``recompute`` rebuilds the table's cells from that file alone and runs the tables' own
computation on them (``repro.analysis.tables.cell_interval`` and ``repro.analysis.differences``: repro/analysis/intervals.py's
intervals, paired tests and Holm's adjustment over the table), then compares every number with
results/NAME.json: each seed's figure and the mean over seeds against the per-document means (to
``repro.engine.documents.TOLERANCE``, the tolerance at which they were tied to lm-eval's figures, in
the column's units), and each interval, cluster count, difference, p, Holm p, flag and count to
``RELATIVE`` (the same seeded draws give the same numbers). The file is also checked against the
digest and row count the JSON records of it (repro/analysis/documents_check.py). The command prints
what differs and exits 1 on any mismatch (2 when a file is missing or cannot be read), 0 when every
cell agrees. ``--record-digest``: a table written before tables recorded their file's digest gains it
(``documents_file`` in its JSON, nothing else changed) once every number agrees, so that the commands
that compute from the file (``repro.seed_level``, ``repro.bbq_contexts``, ``repro.primary_family``)
accept it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pyarrow as pa

from mari_eval.storage.files import finite_json, write_results_json
from repro.analysis import differences as differences_module
from repro.analysis import tables
from repro.analysis.documents_check import digest_disagreements, header_disagreements, read_record
from repro.engine.documents import TOLERANCE
from repro.analysis.documents_file import DIGEST_FIELD, SUFFIX, documents_record, load_documents, read_documents
from repro.engine.profiles import PERCENT_COLUMNS, REPO

RELATIVE = 1e-9


def _compare(where: str, expected, got, out: list[str], relative: float = RELATIVE, absolute: float = 1e-12) -> None:
    """A line in ``out`` for each number or field of ``got`` that differs from ``expected`` (the JSON)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in sorted(set(expected) | set(got)):
            _compare(f"{where}.{key}", expected.get(key, "<absent>"), got.get(key, "<absent>"), out, relative, absolute)
    elif isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        for i, (a, b) in enumerate(zip(expected, got)):
            _compare(f"{where}[{i}]", a, b, out, relative, absolute)
    elif (isinstance(expected, (int, float)) and isinstance(got, (int, float)) and not isinstance(expected, bool)
          and not isinstance(got, bool)):
        if not math.isclose(expected, got, rel_tol=relative, abs_tol=absolute):
            out.append(f"{where}: {expected!r} in the JSON, {got!r} recomputed")
    elif expected != got:
        out.append(f"{where}: {expected!r} in the JSON, {got!r} recomputed")


def recompute(documents: Path, record: dict, table: pa.Table | None = None) -> tuple[list[str], int, int]:
    """(mismatches, cells compared, differences compared) of the table ``record`` (its JSON)
    against what ``documents`` (its Parquet; ``table``: as already read) gives."""
    table = load_documents(documents) if table is None else table
    cells, references, columns = read_documents(table)
    out: list[str] = digest_disagreements(record, table, documents.name) if isinstance(record.get(DIGEST_FIELD), dict) else []
    compared_cells = compared_differences = 0
    for model, entry in record["models"].items():
        rows = cells.get(model, {})
        differences = finite_json(differences_module.reference_differences(rows, columns, references.get(model)))
        for row in entry["rows"]:
            for column, ours in row["ours"].items():
                where = f"{model} / {row['row']} / {column}"
                cell = rows.get(row["row"], {}).get(column)
                if cell is None:
                    if ours.get("ci") is not None or ours.get("difference") is not None:
                        out.append(f"{where}: has an interval or difference in the JSON, no documents in {documents.name}")
                    continue
                compared_cells += 1
                out += header_disagreements(where, row["n"].get(column), cell, documents.name)
                scale = (100 if column in PERCENT_COLUMNS else 1) * TOLERANCE
                _compare(f"{where}.values", ours["values"], cell["values"], out, TOLERANCE, scale)
                if ours["mean"] is not None:
                    _compare(f"{where}.mean", ours["mean"], math.fsum(cell["values"]) / len(cell["values"]), out, TOLERANCE, scale)
                found, clusters = tables.cell_interval(cell) if ours["mean"] is not None else (None, None)
                got = {"ci": None if found is None else [found.low, found.high], "clusters": clusters,
                       "cluster_unit": cell["cluster_unit"] if clusters is not None else None}
                _compare(where, {k: ours.get(k) for k in got}, got, out)
                recomputed = differences.pop((row["row"], column), None)
                if ours.get("difference") is not None or recomputed is not None:
                    compared_differences += 1
                    _compare(f"{where}.difference", ours.get("difference"), recomputed, out)
        out += [f"{model} / {label} / {column}: a difference recomputed, none in the JSON" for label, column in differences]
        if entry.get("comparisons"):  # the table's extra pairs of rows (write_tables(comparisons=...))
            pairs = [(c["row"], c["against"]) for c in entry["comparisons"]]
            compared_differences += sum(len(c["columns"]) for c in entry["comparisons"])
            _compare(f"{model} / comparisons", entry["comparisons"], finite_json(differences_module.comparisons_json(rows, columns, pairs)), out)
    out += [f"{model}: in {documents.name}, not in the JSON" for model in cells if model not in record["models"]]
    return out, compared_cells, compared_differences


def paths(target: str) -> tuple[Path, Path]:
    """(NAME_documents.parquet, NAME.json) of results/NAME, NAME, NAME.json or NAME_documents.parquet."""
    path = Path(target)
    name = path.name.removesuffix(SUFFIX).removesuffix(".json")
    base = path.with_name(name)
    if not base.with_name(name + ".json").exists() and len(path.parts) == 1:
        base = REPO / "results" / name
    return base.with_name(name + SUFFIX), base.with_name(name + ".json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", nargs="+", help="results/NAME (or NAME, NAME.json, NAME_documents.parquet)")
    parser.add_argument("--record-digest", action="store_true",
                        help="a table whose JSON records no digest of its per-document file gains it when every number "
                             "agrees (nothing else in the JSON changes)")
    args = parser.parse_args(argv)
    status = 0
    for target in args.tables:
        documents, table = paths(target)
        if not documents.is_file() or not table.is_file():
            print(f"{target}: {documents if not documents.is_file() else table} is missing", file=sys.stderr)
            status = max(status, 2)
            continue
        try:
            record, frame = read_record(table), load_documents(documents)
        except SystemExit as e:  # cut short, not JSON or Parquet: named with the fix
            print(e, file=sys.stderr)
            status = max(status, 2)
            continue
        mismatches, cells, differences = recompute(documents, record, frame)
        for line in mismatches:
            print(f"{table.stem}: {line}")
        verdict = f"{len(mismatches)} mismatch(es)" if mismatches else "every number agrees"
        print(f"{table.stem}: {cells} cells and {differences} paired differences recomputed from {documents.name}: {verdict}")
        if not isinstance(record.get(DIGEST_FIELD), dict):
            _record_digest(table, record, frame, documents.name, args.record_digest and not mismatches)
        status = max(status, 1 if mismatches else 0)
    return status


def _record_digest(table: Path, record: dict, frame: pa.Table, name: str, write: bool) -> None:
    """Add the per-document file's digest to a table's JSON that records none (``write``), or say how."""
    if not write:
        print(f"{table.stem}: {table} records no digest of {name} (written before tables recorded it); "
              f"`python -m repro.recompute --record-digest {table}` records it when every number agrees")
        return
    models = record.pop("models")  # the digest goes where write_tables puts it: just before the models
    write_results_json(table, {**{k: v for k, v in record.items() if k != DIGEST_FIELD},
                               DIGEST_FIELD: documents_record(frame, name), "models": models})
    print(f"{table.stem}: recorded the digest of {name} in {table}")


if __name__ == "__main__":
    sys.exit(main())
