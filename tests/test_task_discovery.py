"""lm-eval finds the project's tasks without --include_path (mari_eval.benchmarks.tasks, via mari_eval_autoload).

lm-eval's default TaskManager (what the `lm_eval` command and simple_evaluate build) indexes
mari_eval's task folder: the project's own names always, the names it shares with lm-eval's
built-ins only while MARI_DATA_DIR is set. Without it the built-ins keep those names and read
the Hub; the Hub cannot be reached here, so the test checks the config names the Hub dataset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval.tasks
import pytest
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from mari_eval.benchmarks.tasks import DATA_ENV, tasks_dir

from .conftest import HARNESS_TASKS

pytestmark = pytest.mark.e2e  # subprocesses or lm-eval runs of the embedded model throughout

BUILTIN = Path(lm_eval.tasks.__file__).resolve().parent
OURS = tasks_dir()
# Our names that lm-eval also defines -> lm-eval's YAML (tests/test_tasks.py compares their keys).
SHARED = {"truthfulqa_mc1": "truthfulqa/truthfulqa_mc1.yaml", "truthfulqa_mc2": "truthfulqa/truthfulqa_mc2.yaml",
          "bbq": "bbq/bbq_multiple_choice.yaml", "bbq_disambig": "bbq/bbq_multiple_choice_disambig.yaml",
          "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "gsm8k": "gsm8k/gsm8k.yaml",
          "mmlu": "mmlu/default/_mmlu.yaml", "mmlu_anatomy": "mmlu/default/mmlu_anatomy.yaml"}
PROJECT_ONLY = ["truthfulqa_mc1_heldout", "truthfulqa_mc2_heldout", "bbq_heldout", "bbq_disambig_heldout", "bbq_ambig_heldout",
                "sorry_bench", "sorry_bench_heldout"]


def _where(tm: TaskManager, name: str) -> Path:
    return Path(tm.task_index[name].yaml_path).resolve()


def test_the_checkout_is_the_editable_installs_task_folder():
    assert OURS == HARNESS_TASKS.resolve()


@pytest.fixture(scope="module")
def hub_tm():
    """lm-eval's default TaskManager without MARI_DATA_DIR."""
    saved = os.environ.pop(DATA_ENV, None)
    try:
        return TaskManager()
    finally:
        if saved is not None:
            os.environ[DATA_ENV] = saved


def test_without_data_dir_the_builtin_names_stay_lm_evals_hub_tasks(hub_tm):
    for name, builtin in SHARED.items():
        assert _where(hub_tm, name) == BUILTIN / builtin, name
    assert hub_tm.task_index["truthfulqa_mc1"].cfg["dataset_path"] == "truthfulqa/truthful_qa"
    assert hub_tm.task_index["bbq"].cfg["dataset_path"] == load_yaml(BUILTIN / SHARED["bbq"])["dataset_path"]
    for name in PROJECT_ONLY:
        assert _where(hub_tm, name).parent == OURS, name
    assert hub_tm.task_index["mari_heldout"].tags == set(PROJECT_ONLY[:5])
    assert _where(hub_tm, "hellaswag").is_relative_to(BUILTIN)  # lm-eval's own tasks all stay
    assert hub_tm.include_path is None  # what the caller gave


def test_with_data_dir_our_folder_replaces_the_builtins_and_the_callers_folder_wins(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "mine.yaml").write_text("task: truthfulqa_mc1_heldout\ndataset_path: some/dataset\n"
                                      "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a']\n"
                                      "doc_to_target: 0\ntest_split: test\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))  # only indexed: no data are read
    tm = TaskManager(include_path=str(theirs))
    for name in SHARED:
        assert _where(tm, name).parent == OURS, name
    for name in PROJECT_ONLY[1:]:
        assert _where(tm, name).parent == OURS, name
    assert _where(tm, "truthfulqa_mc1_heldout") == theirs / "mine.yaml"  # the caller's include_path last
    assert {"truthfulqa_mc1", "truthfulqa_mc2"} <= tm.task_index["truthfulqa"].tags  # lm-eval's tag, our tasks
    assert _where(tm, "hellaswag").is_relative_to(BUILTIN)
    assert tm.include_path == str(theirs)


def test_our_folder_passed_explicitly_or_without_defaults_is_left_to_lm_eval(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    only_theirs = TaskManager(include_path=str(tmp_path), include_defaults=False)
    assert only_theirs.all_tasks == []  # an empty folder and no defaults: nothing of ours was added
    ours_only = TaskManager(include_path=str(HARNESS_TASKS), include_defaults=False)
    assert {Path(e.yaml_path).resolve().parent for e in ours_only.task_index.values() if e.yaml_path} == {OURS}


@pytest.mark.needs_data
def test_lm_eval_command_runs_the_builtin_name_offline_from_anywhere(tmp_path):
    """The README's command, verbatim but for --limit: no --include_path, from outside the checkout."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    lm_eval = Path(sys.executable).with_name("lm_eval")
    proc = subprocess.run([str(lm_eval), "--model", "mari", "--tasks", "truthfulqa_mc1", "--limit", "1",
                           "--output_path", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Task: truthfulqa_mc1 ({OURS / 'truthfulqa_mc1.yaml'})" in proc.stderr
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["truthfulqa_mc1"] == {"original": 817, "effective": 1}
    assert results["config"]["model"] == "mari"


def test_lm_evals_metadata_hint_is_dropped_for_our_tasks_and_kept_for_others(caplog):
    import logging

    TaskManager()  # indexes our folder: its names are known to the filter
    task_logger = logging.getLogger("lm_eval.api.task")
    hint = "Custom kwargs can be passed to `--metadata` in console (as json string) or to the TaskManager."
    with caplog.at_level(logging.WARNING, logger="lm_eval.api.task"):
        task_logger.warning(f"truthfulqa_mc1_heldout: {hint}")  # every one of our tasks has such a loader
        task_logger.warning(f"someone_elses_task: {hint}")
        task_logger.warning("truthfulqa_mc1_heldout: another warning")
    said = [r.getMessage() for r in caplog.records if r.name == "lm_eval.api.task"]
    assert said == [f"someone_elses_task: {hint}", "truthfulqa_mc1_heldout: another warning"]


def test_a_manager_given_our_folder_itself_also_quiets_the_hint():
    # What training does (the session's TaskManager names our folder): the early path registers our names too.
    from mari_eval.benchmarks import tasks

    tasks._LOADER_HINT.ours.clear()
    TaskManager(include_path=str(tasks_dir()))
    assert {"truthfulqa_mc1_heldout", "sorry_bench_heldout"} <= tasks._LOADER_HINT.ours
