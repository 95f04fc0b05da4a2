"""A table on one screen (repro/analysis/summary.py, repro/summary.py): written with the table, its cells
the seed-level differences, the primary family's verdicts where it has them, stale files set aside, at
most 100 characters a line, and printed by its command from the JSON alone."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mari_eval.injection.devices import Placement
from repro import seed_level
from repro.analysis import tables
from repro.analysis.summary import WIDTH, find_tables, load
from repro.analysis.summary_text import grid, markdown
from repro.engine.cache import Store
from repro.engine.profiles import Profile

from .test_recompute import make_cells

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "lm_eval", "scipy", "pandas", "numpy", "matplotlib", "pyarrow")


@pytest.fixture
def table(tmp_path) -> Path:
    """A two-seed table (tqa_mc1 under both seeds, bbq_acc and sorry_refusal under seed 0) and its seed-level file."""
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0, 1], max_train={}, max_ctrl=None, limits={})
    tables.write_tables(tmp_path, "t", "Table T", "Intro.", make_cells(), ["tqa_mc1", "bbq_acc", "sorry_refusal", "gate"],
                        lambda model: ("P", {}), profile, "cmd", 1.0, store, comparisons=[("CAA", "MARI")])
    return tmp_path / "t"


def _cell(text: str, row: str, column: int = 1) -> str:
    """The text of ``row``'s ``column``-th cell in the first grid listing it."""
    line = next(line for line in text.split("\n") if line.startswith(f"| {row} "))
    return line.strip("|").split("|")[column].strip()


def _summary(table: Path) -> str:
    return table.with_name(f"{table.name}_summary.md").read_text()


def _flat(text: str) -> str:
    """``text`` with its wrapped lines joined (prose is wrapped at the width)."""
    return " ".join(text.split())


def test_written_with_the_table_then_with_its_seed_level_figures(table):
    before = _summary(table)
    assert before == markdown(load(table))  # write_tables wrote it
    assert "seed-level tests not computed (`python -m repro.seed_level" in _flat(before)
    assert seed_level.main([str(table)]) == 0
    after = _summary(table)
    found = {(e["row"], e["against"], e["column"]): e
             for e in json.loads(table.with_name("t_seeds.json").read_text())["models"]["m"]}
    mari = found["MARI", "Vanilla", "tqa_mc1"]
    shown_mean = _cell(after, "MARI").split(" [")[0]
    digits = len(shown_mean.split(".")[1]) if "." in shown_mean else 0
    assert _cell(after, "MARI").startswith(f"{mari['mean']:+.{digits}f} [{mari['t_ci'][0]:.{digits}f}, "
                                           f"{mari['t_ci'][1]:.{digits}f}]")
    tested = sum(1 for e in found.values() if e["against"] == "Vanilla" and e["t_p"] is not None)
    assert f"Holm over this table's {tested} seed-level tests" in _flat(after)
    assert "| bbq_acc (1 seed)" in after  # the table's own conditional difference, said so
    assert "| CAA - MARI " in after  # the table's comparison between rows
    assert all(len(line) <= WIDTH for line in after.split("\n"))


def _primary(table: Path, rejected: bool, shift: float = 0.0) -> None:
    record = json.loads(table.with_suffix(".json").read_text())
    rows = {r["row"]: r["ours"]["tqa_mc1"]["values"] for r in record["models"]["m"]["rows"]}
    per_seed = [a - b + shift for a, b in zip(rows["MARI"], rows["Vanilla"])]
    member = {"kind": "effect", "label": "MARI - Vanilla: tqa_mc1", "row": "MARI", "against": "Vanilla",
              "columns": ["tqa_mc1"], "per_seed": per_seed, "mean": sum(per_seed) / 2, "t_ci": [-50.0, 60.0],
              "t_p": 0.2, "t_p_holm": 0.01 if rejected else 0.9, "rejected": rejected}
    table.with_name("t_primary.json").write_text(json.dumps({
        "command": "c", "family": "repro/primary_family.json", "size": 35, "alpha": 0.05,
        "sorry_primary": {"column": "sorry_refusal", "reason": "judged"}, "models": {"m": {"members": [member]}}}))


