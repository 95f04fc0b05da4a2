"""The primary family (repro/primary_family.json, fixed before its numbers): its members, its power, and its
seed-level tests on the committed budget main table, checked against that table's seed-level file."""

import json
import subprocess
import sys

import pytest
from scipy import stats

from repro import primary_family as pf

from .conftest import REPO

BUDGET = REPO / "results" / "profiles" / "budget" / "main_table"


def test_the_family_is_small_and_named_in_advance():
    family = pf.load_family(sorry_column="sorry_keyword")
    assert family.size == 35
    effects = [m for m in family.members if m.kind == "effect"]
    costs = [m for m in family.members if m.kind == "cost"]
    assert len(effects) == 21 and {m.row for m in effects} == {"MARI"}
    assert {m.against for m in effects} == {"Vanilla", "Prompting", "CAA", "ITI", "NL-ITI", "ReFT", "LoRA"}
    assert {m.columns for m in effects} == {("tqa_mc1",), ("bbq_acc",), ("sorry_keyword",)}
    assert len(costs) == 14 and {m.against for m in costs} == {"Vanilla"}
    assert ("kl_benign", "kl_benign@bbq", "kl_benign@sorry") in {m.columns for m in costs}


def test_a_family_file_whose_members_do_not_match_its_size_is_refused(tmp_path):
    spec = json.loads(pf.FAMILY_FILE.read_text())
    spec["rows"] = spec["rows"][:-1]  # a row dropped without correcting the size
    path = tmp_path / "family.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="states a family of 35 tests but names 30"):
        pf.load_family(path, sorry_column="sorry_keyword")


def test_detectable_difference_agrees_with_the_noncentral_t_where_scipy_computes_it():
    for seeds in (5, 10, 30):
        first, last = pf.detectable(1, seeds)
        assert first == pytest.approx(last)
        critical = stats.t.ppf(0.975, seeds - 1)
        nc = last * seeds ** 0.5
        power = stats.nct.sf(critical, seeds - 1, nc) + stats.nct.cdf(-critical, seeds - 1, nc)
        assert power == pytest.approx(pf.POWER, abs=2e-3)
    assert pf.detectable(1, 10)[1] == pytest.approx(0.994, abs=0.01)  # Cohen's table: n = 10, d ~ 1.0
    three, five = pf.detectable(35, 3), pf.detectable(35, 5)
    assert three[0] > 10 * five[1] and three[0] > five[0] > three[1]


@pytest.mark.needs_data
def test_the_family_on_the_budget_main_table_agrees_with_its_seed_level_file():
    result = pf.test_family(BUDGET, pf.load_family(sorry_column="sorry_keyword"))
    (model, entry), = result["models"].items()
    members = {m["label"]: m for m in entry["members"]}
    seeds = json.loads(BUDGET.with_name("main_table_seeds.json").read_text())["models"][model]
    vanilla = next(s for s in seeds if s["row"] == "MARI" and s["against"] == "Vanilla" and s["column"] == "tqa_mc1")
    mine = members["MARI - Vanilla: tqa_mc1"]
    assert mine["per_seed"] == pytest.approx(vanilla["per_seed"]) and mine["t_p"] == pytest.approx(vanilla["t_p"])
    lora = next(s for s in seeds if s["row"] == "LoRA" and s["against"] == "MARI" and s["column"] == "tqa_mc1")
    assert members["MARI - LoRA: tqa_mc1"]["per_seed"] == pytest.approx([-d for d in lora["per_seed"]])
    # Holm over the 35 members alone: smaller than the seed-level file's Holm over its 123 + 176 tests
    assert mine["t_p_holm"] < vanilla["t_p_holm"]
    ps = sorted((1.0 if m["t_p"] is None else m["t_p"]) for m in entry["members"])
    assert min(m["t_p_holm"] for m in entry["members"]) == pytest.approx(min(1.0, 35 * ps[0]))
    missing = [m for m in entry["members"] if m["per_seed"] is None]
    assert missing and all(m["t_p_holm"] == 1.0 and not m["rejected"] for m in missing)


@pytest.mark.needs_data
def test_the_command_writes_the_family_beside_the_table(tmp_path):
    for suffix in (".json", "_documents.parquet"):
        (tmp_path / f"main_table{suffix}").write_bytes(BUDGET.with_name(f"main_table{suffix}").read_bytes())
    proc = subprocess.run([sys.executable, "-m", "repro.primary_family", str(tmp_path / "main_table")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((tmp_path / "main_table_primary.json").read_text())
    assert written["size"] == 35 and "35 members alone" in (tmp_path / "main_table_primary.md").read_text()
    power = subprocess.run([sys.executable, "-m", "repro.primary_family", "--power", "--seeds", "3,5"],
                           capture_output=True, text=True, cwd=REPO)
    assert power.returncode == 0 and "35 tests" in power.stdout
    bad = subprocess.run([sys.executable, "-m", "repro.primary_family", "--power", "--seeds", "3,٥"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--seeds" in bad.stderr
