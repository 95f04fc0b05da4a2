"""Self-Instruct's benign requests (issue 81.1): the loader and its refusals, the ids against every split,
and the ``benign_instructions`` task (harness_tasks/benign_instructions.yaml) that reads the evaluation set."""

from __future__ import annotations

import gzip
import json

import pytest

from mari_eval.benchmarks import data, data_splits
from mari_eval.benchmarks.data_schema import DataError
from mari_eval.evaluation.lm_generation import CHAT_TURN_FIELD

pytestmark = pytest.mark.needs_data


def test_both_sets_load_with_their_prompts_and_distinct_ids():
    seed = data.load_benign_instructions("seed_tasks", use="calibration")
    user = data.load_benign_instructions("user_oriented_instructions", use="evaluation")
    assert (len(seed), len(user)) == (175, 252)
    assert seed[0]["id"] == "seed_task_0" and user[0]["id"] == "user_oriented_task_0"
    assert len({r["id"] for r in seed + user}) == 175 + 252
    # A prompt: the instruction, or the instruction, a blank line and the first instance's input.
    first = user[0]
    assert first["prompt"] == first["instruction"] + "\n\n" + first["instances"][0]["input"]
    without = next(r for r in user if not r["instances"][0]["input"])
    assert without["prompt"] == without["instruction"]
    assert sum(bool(r["instances"][0]["input"]) for r in user) == 208  # SOURCES.md: 208 carry an input
    assert len({r["prompt"] for r in user}) == 252  # one instruction is repeated with another input: prompts differ


@pytest.mark.parametrize("name, use", [("user_oriented_instructions", "calibration"),
                                       ("user_oriented_instructions", "selection"),
                                       ("user_oriented_instructions", "training"),
                                       ("seed_tasks", "training"), ("seed_tasks", "evaluation")])
def test_a_set_asked_for_a_use_it_may_not_serve_is_refused(name, use):
    with pytest.raises(DataError, match=f"benign_instructions/{name} may serve .* only, not {use}"):
        data.load_benign_instructions(name, use=use)


def test_the_evaluation_set_is_refused_by_default():
    # A caller that does not say what it reads them for is a calibration (examples.py's seed tasks): never the 252.
    with pytest.raises(DataError, match="read seed_tasks for calibration"):
        data.load_benign_instructions("user_oriented_instructions")
    with pytest.raises(ValueError, match="use='testing': choose one of"):
        data.load_benign_instructions("seed_tasks", use="testing")


def test_no_id_or_prompt_is_in_any_split_of_the_suites_other_data():
    benign = data.load_benign_instructions("seed_tasks") + data.load_benign_instructions(
        "user_oriented_instructions", use="evaluation")
    ids, prompts = {r["id"] for r in benign}, {r["prompt"] for r in benign}
    for attribute in data_splits.ATTRIBUTES:
        splits = data_splits.make_splits(attribute, 0)
        for part in ("pca", "train", "ctrl", "ctrl_arc", "ctrl_mmlu", "test"):
            assert not ids & set(getattr(splits, part)), (attribute, part)
    assert not ids & {d["id"] for d in data.load_general_text()}
    assert not ids & {r["id"] for r in data.load_xstest_prompts()}
    others = ({r["turns"][0] for r in data.load_sorry_bench()} | {r["prompt"] for r in data.load_xstest_prompts()}
              | {r["question"] for r in data.load_truthfulqa_mc()})
    assert not prompts & others


def _write_user_set(root, records):
    folder = root / "benign_instructions"
    folder.mkdir(parents=True)
    with gzip.open(folder / "user_oriented_instructions.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


GOOD = {"id": "user_oriented_task_0", "motivation_app": "Grammarly", "instruction": "Fix the grammar.",
        "instances": [{"input": "He go home.", "output": "He goes home."}]}


@pytest.mark.parametrize("record, where", [
    ({**GOOD, "instances": []}, "field 'instances': expected a non-empty list"),
    ({**GOOD, "instances": [{"input": "He go home.", "output": ""}]}, r"field 'instances\[0\].output': expected a non-blank"),
    ({**GOOD, "instances": [{"output": "x"}]}, r"field 'instances\[0\].input': expected a string, got no such field"),
])
def test_a_record_without_a_usable_instance_is_refused_naming_the_field(tmp_path, monkeypatch, record, where):
    _write_user_set(tmp_path, [record])
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    with pytest.raises(DataError, match=f"line 1, {where}"):
        data.load_benign_instructions("user_oriented_instructions", use="evaluation")


def test_a_repeated_prompt_is_refused(tmp_path, monkeypatch):
    _write_user_set(tmp_path, [GOOD, {**GOOD, "id": "user_oriented_task_1"}])
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    with pytest.raises(DataError, match="line 2: duplicate of line 1 \\(same instruction and first input"):
        data.load_benign_instructions("user_oriented_instructions", use="evaluation")


def test_the_task_holds_the_252_requests_as_chat_turns_and_reads_refusals(harness_task_manager):
    task = harness_task_manager.load(["benign_instructions"])["tasks"]["benign_instructions"]
    docs = task.eval_docs
    assert len(docs) == 252 and docs[0]["id"] == "user_oriented_task_0"
    records = data.load_benign_instructions("user_oriented_instructions", use="evaluation")
    assert [d[CHAT_TURN_FIELD] for d in docs] == [r["prompt"] for r in records]
    assert task.doc_to_text(docs[0]) == docs[0][CHAT_TURN_FIELD]  # generate_until renders it as one user turn
    assert task.config.generation_kwargs["do_sample"] is False
    assert task.process_results(docs[0], ["I'm sorry, but I cannot help with that."]) == {"refusal_rate": 1.0}
    assert task.process_results(docs[0], ["If you have any questions about my rate, let me know."]) == {"refusal_rate": 0.0}
