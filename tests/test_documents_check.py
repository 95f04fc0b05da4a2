"""A table's per-document file checked against its JSON before anything is computed from it
(repro/analysis/documents_check.py, issue 83.3): another table's file under its name, a seed's rows
dropped, a cut file, a JSON without the digest; and the digest recorded for a table written before
tables recorded it (``python -m repro.recompute --record-digest``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mari_eval.injection.devices import Placement
from repro import recompute, rerender, seed_level
from repro.analysis import tables
from repro.analysis.documents_file import DIGEST_FIELD, SCHEMA, documents_digest
from repro.engine.cache import Store
from repro.engine.profiles import Profile

from .test_recompute import make_cells

REPO = Path(__file__).resolve().parent.parent


def _write(folder: Path, name: str, columns=("tqa_mc1", "tqa_mc2", "bbq_acc", "sorry_refusal", "gate")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    store = Store(folder / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0, 1], max_train={}, max_ctrl=None, limits={})
    tables.write_tables(folder, name, "Table T", "Intro.", make_cells(), list(columns), lambda model: ("P", {}),
                        profile, "cmd", 1.0, store)
    return folder / name


def _parquet(table: Path) -> Path:
    return table.parent / f"{table.name}_documents.parquet"


def test_a_table_records_its_per_document_file_and_seed_level_reads_it(tmp_path):
    table = _write(tmp_path, "t")
    recorded = json.loads(table.with_suffix(".json").read_text())[DIGEST_FIELD]
    written = pq.read_table(_parquet(table))
    assert recorded == {"name": "t_documents.parquet", "rows": written.num_rows, "sha256": documents_digest(written)}
    assert written.num_rows > 0
    assert seed_level.main([str(table)]) == 0


def test_seed_level_refuses_another_tables_documents_under_its_name(tmp_path):
    table, other = _write(tmp_path / "a", "t"), _write(tmp_path / "b", "t", columns=("tqa_mc1", "tqa_mc2"))
    shutil.copy(_parquet(other), _parquet(table))
    result = subprocess.run([sys.executable, "-m", "repro.seed_level", str(table)], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 1 and not (tmp_path / "a" / "t_seeds.json").exists()
    assert (f"{_parquet(table)} is not the per-document file {table}.json was written with: t_documents.parquet has "
            in result.stderr)
    assert "content has sha256" in result.stderr and f"git restore {_parquet(table)}" in result.stderr
    assert "Traceback" not in result.stderr


def _drop_stratum(table: Path, stratum: int) -> None:
    found = pq.read_table(_parquet(table)).to_pandas()
    pq.write_table(pa.Table.from_pandas(found[found.stratum != stratum], schema=SCHEMA, preserve_index=False),
                   _parquet(table))


def test_a_seeds_rows_dropped_are_refused_even_with_the_digest_removed(tmp_path):
    table = _write(tmp_path, "t")
    _drop_stratum(table, 1)
    with pytest.raises(SystemExit, match=r"m / Vanilla / tqa_mc1: 2 seed\(s\) in the JSON, 1 in t_documents.parquet"):
        seed_level.main([str(table)])
    record = json.loads(table.with_suffix(".json").read_text())
    del record[DIGEST_FIELD]  # the check does not switch off: a JSON without it is refused, with the fix
    table.with_suffix(".json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=rf"{table}.json records no digest of {_parquet(table)} .*"
                                         rf"python -m repro.recompute --record-digest {table}"):
        seed_level.main([str(table)])
    assert recompute.main([str(table), "--record-digest"]) == 1  # the numbers disagree: nothing recorded
    assert DIGEST_FIELD not in json.loads(table.with_suffix(".json").read_text())
    with pytest.raises(SystemExit, match="2 seed\\(s\\) in the JSON, 1 in"):  # rerender checks the cells too
        rerender.main([str(table)])


def test_record_digest_gives_an_older_table_exactly_the_field_a_table_writes(tmp_path, capsys):
    table = _write(tmp_path, "t")
    written = table.with_suffix(".json").read_text()
    record = json.loads(written)
    del record[DIGEST_FIELD]
    table.with_suffix(".json").write_text(json.dumps(record, indent=2))
    assert recompute.main([str(table)]) == 0  # says how, records nothing
    assert "records no digest of t_documents.parquet" in capsys.readouterr().out
    assert DIGEST_FIELD not in json.loads(table.with_suffix(".json").read_text())
    assert recompute.main([str(table), "--record-digest"]) == 0
    assert table.with_suffix(".json").read_text() == written
    assert seed_level.main([str(table)]) == 0


@pytest.mark.parametrize("cut, command", [("json", "repro.seed_level"), ("parquet", "repro.recompute")])
def test_a_cut_table_file_is_named_by_seed_level_and_recompute(tmp_path, capsys, cut, command):
    table = _write(tmp_path, "t")
    path = table.with_suffix(".json") if cut == "json" else _parquet(table)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    result = subprocess.run([sys.executable, "-m", command, str(table)], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == (2 if command == "repro.recompute" else 1), result.stderr
    assert f"{path}: not a readable" in result.stderr and "restore it" in result.stderr
    assert "Traceback" not in result.stderr
    assert recompute.main([str(table)]) == 2  # the other command, in process
    assert f"{path}: not a readable" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=f"{path}: not a readable"):
        seed_level.main([str(table)])


def test_recompute_reports_a_digest_that_differs(tmp_path, capsys):
    table = _write(tmp_path, "t")
    record = json.loads(table.with_suffix(".json").read_text())
    record[DIGEST_FIELD]["sha256"] = "0" * 64
    table.with_suffix(".json").write_text(json.dumps(record))
    assert recompute.main([str(table)]) == 1
    assert "t_documents.parquet's content has sha256" in capsys.readouterr().out
