"""A table's per-document scores as a file, results/NAME_documents.parquet: what a cell holds
of them (``cell_documents``, ``cell_clusters``), ``write_documents`` (called by
``repro.analysis.tables.write_tables``) and ``read_documents`` (``repro.recompute``'s input).

One record per model, row, column, seed and document of every cell that has per-document scores
(the cells behind the intervals and paired tests), zstd-compressed Parquet with the columns

    model, row, column, stratum (0, 1, ...: the seeds in the order tallied), seed (None: unknown),
    document, cluster (BBQ: its context, repro/engine/documents.py ``cluster_id``; else None),
    cluster_unit ("context" or None), reference (the row it is compared with, None for that row
    itself), score (None: a document without a score, left out of the mean)

so that ``pandas.read_parquet("results/main_table_documents.parquet")`` is the whole of it. The table's
JSON records which file it was written with (``DIGEST_FIELD``: its name, rows and ``documents_digest``);
the commands that read the file check it (repro/analysis/documents_check.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mari_eval.storage.files import atomic_write


def cell_documents(cell: dict) -> list | None:
    """A cell's per-document scores per seed, or None unless every seed has them."""
    docs = cell.get("documents") or []
    return docs if docs and all(docs) and len(docs) == len(cell["values"]) else None


def cell_clusters(cell: dict) -> list | None:
    """A cell's {document: cluster} per seed, or None when its documents are their own units."""
    found = cell.get("clusters") or []
    if not any(found):
        return None
    if not all(found) or len(found) != len(cell["values"]):
        raise ValueError(f"clusters for {sum(map(bool, found))} of {len(cell['values'])} seeds: all or none")
    return found


SCHEMA = pa.schema([("model", pa.string()), ("row", pa.string()), ("column", pa.string()), ("stratum", pa.int32()),
                    ("seed", pa.int64()), ("document", pa.string()), ("cluster", pa.string()),
                    ("cluster_unit", pa.string()), ("reference", pa.string()), ("score", pa.float64())])
SUFFIX = "_documents.parquet"


def cell_seeds(cell: dict, profile, column: str) -> list[int | None]:
    """The seed of each stratum: as tallied, else the profile's seeds of the column in sorted order
    (``Profile.seeded_columns``) when there are as many, else unknown (None)."""
    count = len(cell["values"])
    tallied = cell.get("seeds") or []
    if len(tallied) == count and all(s is not None for s in tallied):
        return list(tallied)
    seeds = sorted({*profile.seeds, *profile.column_seeds.get(column, [])})
    return seeds if len(seeds) == count else [None] * count


DIGEST_FIELD = "documents_file"  # in a table's JSON: {"name", "rows", "sha256"} of the Parquet written beside it


def documents_digest(table: pa.Table) -> str:
    """The sha256 of a per-document file's content: its column names and every value in file order (the
    order its strata and columns are read in), as JSON. Of the content, not the bytes, so that the same
    scores written by another pyarrow or compression give the same digest."""
    content = {"names": table.schema.names, "columns": [column.to_pylist() for column in table.columns]}
    return hashlib.sha256(json.dumps(content, allow_nan=True).encode()).hexdigest()


def documents_record(table: pa.Table, name: str) -> dict:
    """What a table's JSON records of its per-document file (``DIGEST_FIELD``)."""
    return {"name": name, "rows": table.num_rows, "sha256": documents_digest(table)}


def write_documents(path: Path, cells: dict, columns: list[str], reference: str | None, profile) -> dict:
    """``path`` (NAME_documents.parquet): the per-document scores of every cell of ``cells`` that has them;
    its ``documents_record`` (the table's JSON records it)."""
    out: dict[str, list] = {name: [] for name in SCHEMA.names}
    for model, rows in cells.items():
        compared = reference if reference in rows else None
        for label, by_column in rows.items():
            for column in columns:
                cell = by_column.get(column, {})
                documents = cell_documents(cell)
                if documents is None:
                    continue
                clusters = cell_clusters(cell) or [None] * len(documents)
                unit = cell.get("cluster_unit") if clusters[0] is not None else None
                for stratum, (seed, docs, found) in enumerate(zip(cell_seeds(cell, profile, column), documents, clusters)):
                    for doc, score in docs.items():
                        for name, value in zip(SCHEMA.names, (model, label, column, stratum, seed, doc,
                                                              None if found is None else found[doc], unit,
                                                              None if label == compared else compared, score)):
                            out[name].append(value)
    table, sink = pa.table(out, schema=SCHEMA), pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    atomic_write(path, sink.getvalue().to_pybytes())
    return documents_record(table, path.name)


