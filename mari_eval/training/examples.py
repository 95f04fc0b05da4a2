"""Training and control examples: every split of an attribute rendered as lm-eval evaluates it.

Every example is rendered by the lm-eval task that scores it (``harness_tasks/``: the same
prompt, options, target delimiter and few-shot preamble) and tokenised by the ``MariLM``
that evaluates it, so training sees the tokens evaluation will:

* truthfulqa: TruthfulQA MC1 (``truthfulqa_mc1``; its 6-shot preamble is part of the prompt);
* bbq: BBQ disambiguated contexts (``bbq_disambig``, zero-shot as it is evaluated);
* sorry_bench: the instruction through the model's chat template, with a fixed refusal
  target (``objectives.REFUSAL_TARGET``) and a compliance target as its negative.

D_ctrl, the gate's calibration set (Sec. 3.3, Appendix B), holds the attribute's held-out
examples and general-capability examples. The general ones are rendered as their test tasks
are evaluated (``GENERAL_CONTROLS``; issue 36.3): ARC-Easy train questions behind the same
fixed 25-shot preamble as ``arc_easy_first25`` (the first 25 train questions, which
``data_splits.make_splits`` keeps out of the control pool), and MMLU validation questions behind
their subject's 5 dev examples, as ``mmlu_<subject>``. Energy is read at the last prompt
token, whose state depends on the whole prompt: controls rendered zero-shot calibrate a
threshold for prompts the gate never meets at test time.

Only MARI reads D_ctrl; every method records which examples it holds (a bundle's
``splits.ctrl_used``). So D_ctrl is a ``LazyExamples``: its ids are known at once, its examples
are rendered the first time one is read (rendering the general controls, MMLU's 5-shot
subjects among them, took about 10 s per bundle for methods that never read them).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from mari_eval.benchmarks import data, data_splits
from mari_eval.training.objectives import COMPLIANCE_TARGET, REFUSAL_TARGET
from mari_eval.benchmarks.tasks import task_manager

if TYPE_CHECKING:
    from mari_eval.evaluation.lm import MariLM
    from mari_eval.evaluation.prefix_cache import Prefix

ATTRIBUTE_TASKS = {"truthfulqa": "truthfulqa_mc1", "bbq": "bbq_disambig", "sorry_bench": None}


class Session(Protocol):
    """What rendering examples needs of a training session (``mari_eval.training.session.Session``): the
    ``MariLM`` that evaluates them, its tokenisation, and the frozen model's work on a set."""

    lm: "MariLM"

    def encode(self, context: str, continuations: Sequence[str]) -> tuple[list[int], list[list[int]]]: ...

    def encode_generation(self, prompt: str, targets: Sequence[str]) -> tuple[list[int], list[list[int]]]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def prepare(self, examples: list["Example"], desc: str) -> Any: ...


@dataclass(frozen=True)
class GeneralControl:
    """One general-capability source of D_ctrl and how its test task renders it."""

    source: str  # the name in ``AttributeData.ctrl_source`` and in a bundle's gate.ctrl_sources
    splits_field: str  # the ``data_splits.Splits`` field holding its ids
    split: str  # the task split the ids come from
    shots: int  # few-shot examples before each question, as the test task has them
    task: str  # the lm-eval task that renders a record: a format string over the record's fields
    records: Callable[[str], list[dict]]  # the source's records of a split (``data``'s loader)


GENERAL_CONTROLS = (
    GeneralControl("arc_easy", "ctrl_arc", "train", data_splits.ARC_CTRL_SHOTS, "arc_easy_first25",
                   lambda split: data.load_arc("arc_easy", split)),
    GeneralControl("mmlu", "ctrl_mmlu", "validation", data_splits.MMLU_CTRL_SHOTS, "mmlu_{subject}", data.load_mmlu),
)


# The gate calibration that can tell requests apart (issue 81.2; not the paper's, which stays the default):
# MARI's ``gate_requests`` = N adds a seeded N of Self-Instruct's 175 human-written seed tasks to D_ctrl as a
# third general source, ``requests``: each the request as one chat user turn (as the model is used), its
# target the task's own first output. Under ``source`` labels they are non-applicable; under ``loss`` and
# ``flip`` their label is the intervention's outcome on that output, as for every other control example.
REQUEST_SOURCE = "requests"
REQUEST_POOL = "seed_tasks"  # data.BENIGN_SETS: the set that may serve calibration (never the evaluation set)


def request_control_ids(attribute: str, seed: int, count: int) -> list[str]:
    """The ``count`` seed tasks of an attribute's D_ctrl for ``seed``: the first in a seeded order."""
    ids = [r["id"] for r in data.load_benign_instructions(REQUEST_POOL)]
    if not 0 <= count <= len(ids):
        raise ValueError(f"gate_requests={count}: give 0 (the paper's calibration) to {len(ids)} (every seed task)")
    return sorted(data_splits.seeded_order(ids, "requests-ctrl", attribute, seed)[:count])


