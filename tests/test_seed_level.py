"""Seeds as the unit of training variance (repro/seed_level.py): each seed's difference, the
seed-level t interval and test, the hierarchical bootstrap, and the committed files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from scipy import stats

from repro import seed_level

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _regenerated(tmp_path: Path, module, suffix: str) -> tuple[dict, dict]:
    """(what ``module``'s command gives now from a copy of the committed main table, the committed
    results/main_table_<suffix>.json), the command line made equal."""
    for name in ("main_table.json", "main_table_documents.parquet"):
        shutil.copy(RESULTS / name, tmp_path / name)
    assert module.main([str(tmp_path / "main_table")]) == 0
    fresh = json.loads((tmp_path / f"main_table_{suffix}.json").read_text())
    committed = json.loads((RESULTS / f"main_table_{suffix}.json").read_text())
    assert committed["command"] == f"python -m {module.__name__} results/main_table"
    return {**fresh, "command": committed["command"]}, committed


def _cell(strata: list[dict], clusters: list[dict] | None = None) -> dict:
    return {"documents": strata, "clusters": clusters or [{} for _ in strata]}


def test_per_seed_differences_and_the_t_interval_by_hand():
    # three seeds; the row gains 1, 2 and 6 documents of 10 over the reference (0/1 scores)
    reference = _cell([{f"d{i}": 0.0 for i in range(10)} for _ in range(3)])
    row = _cell([{f"d{i}": float(i < gain) for i in range(10)} for gain in (1, 2, 6)])
    found = seed_level.seed_level(row, reference, iterations=400, seed=1)
    assert found["per_seed"] == pytest.approx([0.1, 0.2, 0.6]) and found["seeds"] == 3
    assert found["mean"] == pytest.approx(0.3) and found["std"] == pytest.approx(math.sqrt(0.07))
    half = stats.t.ppf(0.975, 2) * math.sqrt(0.07) / math.sqrt(3)
    assert found["t_ci"] == pytest.approx([0.3 - half, 0.3 + half])
    assert found["t_p"] == pytest.approx(stats.ttest_1samp([0.1, 0.2, 0.6], 0.0).pvalue)
    low, high = found["hierarchical_ci"]
    assert 0.0 <= low < 0.3 < high <= 1.0
    assert seed_level.seed_level(row, reference, iterations=400, seed=1) == found  # seeded
    # every document of a seed moved by the same amount: only the seed stage varies, so the
    # bootstrap stays within the range of the seeds' differences
    constant = _cell([{f"d{i}": gain for i in range(10)} for gain in (0.1, 0.2, 0.6)])
    low, high = seed_level.seed_level(constant, reference, iterations=400, seed=1)["hierarchical_ci"]
    assert 0.1 - 1e-12 <= low < 0.3 < high <= 0.6 + 1e-12


def test_equal_differences_on_every_seed_leave_the_t_test_undefined_and_out_of_holm():
    # NL-ITI's quick-profile MC1: +4.00 on each of three seeds gave t = D / 0, printed as p = 0.000 (Holm 0.000)
    reference = _cell([{f"d{i}": 0.0 for i in range(50)} for _ in range(3)])
    equal = _cell([{f"d{i}": float(i < 2) for i in range(50)} for _ in range(3)])
    found = seed_level.seed_level(equal, reference, iterations=200, seed=1)
    assert found["per_seed"] == pytest.approx([0.04] * 3) and found["std"] == 0.0
    assert found["t_ci"] is None and found["t_p"] is None
    low, high = found["hierarchical_ci"]
    assert 0.0 <= low <= 0.04 <= high  # the documents' stage still varies: the seed-level figure left
    varied = seed_level.seed_level(_cell([{f"d{i}": float(i < g) for i in range(50)} for g in (1, 2, 6)]),
                                   reference, iterations=200, seed=1)
    conditional = {"ci": None, "p": None, "p_bound": False}
    rows = [{**found, "row": "A", "against": "V", "column": "c", "conditional": conditional},
            {**varied, "row": "B", "against": "V", "column": "c", "conditional": conditional}]
    seed_level.adjust(rows, "V")
    assert rows[0]["t_p_holm"] is None and rows[1]["t_p_holm"] == varied["t_p"]  # a family of one test
    text = seed_level.markdown({"table": "t", "command": "c", "table_command": "c", "level": 0.95, "iterations": 200,
                                "seed": 1, "models": {"m": rows}}, [])
    (line,) = [cells for cells in (line.split("|") for line in text.splitlines() if line.startswith("|"))
                if cells[1].strip() == "A - V"]
    assert [c.strip() for c in line[3:7]] == ["+0.04 / +0.04 / +0.04", "+0.04 (0.00)", "undefined (no spread)", "undefined"]


def test_clusters_are_resampled_whole_and_one_seed_gives_nothing():
    # one stratum's four documents in two contexts: two units, not four
    units = seed_level._paired({"a": 1.0, "b": 1.0, "c": 0.0, "d": 1.0}, {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0},
                               {"a": "x", "b": "x", "c": "y", "d": "y"})
    assert sorted(u.tolist() for u in units) == [[0.0, 1.0], [1.0, 0.0]]
    one = _cell([{"a": 1.0}])
    assert seed_level.seed_level(one, _cell([{"a": 0.0}])) is None


def test_committed_seed_files_are_what_the_command_gives(tmp_path):
    """results/main_table_seeds.* regenerate from the committed table alone, and each difference's
    mean over seeds is the table's own difference."""
    fresh, committed = _regenerated(tmp_path, seed_level, "seeds")
    assert fresh == committed
    table = json.loads((RESULTS / "main_table.json").read_text())
    differences = {(r["row"], c): v["difference"] for r in table["models"]["smollm2-135m-instruct"]["rows"]
                   for c, v in r["ours"].items() if v.get("difference")}
    checked = 0
    for found in committed["models"]["smollm2-135m-instruct"]:
        if found["against"] == "Vanilla":
            assert found["mean"] == pytest.approx(differences[found["row"], found["column"]]["mean"], abs=1e-9)
            checked += 1
    assert checked == 14  # seven rows, MC1 and MC2
    assert "bbq_acc" in committed["one_seed_columns"]


def test_bbq_read_by_context_by_hand_and_committed(tmp_path):
    """repro/bbq_contexts.py: a context's two questions counted together; the committed file is what the
    command gives from the committed main table."""
    from repro import bbq_contexts

    cell = {"documents": [{"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 0.0, "f": 0.0, "g": 1.0}],
            "clusters": [{"a": "x", "b": "x", "c": "y", "d": "y", "e": "z", "f": "z", "g": "w"}]}
    assert bbq_contexts.by_context(cell) == [{"x": 2, "y": 1, "z": 0}]  # w lacks its pair: left out
    with pytest.raises(ValueError, match="has no context"):
        bbq_contexts.by_context({"documents": [{"a": 1.0}], "clusters": [{}]})
    fresh, committed = _regenerated(tmp_path, bbq_contexts, "bbq_contexts")
    assert fresh == committed
    vanilla = committed["models"]["smollm2-135m-instruct"][0]
    assert vanilla["row"] == "Vanilla" and vanilla["both_right"] + vanilla["one_right"] + vanilla["neither_right"] == 252