def test_the_primary_family_decides_its_members_and_only_them(table):
    seed_level.main([str(table)])
    _primary(table, rejected=True)
    text = markdown(load(table))
    assert "Verdicts: the primary family (35 tests" in _flat(text)
    assert _cell(text, "MARI").endswith(" 60]†")  # the member's own interval and verdict
    assert "†" not in _cell(text, "CAA")  # outside the family: no verdict of Holm
    assert "| sorry_refusal" in text  # the SORRY-Bench column as the family resolved it
    _primary(table, rejected=False)
    assert not _cell(markdown(load(table)), "MARI").endswith("†")


def test_files_of_another_run_are_set_aside_and_named(table):
    seed_level.main([str(table)])
    _primary(table, rejected=True, shift=1.0)  # per-seed differences the table does not give
    text = markdown(load(table))
    assert "t_primary.json does not match t.json (MARI - Vanilla tqa_mc1" in _flat(text)
    assert "`python -m repro.primary_family" in _flat(text) and " 60]" not in text
    seeds = json.loads(table.with_name("t_seeds.json").read_text())
    seeds["models"]["m"][0]["per_seed"][0] += 1.0
    table.with_name("t_seeds.json").write_text(json.dumps(seeds))
    text = _flat(markdown(load(table)))
    assert "t_seeds.json does not match t.json" in text and "seed-level tests not computed" in text


def test_gate_open_and_missing_costs_are_said(table):
    text = _flat(_summary(table))
    assert re.search(r"Not computed in this table: kl_benign, .*benign_refusal, gate open rates", text)
    record = json.loads(table.with_suffix(".json").read_text())
    record["models"]["m"]["gate_open"] = {"MARI": {"tqa_mc1": [0.5, 0.75]}}
    table.with_suffix(".json").write_text(json.dumps(record))
    text = markdown(load(table))
    assert "- MARI.tqa_mc1: 0.500 / 0.750" in text and "gate open rates" not in text


def test_a_wide_grid_is_cut_to_the_width_with_every_column_in_order():
    columns = [(f"column_{i}", ["+0.123 [-0.456, 0.789]*", "-1.000 [-2.000, 0.000]"]) for i in range(7)]
    grids = grid("row", ["a long row label", "b"], columns)
    assert len(grids) > 1
    assert all(len(line) <= WIDTH for g in grids for line in g.split("\n"))
    headers = [h.strip() for g in grids for h in g.split("\n")[0].strip("|").split("|")[1:]]
    assert headers == [c for c, _ in columns]


def test_the_command_prints_the_committed_summary_from_the_json_alone():
    table = next(t for t in find_tables() if t.with_name(f"{t.name}_seeds.json").is_file())
    shown = table.relative_to(REPO).as_posix()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "repro.summary", shown], cwd=REPO,
                          capture_output=True, text=True, check=True)
    assert done.stdout == _summary(table)
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.split("\n") if line.startswith("import time:")}
    assert not imported & set(HEAVY), f"repro.summary imports {sorted(imported & set(HEAVY))}"
    refused = subprocess.run([sys.executable, "-m", "repro.summary", "results/no_such_table"], cwd=REPO,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "results/no_such_table: not a table" in refused.stderr


def test_a_cost_of_several_columns_shows_as_the_family_tests_it(table):
    record = json.loads(table.with_suffix(".json").read_text())
    columns = json.loads((REPO / "repro" / "primary_family.json").read_text())["costs"]["kl_benign"]["columns"]
    for row in record["models"]["m"]["rows"]:
        row["ours"].update({c: row["ours"]["tqa_mc1"] for c in columns})  # three bundles' columns
    table.with_suffix(".json").write_text(json.dumps(record))
    _primary(table, rejected=True)
    primary = json.loads(table.with_name("t_primary.json").read_text())
    member = {**primary["models"]["m"]["members"][0], "kind": "cost", "columns": columns, "t_ci": [-5.0, 25.0]}
    primary["models"]["m"]["members"].append(member)
    table.with_name("t_primary.json").write_text(json.dumps(primary))
    text = markdown(load(table))
    grid_line = next(line for line in text.split("\n") if "kl_benign (mean)" in line)
    assert grid_line.startswith("| row ") and "kl_benign@bbq" not in grid_line  # one column, not three
    assert _cell(text.split("costs (row - Vanilla)")[1], "MARI").endswith(" 25]†")
    assert f"kl_benign (mean): per seed, the mean of the differences on {', '.join(columns)}" in _flat(text)