@dataclass
class Example:
    """One tokenised training or control example."""

    id: str
    context: list[int]
    options: list[list[int]]  # multiple choice options, or [target] for generation
    gold: int | None  # index of the correct option; None = generation (loss = NLL of options[0])
    question: str = ""  # the question or instruction alone (baselines build their own prompts from it)
    choices: list[str] = field(default_factory=list)  # the options' text
    # The frozen model's work, kept by Session.prepare (see mari_eval.training.memory): the cache of the
    # preamble shared with the other examples of its set (one object for all of them), the cache
    # of its own remainder of the prompt (None: recomputed at each use), the states after l*.
    shared: "Prefix | None" = field(default=None, repr=False)
    own: "Prefix | None" = field(default=None, repr=False)
    lower: list[torch.Tensor] | None = field(default=None, repr=False)  # states after l* of each option's row
    hidden: torch.Tensor | None = field(default=None, repr=False)  # h^{(l*)}_{p*} of the frozen model
    negatives: list[list[int]] = field(default_factory=list)  # behaviour-negative targets (generation)

    def contrast(self) -> tuple[list[list[int]], list[list[int]]]:
        """(behaviour-positive, behaviour-negative) continuations: the correct option and the
        wrong ones, or the refusal target and the compliance target."""
        if self.gold is None:
            return self.options[:1], self.negatives
        return [self.options[self.gold]], [o for i, o in enumerate(self.options) if i != self.gold]


class LazyExamples(Sequence["Example"]):
    """Examples known by their ``ids`` at once and rendered (``render()``, one per id in order) the
    first time one is read; ``len`` and ``ids`` render nothing."""

    def __init__(self, ids: Sequence[str], render: Callable[[], list["Example"]]):
        self.ids = list(ids)
        self._render: Callable[[], list["Example"]] | None = render
        self._examples: list["Example"] = []

    @property
    def rendered(self) -> bool:
        return self._render is None

    def _all(self) -> list["Example"]:
        if self._render is not None:
            examples = self._render()
            if [ex.id for ex in examples] != self.ids:
                raise RuntimeError("rendering D_ctrl gave other examples than its ids (a bug in examples.attribute_data)")
            self._examples, self._render = examples, None
        return self._examples

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        return self._all()[index]


@dataclass
class AttributeData:
    """An attribute's examples, tokenised; methods call ``Session.prepare`` on the ones they run."""

    attribute: str
    splits: data_splits.Splits
    pca_prompts: list[list[int]]  # D_pca: prompts without options or labels
    train: list[Example]
    ctrl: Sequence[Example]  # attribute control examples, then each general source's (GENERAL_CONTROLS)
    ctrl_source: list[str]  # "attribute" or a GeneralControl.source per ctrl example

    @property
    def ctrl_ids(self) -> list[str]:
        """D_ctrl's ids, without rendering a ``LazyExamples``."""
        return list(self.ctrl.ids) if isinstance(self.ctrl, LazyExamples) else [ex.id for ex in self.ctrl]

    def prepare(self, session: "Session") -> None:
        """Frozen-model caches of D_train and D_ctrl (each control source shares its own preamble)."""
        session.prepare(self.train, "D_train")
        self.prepare_ctrl(session)

    def prepare_ctrl(self, session: "Session") -> None:
        """Frozen-model caches of D_ctrl, a set per control source (each shares its own preamble)."""
        for source in dict.fromkeys(self.ctrl_source):
            session.prepare([ex for ex, s in zip(self.ctrl, self.ctrl_source) if s == source], f"D_ctrl ({source})")


def _task_docs(manager, name: str, split: str) -> tuple[Any, dict[str, dict]]:
    """``name``'s documents of ``split``: as the task serves them, or, for a split the task does not
    evaluate (MMLU's validation, the controls' source), from the task's dataset."""
    task = manager.load([name])["tasks"][name]
    docs = {"test": task.test_docs, "validation": task.validation_docs, "train": task.training_docs}[split]()
    if docs is None:
        docs = task.dataset[split]
    return task, {doc["id"]: doc for doc in docs}


def _mc_examples(session: "Session", task, docs: dict[str, dict], ids: Sequence[str], shots: int = 0) -> list[Example]:
    """``ids`` of ``docs`` as ``task`` renders them with ``shots`` few-shot examples."""
    out = []
    delim = task.config.target_delimiter
    for i in ids:
        doc = docs[i]
        context = task.fewshot_context(doc, shots)
        choices = task.doc_to_choice(doc)
        gold = task.doc_to_target(doc)
        gold = choices.index(gold) if isinstance(gold, str) else int(gold)
        ctx, conts = session.encode(context, [delim + c for c in choices])
        question = doc.get("question", "")
        if "context" in doc:  # BBQ: the context belongs to the question
            question = f"{doc['context']}\n{question}"
        out.append(Example(i, ctx, conts, gold, question=question, choices=list(choices)))
    return out


