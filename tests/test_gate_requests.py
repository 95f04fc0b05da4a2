"""The gate calibration that can tell requests apart (issue 81.2): MARI's gate_requests adds Self-Instruct's seed
tasks (never its evaluation-only instructions) to D_ctrl; and the count of labelled examples each row reads."""

import json
import subprocess
import sys

import pytest

from mari_eval.benchmarks import data
from mari_eval.mari.method import DEFAULTS, MARI
from mari_eval.training import examples
from repro import ablation_table, data_budget

from .conftest import REPO

pytestmark = pytest.mark.needs_data


def test_request_controls_are_seeded_seed_tasks_and_never_the_evaluation_set():
    first = examples.request_control_ids("truthfulqa", 0, 40)
    assert first == examples.request_control_ids("truthfulqa", 0, 40) and len(set(first)) == 40
    assert first != examples.request_control_ids("truthfulqa", 1, 40)
    seed_tasks = {r["id"] for r in data.load_benign_instructions("seed_tasks")}
    evaluation = {r["id"] for r in data.load_benign_instructions("user_oriented_instructions", use="evaluation")}
    assert set(first) <= seed_tasks and not set(first) & evaluation
    assert set(examples.request_control_ids("bbq", 2, 175)) == seed_tasks
    with pytest.raises(ValueError, match="gate_requests=176"):
        examples.request_control_ids("bbq", 0, 176)


def test_the_paper_calibration_stays_the_default_and_the_setting_is_checked():
    assert DEFAULTS["gate_requests"] == 0
    assert MARI.training_hyperparameters({"gate_requests": 100})["gate_requests"] == 100
    with pytest.raises(ValueError, match="gate_requests"):
        MARI.training_hyperparameters({"gate_requests": 500})


def test_the_ablation_has_the_request_calibrated_row_beside_the_papers():
    rows = ablation_table._rows({"truthfulqa": "paper"}, {"truthfulqa": "requests"})
    assert rows["EG-MARI"] == ({"truthfulqa": "paper"}, "")
    assert rows["EG-MARI (requests in D_ctrl)"] == ({"truthfulqa": "requests"}, "")
    assert ("EG-MARI (requests in D_ctrl)", "EG-MARI") in ablation_table.COMPARISONS
    assert {c[0] for c in ablation_table.COLUMNS} >= {"xstest_safe_refusal", "sorry_keyword", "tqa_mc1"}


def test_labelled_examples_are_counted_by_what_a_bundle_chose_with():
    mari = {"splits": {"train_used": ["a"] * 100, "pca": ["p"] * 100},
            "gate": {"n_ctrl": 160, "ctrl_sources": ["attribute"] * 40 + ["arc_easy"] * 40 + ["mmlu"] * 40 + ["requests"] * 40}}
    counted = data_budget.count("mari", mari)
    assert (counted["train"], counted["ctrl_calibration"], counted["pca"]) == (100, 160, 100)
    assert counted["ctrl_calibration_sources"]["requests"] == 40
    caa = {"splits": {"train_used": ["a"] * 100}, "hyperparameters": {"validation": "ctrl", "validation_examples": 40}}
    assert (data_budget.count("caa", caa)["ctrl_selection"], data_budget.count("caa", caa)["ctrl_reported"]) == (0, 40)
    reft = {"splits": {"train_used": ["a"] * 100}, "diagnostics": {"history": [1, 2, 3]},
            "hyperparameters": {"validation": "ctrl", "validation_examples": 40, "epoch_selection": "best", "epoch_kept": 2}}
    assert data_budget.count("reft", reft)["ctrl_selection"] == 40
    assert data_budget.count("prompting", {"splits": {"train_used": ["a"] * 100}})["train"] == 0


def test_the_data_budget_command_counts_the_committed_budget_bundles(tmp_path):
    proc = subprocess.run([sys.executable, "repro/data_budget.py", "--profile", "budget", "--runs", "results/budget_steps",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "data_budget.json").read_text())
    assert not record["missing"] and len(record["rows"]) == 7 * 3 * 3
    mari = [r for r in record["rows"] if r["method"] == "mari"]
    assert {r["ctrl_calibration"] for r in mari} == {120}  # 40 per source in the budget profile
    assert all(r["ctrl_calibration"] == 0 for r in record["rows"] if r["method"] != "mari")
    assert "MARI 165-320 labelled examples per bundle" in record["sentence"]
