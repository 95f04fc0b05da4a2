"""D_ctrl's general-capability controls are rendered as their test tasks are evaluated (issue 36.3):
ARC-Easy behind the same 25 shots as arc_easy_first25, MMLU behind its subject's 5 dev questions."""

import pytest

from mari_eval.benchmarks import data, data_splits
from mari_eval.training.examples import GENERAL_CONTROLS, attribute_data

pytestmark = pytest.mark.needs_data


def _evaluated_context(task_name: str, split_seed: int = 0) -> tuple[str, str]:
    """(the context lm-eval builds for the first test document of ``task_name``, that document's own
    text): what an evaluation feeds the model, built by lm-eval from the task YAML."""
    from lm_eval.tasks import TaskManager

    from tests.conftest import HARNESS_TASKS

    task = TaskManager(include_path=str(HARNESS_TASKS), metadata={"split_seed": split_seed}).load([task_name])["tasks"][task_name]
    task.build_all_requests(limit=1, rank=0, world_size=1)
    instance = task.instances[0]
    return instance.arguments[0], task.doc_to_text(instance.doc)


def test_the_control_splits_hold_the_general_controls_apart_from_their_shots():
    splits = data_splits.make_splits("truthfulqa", seed=0)
    arc_train = [r["id"] for r in data.load_arc("arc_easy", "train")]
    assert len(splits.ctrl_arc) == data_splits.CTRL_ARC and not set(splits.ctrl_arc) & set(arc_train[:data_splits.ARC_CTRL_SHOTS])
    validation = {r["id"]: r["subject"] for r in data.load_mmlu("validation")}
    assert len(splits.ctrl_mmlu) == data_splits.CTRL_MMLU and set(splits.ctrl_mmlu) <= set(validation)
    assert len({validation[i] for i in splits.ctrl_mmlu}) > 30  # a seeded draw spreads over the subjects
    assert not set(splits.ctrl_mmlu) & {r["id"] for r in data.load_mmlu("test")}


def test_general_controls_carry_the_preamble_their_test_task_puts_before_every_question(smollm2_session):
    session = smollm2_session
    attr = attribute_data(session, "truthfulqa", seed=0, max_train=1, max_ctrl=2)
    assert attr.ctrl_source == ["attribute"] * 2 + [c.source for c in GENERAL_CONTROLS for _ in range(2)]
    by_source = {}
    for ex, source in zip(attr.ctrl, attr.ctrl_source):
        by_source.setdefault(source, []).append(session.lm.tok_decode(ex.context))

    # ARC: the evaluated prompt of a test question is its 25-shot preamble and then its own text; every
    # ARC control starts with that same preamble, then its own "Question: ...\nAnswer:".
    context, own = _evaluated_context("arc_easy_first25")
    preamble = context[: -len(own)]
    assert preamble.count("Question:") == 25
    for text in by_source["arc_easy"]:
        assert text.startswith(preamble) and text[len(preamble):].count("Question:") == 1

    # MMLU: 5 dev questions of the control's own subject, with the subject's description first.
    subjects = {r["id"]: r["subject"] for r in data.load_mmlu("validation")}
    dev = {}
    for r in data.load_mmlu("dev"):
        dev.setdefault(r["subject"], []).append(r["question"].strip())
    mmlu_ids = [ex.id for ex, s in zip(attr.ctrl, attr.ctrl_source) if s == "mmlu"]
    for i, text in zip(mmlu_ids, by_source["mmlu"]):
        subject = subjects[i]
        assert text.startswith(f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}")
        assert text.count("\nAnswer:") == 6  # five shots and the question
        positions = [text.index(q) for q in dev[subject][:5]]
        assert positions == sorted(positions)  # in the dev split's order, as first_n takes them


def test_the_control_set_is_rendered_only_when_read_and_then_as_the_whole_split_sampled(smollm2_session):
    # Only MARI reads D_ctrl: its ids are known at once (every bundle records them as splits.ctrl_used),
    # its examples rendered the first time one is read. They equal rendering the attribute's whole
    # control split and then drawing the seeded subset, as attribute_data did before.
    import random

    from mari_eval.benchmarks.tasks import task_manager
    from mari_eval.training.examples import ATTRIBUTE_TASKS, _mc_examples, _task_docs

    session = smollm2_session
    attr = attribute_data(session, "truthfulqa", seed=0, max_train=1, max_ctrl=3)
    assert not attr.ctrl.rendered and len(attr.ctrl) == len(attr.ctrl_source) == 9
    ids = attr.ctrl_ids
    assert not attr.ctrl.rendered  # ids and length render nothing
    task, docs = _task_docs(task_manager(()), ATTRIBUTE_TASKS["truthfulqa"], "validation")
    whole = _mc_examples(session, task, docs, attr.splits.ctrl)
    drawn = random.Random("max_ctrl:0").sample(whole, 3)
    assert [ex.id for ex in attr.ctrl[:3]] == [ex.id for ex in drawn] == ids[:3]
    assert attr.ctrl.rendered and [ex.id for ex in attr.ctrl] == ids
    for lazy, eager in zip(attr.ctrl[:3], drawn):
        assert (lazy.context, lazy.options, lazy.gold) == (eager.context, eager.options, eager.gold)