def _sorry_examples(session: "Session", records: dict[str, dict], ids: Sequence[str]) -> list[Example]:
    # The prompt the sorry_bench tasks generate from (MariLM.chat_turn_prompt), in generation's tokens.
    out = []
    for i in ids:
        instruction = records[i]["turns"][0]
        prompt = session.lm.chat_turn_prompt(instruction)
        ctx, conts = session.encode_generation(prompt, [REFUSAL_TARGET, COMPLIANCE_TARGET])
        out.append(Example(i, ctx, conts[:1], None, question=instruction, choices=[REFUSAL_TARGET], negatives=conts[1:]))
    return out


def _request_examples(session: "Session", ids: Sequence[str]) -> list[Example]:
    """Seed-task controls: the request as one chat user turn, its first output as the target (generation)."""
    records = {r["id"]: r for r in data.load_benign_instructions(REQUEST_POOL)}
    out = []
    for i in ids:
        output = records[i]["instances"][0]["output"] if records[i]["instances"] else ""
        ctx, conts = session.encode_generation(session.lm.chat_turn_prompt(records[i]["prompt"]), [output])
        out.append(Example(i, ctx, conts, None, question=records[i]["prompt"], choices=[output]))
    return out


def general_controls(session: "Session", manager, control: GeneralControl, ids: Sequence[str]) -> list[Example]:
    """The control examples ``ids`` of one general source, each rendered by its test task
    (``control.task`` over its record: one task for ARC-Easy, its subject's for MMLU)."""
    task_of = {r["id"]: control.task.format(**r) for r in control.records(control.split)}
    by_task: dict[str, list[str]] = {}
    for i in ids:
        by_task.setdefault(task_of[i], []).append(i)
    rendered: dict[str, Example] = {}
    for name, task_ids in by_task.items():
        task, docs = _task_docs(manager, name, control.split)
        rendered.update((ex.id, ex) for ex in _mc_examples(session, task, docs, task_ids, control.shots))
    return [rendered[i] for i in ids]


def attribute_data(session: "Session", attribute: str, seed: int, max_train: int | None = None,
                   max_ctrl: int | None = None, max_pca: int | None = None, requests: int = 0) -> AttributeData:
    """An attribute's splits for ``seed``, rendered; ``requests``: seed tasks added to D_ctrl (REQUEST_SOURCE)."""
    if attribute not in ATTRIBUTE_TASKS:
        raise ValueError(f"unknown attribute {attribute!r}; choose one of {', '.join(ATTRIBUTE_TASKS)}")
    splits = data_splits.make_splits(attribute, seed)
    pca_ids = list(splits.pca)
    if max_pca is not None and len(pca_ids) > max_pca:  # smoke runs: a seeded subset of D_pca
        pca_ids = random.Random(f"max_pca:{seed}").sample(pca_ids, max_pca)
    train_ids = list(splits.train)
    if max_train is not None and len(train_ids) > max_train:  # a seeded subset, chosen before any is rendered
        train_ids = random.Random(f"max_train:{seed}").sample(train_ids, max_train)
    manager = task_manager(())  # our task folder alone: every task training renders is there
    if attribute == "sorry_bench":
        records = {r["id"]: r for r in data.load_sorry_bench()}
        pca = [session.lm.generation_ids(session.lm.chat_turn_prompt(records[i]["turns"][0])) for i in pca_ids]
        render_attribute = functools.partial(_sorry_examples, session, records)
    else:
        task, docs = _task_docs(manager, ATTRIBUTE_TASKS[attribute], "validation" if attribute == "truthfulqa" else "test")
        pca = [session.encode_prompt(task.fewshot_context(docs[i], 0)) for i in pca_ids]
        render_attribute = functools.partial(_mc_examples, session, task, docs)
    train = render_attribute(train_ids)
    attribute_ids = list(splits.ctrl)
    if max_ctrl is not None:  # smoke runs: a seeded subset of each control source
        attribute_ids = random.Random(f"max_ctrl:{seed}").sample(attribute_ids, min(max_ctrl, len(attribute_ids)))
    general: list[tuple[GeneralControl, list[str]]] = []
    for control in GENERAL_CONTROLS:
        ids = list(getattr(splits, control.splits_field))
        if max_ctrl is not None:
            ids = random.Random(f"max_ctrl_{control.source}:{seed}").sample(ids, min(max_ctrl, len(ids)))
        general.append((control, ids))
    request_ids = request_control_ids(attribute, seed, requests) if requests else []
    if max_ctrl is not None and request_ids:
        request_ids = sorted(random.Random(f"max_ctrl_{REQUEST_SOURCE}:{seed}").sample(request_ids, min(max_ctrl, len(request_ids))))
    sources = (["attribute"] * len(attribute_ids) + [control.source for control, ids in general for _ in ids]
               + [REQUEST_SOURCE] * len(request_ids))

    def render_ctrl() -> list[Example]:
        ctrl = render_attribute(attribute_ids)
        for control, ids in general:
            ctrl += general_controls(session, manager, control, ids)
        return ctrl + _request_examples(session, request_ids)

    ctrl = LazyExamples(attribute_ids + [i for _, ids in general for i in ids] + request_ids, render_ctrl)
    return AttributeData(attribute, splits, pca, train, ctrl, sources)
