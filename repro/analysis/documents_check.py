"""Is the per-document file beside a table the one the table was written with?

A table's JSON (results/NAME.json) records its per-document file (results/NAME_documents.parquet):
name, number of rows and the sha256 of its content (``documents_file.DIGEST_FIELD``). The commands
that compute from the file beside a table (``repro.seed_level``, ``repro.bbq_contexts``,
``repro.primary_family``, ``repro.rerender``) check it first (``checked_table``): another table's
file under this name, rows dropped, a seed missing, an edited score each give figures that the JSON
beside them does not describe, and are refused naming both files and the fix. ``repro.recompute``
reports the same disagreements among its mismatches, and records the digest of a table written
before tables recorded one (``--record-digest``) once every number agrees.

Checked: the digest and row count the JSON records; the models, rows and columns of the file are
the JSON's; each cell has as many seeds (strata) as the JSON has figures, names no seed twice, and
scores the JSON's ``n`` documents in each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from repro.analysis.documents_file import DIGEST_FIELD, SUFFIX, documents_digest, load_documents, read_documents


def read_record(path: Path) -> dict:
    """A table's JSON; SystemExit naming it when it cannot be read as one (cut short, not JSON)."""
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SystemExit(f"{path}: not a readable table record ({type(e).__name__}: {e}); restore it from where the "
                         "table was written (git restore, or the table's command again)") from None
    if not isinstance(record, dict) or not isinstance(record.get("models"), dict):
        raise SystemExit(f"{path}: not a table record (a JSON object with its 'models'); restore it from where the "
                         "table was written (git restore, or the table's command again)")
    return record


def header_disagreements(where: str, n, cell: dict, file: str) -> list[str]:
    """What a cell's recorded n says that its per-document scores do not (each seed, a stratum,
    scores n documents), and seeds the file names twice (two strata of one training run)."""
    out = []
    counts = [len(docs) for docs in cell["documents"]]
    if isinstance(n, int) and any(count != n for count in counts):
        out.append(f"{where}.n: {n} in the JSON, {max(counts, key=lambda c: c != n)} documents in {file} (per seed: {counts})")
    named = [s for s in cell["seeds"] if s is not None]
    if len(set(named)) != len(named):
        out.append(f"{where}.seeds: {file} names seeds {cell['seeds']}, one of them twice")
    return out


def digest_disagreements(record: dict, table: pa.Table, file: str) -> list[str]:
    """How the file's rows and content differ from what the JSON records of it (none recorded: a line saying so)."""
    recorded = record.get(DIGEST_FIELD)
    if not isinstance(recorded, dict):
        return [f"the JSON records no digest of {file} (its {DIGEST_FIELD!r})"]
    out = []
    if recorded.get("rows") != table.num_rows:
        out.append(f"{file} has {table.num_rows} rows, the JSON records {recorded.get('rows')!r}")
    found = documents_digest(table)
    if recorded.get("sha256") != found:
        out.append(f"{file}'s content has sha256 {found[:12]}, the JSON records {str(recorded.get('sha256'))[:12]}")
    return out


def cell_disagreements(record: dict, cells: dict, file: str) -> list[str]:
    """Where the file's models, rows, columns and seeds are not the JSON's (a few words each)."""
    out = []
    for model, rows in cells.items():
        entry = record["models"].get(model)
        if not isinstance(entry, dict):
            out.append(f"{model}: in {file}, not in the JSON")
            continue
        recorded = {row.get("row"): row for row in entry.get("rows", [])}
        for label, by_column in rows.items():
            row = recorded.get(label)
            for column, cell in by_column.items():
                where = f"{model} / {label} / {column}"
                ours = (row or {}).get("ours", {}).get(column)
                if ours is None:
                    out.append(f"{where}: in {file}, not in the JSON")
                    continue
                figures = len(ours.get("values") or [])
                if len(cell["documents"]) != figures:
                    out.append(f"{where}: {figures} seed(s) in the JSON, {len(cell['documents'])} in {file} "
                               f"(seeds {cell['seeds']})")
                out += header_disagreements(where, row.get("n", {}).get(column), cell, file)
    for model, entry in record["models"].items():
        for row in entry.get("rows", []):
            for column, ours in row.get("ours", {}).items():
                if (ours.get("ci") is not None or ours.get("difference") is not None) and \
                        column not in cells.get(model, {}).get(row.get("row"), {}):
                    out.append(f"{model} / {row.get('row')} / {column}: an interval or difference in the JSON, "
                               f"no documents in {file}")
    return out


def checked_table(table: Path, require_digest: bool = True) -> tuple[dict, pa.Table, tuple[dict, dict, list[str]]]:
    """(the JSON, the per-document file, ``read_documents``' cells, references and columns) of ``table``
    (results/NAME), once the file is the one the JSON was written with (module docstring); SystemExit
    naming both files and the fix otherwise. ``require_digest=False`` (``repro.rerender``, which records
    it): a JSON without one is checked for its cells alone."""
    json_path, parquet = table.with_suffix(".json"), table.parent / f"{table.name}{SUFFIX}"
    record = read_record(json_path)
    documents = load_documents(parquet)
    read = read_documents(documents)
    recorded = isinstance(record.get(DIGEST_FIELD), dict)
    if not recorded and require_digest:
        raise SystemExit(f"{json_path} records no digest of {parquet} (a table written before tables recorded it): "
                         f"run `python -m repro.recompute --record-digest {table}`, which checks every number of the "
                         "JSON against the file and records its digest when they agree")
    problems = (digest_disagreements(record, documents, parquet.name) if recorded else []) + \
        cell_disagreements(record, read[0], parquet.name)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise SystemExit(f"{parquet} is not the per-document file {json_path} was written with: {shown}. Restore the "
                         f"file written with the table (git restore {parquet}, or copy it from where the table was "
                         f"written), or write the table again (`{record.get('command')}`)")
    return record, documents, read