def table_command_line(description: str, argv: list[str] | None) -> Path:
    """The one argument of a command that reads a table's files (``table_argument``)."""
    import argparse  # deferred: only the commands need it

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path, help="a table's results path without suffix, e.g. results/main_table")
    return table_argument(parser.parse_args(argv).table)


def table_argument(path: Path) -> Path:
    """A table named on a command line (results/main_table, or its .json), checked to have its JSON
    and per-document file beside it; SystemExit naming them otherwise."""
    table = path.with_suffix("") if path.suffix == ".json" else path
    if not table.with_suffix(".json").is_file() or not (table.parent / f"{table.name}{SUFFIX}").is_file():
        raise SystemExit(f"{table}: needs {table.name}.json and {table.name}{SUFFIX} beside it (a table's results)")
    return table


def shown_path(path: Path, root: Path) -> str:
    """``path`` as a command records it: relative to the repository ``root`` when inside it."""
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def load_documents(path: Path) -> pa.Table:
    """The per-document file ``path`` as read; SystemExit naming it when it is not a readable one of ours
    (cut short, another file, other columns)."""
    try:
        table = pq.read_table(path)
    except (OSError, ValueError, pa.ArrowException) as e:  # ArrowInvalid (a ValueError): cut short, not Parquet
        raise SystemExit(f"{path}: not a readable per-document file ({type(e).__name__}: {e}); restore it from where "
                         "its table was written (git restore, or the table's command again)") from None
    if table.schema.names != SCHEMA.names:
        raise SystemExit(f"{path}: columns {table.schema.names}, where a per-document file has {SCHEMA.names}; restore "
                         "it from where its table was written (git restore, or the table's command again)")
    return table


def read_documents(path: Path | pa.Table) -> tuple[dict, dict[str, str | None], list[str]]:
    """(cells as ``repro.analysis.tables.tally`` builds them, {model: reference row}, columns in order) from
    ``path`` (or the file as ``load_documents`` read it)."""
    frame = (path if isinstance(path, pa.Table) else load_documents(path)).to_pandas()
    cells: dict = {}
    references: dict[str, str | None] = {}
    columns: list[str] = []
    for rec in frame.itertuples(index=False):
        cell = cells.setdefault(rec.model, {}).setdefault(rec.row, {}).setdefault(
            rec.column, {"documents": [], "clusters": [], "cluster_unit": None, "seeds": []})
        while len(cell["documents"]) <= rec.stratum:
            cell["documents"].append({}), cell["clusters"].append({}), cell["seeds"].append(None)
        cell["seeds"][rec.stratum] = None if _missing(rec.seed) else int(rec.seed)
        cell["documents"][rec.stratum][rec.document] = None if _missing(rec.score) else float(rec.score)
        if not _missing(rec.cluster):
            cell["clusters"][rec.stratum][rec.document] = rec.cluster
            cell["cluster_unit"] = rec.cluster_unit
        if not _missing(rec.reference):
            references[rec.model] = rec.reference
        references.setdefault(rec.model, None)
        if rec.column not in columns:
            columns.append(rec.column)
    for rows in cells.values():
        for by_column in rows.values():
            for cell in by_column.values():
                cell["values"] = [_stratum_mean(docs) for docs in cell["documents"]]
    return cells, references, columns


def _stratum_mean(docs: dict) -> float:
    scored = [v for v in docs.values() if v is not None]
    return math.fsum(scored) / len(scored) if scored else float("nan")
