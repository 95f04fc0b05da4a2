"""Which task files an evaluation's key hashes (repro/engine/task_files.py) and the move of evaluations
stored under the whole-folder key to their task's own (repro/engine/rekey.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from mari_eval.benchmarks import tasks
from repro.engine import cache, cache_keys, lm_eval_run, rekey
from repro.engine.cache_digests import EVALUATION_FIELD, evaluation_digest
from repro.engine.task_files import task_files

MODEL = "smollm2-135m-instruct"


def names(root, task):
    return [str(p.relative_to(root)) for p in task_files(root, task)]


def test_a_task_reads_its_yaml_its_includes_and_the_modules_it_calls():
    root = tasks.tasks_dir()
    assert names(root, "bbq_ambig_heldout") == ["bbq.yaml", "bbq_ambig_heldout.yaml", "bbq_bias.py", "bbq_zero_shot.py",
                                                "utils.py"]
    assert names(root, "truthfulqa_mc2_heldout") == ["truthfulqa_mc1.yaml", "truthfulqa_mc2.yaml",
                                                     "truthfulqa_mc2_heldout.yaml", "utils.py"]
    assert names(root, "xstest_safe") == ["xstest_safe.yaml", "xstest_utils.py"]
    assert names(root, "benign_instructions") == ["benign_instructions.yaml", "benign_utils.py"]
    # a group: its subgroups, their 57 subjects and the template they include (no .yaml suffix)
    mmlu = names(root, "mmlu")
    assert "_mmlu.yaml" in mmlu and "_mmlu_template_yaml" in mmlu and "mmlu_anatomy.yaml" in mmlu
    assert sum(n.startswith("mmlu_") for n in mmlu) == 57 and "bbq.yaml" not in mmlu
    # a name no file defines (the KL/cross-entropy measure; lm-eval's own tasks) reads none of them
    assert task_files(root, "general_text") == [] and task_files(root, "hellaswag") == []


def test_a_tag_and_an_imported_module_are_followed(tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "calls.py").write_text("from helpers import X\nimport os\n\ndef docs(d):\n    return d\n")
    (tmp_path / "one.yaml").write_text("task: one\ntag: [both]\nprocess_docs: !function calls.docs\n")
    (tmp_path / "two.yaml").write_text("task: two\ntag: both\n")
    (tmp_path / "other.yaml").write_text("task: other\n")
    (tmp_path / "README.md").write_text("prose")
    assert names(tmp_path, "one") == ["calls.py", "helpers.py", "one.yaml"]
    assert names(tmp_path, "both") == ["calls.py", "helpers.py", "one.yaml", "two.yaml"]
    assert names(tmp_path, "nothing") == []


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A copy of the task folder the keys read, and an evaluation that records what it was asked."""
    copy = shutil.copytree(tasks.tasks_dir(), tmp_path / "tasks")
    monkeypatch.setattr(cache_keys, "tasks_dir", lambda: copy)
    calls = []

    def evaluate(model, task_names, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        calls.append(list(task_names))
        return {t: {"metrics": {}, "n": limit, "seconds": 1.0, "documents": {}} for t in task_names}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    cache_keys.task_fingerprint.cache_clear()
    cache_keys.tasks_fingerprint.cache_clear()
    yield copy, calls
    cache_keys.task_fingerprint.cache_clear()
    cache_keys.tasks_fingerprint.cache_clear()


def _stored_under_the_folder_key(runs, task: str) -> None:
    """Rewrite ``runs``' evaluations of ``task`` as the code before task keys stored them."""
    for path in (runs / "evaluations").glob(f"{task}-*.json"):
        record = json.loads(path.read_text())
        record["config"]["tasks"] = cache_keys.tasks_fingerprint()
        record[EVALUATION_FIELD] = evaluation_digest(record)
        path.unlink()
        (runs / "evaluations" / f"{task}-{cache_keys.config_key(record['config'])}.json").write_text(json.dumps(record))


def test_evaluations_under_the_folder_key_are_moved_and_read_back(folder, tmp_path, capsys):
    copy, calls = folder
    runs = tmp_path / "runs"
    store = cache.Store(runs)
    store.evaluations(MODEL, ["arc_easy", "general_text"], 2)
    _stored_under_the_folder_key(runs, "arc_easy")
    assert store.missing(MODEL, ["arc_easy", "general_text"], 2) == ["arc_easy"]  # the old key is not read
    _stored_under_the_folder_key(runs, "general_text")  # it reads no task file: its key changes too
    assert rekey.main([str(runs), "--check"]) == 1
    assert rekey.main([str(runs)]) == 0
    assert "moved 2 evaluations to their task's key; left: " in capsys.readouterr().out
    assert store.missing(MODEL, ["arc_easy", "general_text"], 2) == []  # read back, digest verified
    assert rekey.main([str(runs), "--check"]) == 0
    assert calls == [["arc_easy", "general_text"]]


def test_evaluations_computed_with_other_task_files_are_left(folder, tmp_path, capsys):
    copy, calls = folder
    runs = tmp_path / "runs"
    cache.Store(runs).evaluations(MODEL, ["arc_easy"], 2)
    _stored_under_the_folder_key(runs, "arc_easy")
    (copy / "arc_easy.yaml").write_text((copy / "arc_easy.yaml").read_text() + "# a changed prompt\n")
    cache_keys.task_fingerprint.cache_clear()
    cache_keys.tasks_fingerprint.cache_clear()
    before = sorted(p.name for p in (runs / "evaluations").iterdir())
    assert rekey.main([str(runs)]) == 0
    out = capsys.readouterr().out
    assert "moved 0 evaluations" in out and "1 other task files" in out
    assert sorted(p.name for p in (runs / "evaluations").iterdir()) == before
    assert rekey.main([str(runs), "--prune"]) == 0  # no run of this checkout reads it back: deleted by name
    out = capsys.readouterr().out
    assert f"deleted {runs / 'evaluations' / before[0]} (computed with other task files)" in out
    assert "deleted 1 computed with other task files; left: none" in out
    assert list((runs / "evaluations").iterdir()) == []
    with pytest.raises(SystemExit):
        rekey.main([str(runs), "--check", "--prune"])
    assert "argument --prune: not allowed with argument --check" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no evaluations/ folder"):
        rekey.main([str(tmp_path / "nothing")])
