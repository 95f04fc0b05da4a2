"""What every benchmark record must hold, and the checks that name the line and field that do not.

Every local data file (and every Hub row) is checked against the schema of its family
(``SCHEMAS``) before anything uses it: field types (a JSON true is not the integer 1),
nested shapes, value ranges, blank prompts and options, cross-field rules (a label per
choice, an answer that indexes the choices...), duplicate records, and hostile lines (JSON
nested too deep, lone UTF-16 surrogates). A record that fails raises ``DataError`` naming
the file, the line, the field path, what was expected and what was found.

The pieces:

* field types (``data_fields``: ``TEXT``, ``STR``, ``Int``, ``OneOf``, ``ListOf``, ``Obj``):
  each one's ``problem(value, path)`` is None when the value fits, else a ``Bad`` saying where and why;
* ``Schema``: the fields of one file family, a cross-field check and the duplicate keys;
* ``Records``: collects the records of one file or Hub split, checking each on the way in.

Reading the files (and remembering which ones were already checked) is ``data.read_jsonl``.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable, Iterable

from .data_fields import STR, TEXT, Bad, Int, ListOf, Obj, OneOf

log = logging.getLogger("mari_eval.benchmarks.data")  # the loaders' logger: one place to silence data warnings


class DataError(RuntimeError):
    """A dataset could not be read: the message names the file or source and the fix."""


# The 11 BBQ categories of Parrish et al. (2022), file names of nyu-mll/BBQ.
BBQ_CATEGORIES = (
    "Age", "Disability_status", "Gender_identity", "Nationality", "Physical_appearance", "Race_ethnicity",
    "Race_x_SES", "Race_x_gender", "Religion", "SES", "Sexual_orientation",
)
# lm-eval 0.4.13's BBQ "unknown" answers (lm_eval/tasks/bbq/utils.py UNKNOWN_RESPONSES): its
# doc_to_choice replaces the one such answer of a record by all of these, and fails with an
# IndexError when a record has none. tests/test_data_schema.py checks that the two lists agree.
BBQ_UNKNOWN_RESPONSES = (
    "Unknown", "Cannot answer", "Can't be determined", "Cannot be determined", "Can't answer",
    "Not known", "Not enough info", "Not enough information", "Not answerable", "Undetermined",
)
_BBQ_UNKNOWN = frozenset(BBQ_UNKNOWN_RESPONSES)
SORRY_BENCH_CATEGORIES = tuple(str(i) for i in range(1, 46))  # category ids of the 202406 release
MAX_DEPTH = 32  # JSON nesting allowed in a data line (the HF schemas need 3; Arrow fails near 200)


# ----------------------------------------------------------------------------- schemas


class Schema:
    """What every record of one file family must hold, and what makes two records the same one.

    ``fields``: (name, type) pairs, the required fields and their types (type None: any value).
    ``check``: a cross-field test of a well-typed record, raising Bad. ``keys``: (what,
    function) pairs; two records with equal function values are duplicates, refused unless
    ``duplicates`` is "warn" (kept, and said once per file and process).
    """

    def __init__(self, family: str, fields: tuple, check: Callable[[dict], None] | None = None,
                 keys: tuple = (), duplicates: str = "refuse"):
        self.family, self.fields, self.check, self.keys, self.duplicates = family, fields, check, keys, duplicates
        self.required = tuple(name for name, _ in fields)
        self.required_set = frozenset(self.required)
        self.typed = tuple((name, t) for name, t in fields if t is not None)

    def problem(self, r: dict) -> Bad | None:
        """None when ``r`` (a dict holding every required field) fits, else the first wrong field."""
        for name, t in self.typed:
            bad = t.problem(r[name], name)
            if bad is not None:
                return bad
        if self.check is not None:
            try:
                self.check(r)
            except Bad as e:
                return e
        return None


def _schema(family, check=None, keys=(), duplicates="refuse", **fields) -> Schema:
    return Schema(family, tuple(fields.items()), check, keys, duplicates)


def _field(name: str):
    return lambda r: r[name]


def _check_targets(r: dict) -> None:
    for name in ("mc1_targets", "mc2_targets"):
        t = r[name]
        if len(t["labels"]) != len(t["choices"]):
            raise Bad(f"{name}.labels", f"one label per choice ({len(t['choices'])})",
                      found=f"{len(t['labels'])} labels")
    labels = r["mc1_targets"]["labels"]
    if labels[0] != 1 or sum(labels) != 1:  # lm-eval's truthfulqa_mc1 scores choice 0 as the answer
        raise Bad("mc1_targets.labels", "exactly one 1, on the first choice (truthfulqa_mc1 scores choice 0 "
                  "as the correct one)", labels)
    labels = r["mc2_targets"]["labels"]
    if 1 not in labels or 0 not in labels:  # otherwise MC2 is 0 (or 1) whatever the model does
        raise Bad("mc2_targets.labels", "at least one 1 (true) and one 0 (false)", labels)


def _check_bbq(r: dict) -> None:
    unknown = [k for k in ("ans0", "ans1", "ans2") if r[k] in _BBQ_UNKNOWN]
    if len(unknown) != 1:
        raise Bad("ans0/ans1/ans2", f"exactly one \"unknown\" answer (one of {list(BBQ_UNKNOWN_RESPONSES)}; "
                  "lm-eval's BBQ scoring relies on it)", found=f"{len(unknown)} ({unknown})")
    for k in ("ans0", "ans1", "ans2"):
        # lm-eval reads the answer's group from answer_info; an empty one it fills only for "Latina"
        # answers, else it reuses the previous answer's group (or fails on ans0).
        if not any(r["answer_info"][k]) and "Latina" not in r[k]:
            raise Bad(f"answer_info.{k}", "the answer's group (a non-empty string)", r["answer_info"][k])


def _check_sorry(r: dict) -> None:
    if len(r["turns"]) != 1:  # the base prompts are single-turn; training and the tasks use turns[0]
        raise Bad("turns", "exactly one turn (SORRY-Bench base prompts are single-turn)",
                  found=f"{len(r['turns'])} turns")


def _check_mmlu(r: dict) -> None:
    if r["answer"] >= len(r["choices"]):
        raise Bad("answer", f"an index into choices (0..{len(r['choices']) - 1})", r["answer"])


def _check_arc(r: dict) -> None:
    labels = r["choices"]["label"]
    if len(labels) != len(r["choices"]["text"]):
        raise Bad("choices.label", f"one label per choice text ({len(r['choices']['text'])})",
                  found=f"{len(labels)} labels")
    if len(set(labels)) != len(labels):
        raise Bad("choices.label", "distinct labels", labels)
    if r["answerKey"] not in labels:
        raise Bad("answerKey", f"one of choices.label {labels}", r["answerKey"])


def _check_gsm8k(r: dict) -> None:
    answer = r["answer"]
    at = answer.rfind("#### ")
    if at < 0 or at + 5 == len(answer) or answer[at + 5:].isspace():
        raise Bad("answer", "a solution ending in '#### <final answer>'", answer)


def _check_xstest(r: dict) -> None:
    if r["type"].startswith("contrast_") != (r["label"] == "unsafe"):
        raise Bad("label", "unsafe exactly for a contrast_* type (XSTest's unsafe prompts)", r["label"])


_TARGETS = Obj(choices=ListOf(TEXT), labels=ListOf(Int(0, 1)))
# Self-Instruct's requests: at least one instance, its input possibly empty, its output the authors' answer (the
# benign KL's reference, repro/engine/lm_eval_run.py). A prompt is the instruction and the first input: the unit.
_INSTANCES = ListOf(Obj(input=STR, output=TEXT))
_BENIGN_KEYS = (("id", _field("id")), ("instruction and first input", lambda r: (r["instruction"], r["instances"][0]["input"])))

SCHEMAS = {
    "truthfulqa/mc": _schema(
        "truthfulqa/mc", _check_targets, keys=(("question", _field("question")),),
        question=TEXT, mc1_targets=_TARGETS, mc2_targets=_TARGETS),
    # The generation answers keep the empty strings of the HF data (31 in correct/incorrect_answers).
    "truthfulqa/generation": _schema(
        "truthfulqa/generation", keys=(("question", _field("question")),),
        question=TEXT, best_answer=TEXT, correct_answers=ListOf(STR), incorrect_answers=ListOf(STR), category=TEXT),
    "bbq": _schema(
        "bbq", _check_bbq, keys=(("example_id", _field("example_id")),),
        example_id=Int(0), question_polarity=OneOf("neg", "nonneg"), context_condition=OneOf("ambig", "disambig"),
        category=OneOf(*BBQ_CATEGORIES),
        answer_info=Obj(ans0=ListOf(STR, 0), ans1=ListOf(STR, 0), ans2=ListOf(STR, 0)),
        additional_metadata=Obj(stereotyped_groups=ListOf(STR, 0)),
        context=TEXT, question=TEXT, ans0=TEXT, ans1=TEXT, ans2=TEXT, label=Int(0, 2)),
    "sorry_bench": _schema(
        "sorry_bench", _check_sorry, keys=(("question_id", _field("question_id")), ("prompt", lambda r: r["turns"][0])),
        question_id=Int(), category=OneOf(*SORRY_BENCH_CATEGORIES), turns=ListOf(TEXT)),
    # MMLU as published (cais/mmlu, and lm-eval's mmlu) repeats 28 questions (1 in dev, 27 in
    # test, same subject, choices and answer); they are kept, so that scores stay comparable.
    "mmlu": _schema(
        "mmlu", _check_mmlu,
        keys=(("subject, question and choices", lambda r: (r["subject"], r["question"], tuple(r["choices"]))),),
        duplicates="warn", question=TEXT, subject=TEXT, choices=ListOf(TEXT), answer=Int(0)),
    # ARC repeats a few questions under two exam ids (e.g. MEA_2011_8_8, MEA_2012_5_8): distinct records.
    "arc": _schema(
        "arc", _check_arc, keys=(("id", _field("id")),),
        id=TEXT, question=TEXT, choices=Obj(text=ListOf(TEXT), label=ListOf(TEXT)), answerKey=TEXT),
    "gsm8k": _schema("gsm8k", _check_gsm8k, keys=(("question", _field("question")),), question=TEXT, answer=STR),
    # XSTest's 450 prompts (the authors' xstest_prompts.csv): a contrast_* type is an unsafe prompt.
    "xstest/prompts": _schema(
        "xstest/prompts", _check_xstest, keys=(("id", _field("id")), ("prompt", _field("prompt"))),
        id=TEXT, prompt=TEXT, type=TEXT, label=OneOf("safe", "unsafe"), focus=STR, note=STR),
    # XSTest's completions with their human labels (shared/data/SOURCES.md): one per (model, prompt id).
    # gpt4_label is free text where GPT-4 did not answer with a label, as in the original files.
    "xstest/completions": _schema(
        "xstest/completions", keys=(("model and id", lambda r: (r["model"], r["id"])),),
        model=TEXT, id=TEXT, type=TEXT, prompt=TEXT, completion=STR,
        final_label=OneOf("1_full_compliance", "2_full_refusal", "3_partial_refusal"), gpt4_label=STR,
        strmatch_label=OneOf("1_full_compliance", "2_full_refusal")),
    # Self-Instruct's human-written requests (shared/data/SOURCES.md, benign_instructions/): the 175 seed tasks
    # (calibration or selection) and the 252 user-oriented instructions (evaluation only).
    "benign_instructions/seed_tasks": _schema(
        "benign_instructions/seed_tasks", keys=_BENIGN_KEYS, id=TEXT, instruction=TEXT, instances=_INSTANCES),
    "benign_instructions/user_oriented_instructions": _schema(
        "benign_instructions/user_oriented_instructions", keys=_BENIGN_KEYS, id=TEXT, instruction=TEXT,
        instances=_INSTANCES),
}
# Fields every record must carry, per local file family (the HF schemas); the types are in SCHEMAS.
REQUIRED_FIELDS = {family: schema.required for family, schema in SCHEMAS.items()}


# ----------------------------------------------------------------------------- lines and records


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return f"{json.dumps(value)} (a JSON boolean, not an integer)"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    kind = {str: "string", int: "integer", float: "number", list: "list", dict: "object", type(None): "null"}
    return f"{text} ({kind.get(type(value), type(value).__name__)})"


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """(field path, text) of the first string holding a lone UTF-16 surrogate (say from "\\ud800")."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return p or "(record)", v
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, f"{p}.{k} (the key)".lstrip(".")))
                stack.append((x, f"{p}.{k}".lstrip(".")))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
    return None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_warned_duplicates: set[str] = set()  # sources whose kept duplicates were already logged


class Records:
    """Collects the records of one source (``unit``: its lines or rows), checking each against a schema.

    ``fixed``: fields whose value every record must equal (say a BBQ file's category).
    """

    def __init__(self, source: str, schema: Schema, unit: str = "line", fixed: dict | None = None):
        self.source, self.schema, self.unit, self.fixed = source, schema, unit, fixed or {}
        self.records: list[dict] = []
        self.seen: list[dict] = [{} for _ in schema.keys]
        self.duplicates: list[tuple[int, int, str]] = []

    def where(self, n: int, field: str | None = None) -> str:
        return f"{self.source}, {self.unit} {n}" + (f", field '{field}'" if field else "")

    def add_line(self, line: str, n: int) -> None:
        """Parse one JSON line, refuse it when nested too deep or holding a lone surrogate, then ``add``."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{self.where(n)}: not valid JSON ({e.msg})") from None
        except RecursionError:  # nested past Python's recursion limit
            record, too_deep = None, True
        else:  # counting brackets first spares the walk of every ordinary line
            too_deep = line.count("[") + line.count("{") > MAX_DEPTH and _depth(record) > MAX_DEPTH
        if too_deep:
            raise DataError(f"{self.where(n)}: JSON nested more than {MAX_DEPTH} levels deep; "
                            f"no field of these datasets is. Fix or remove this line.")
        if "\\u" in line and _SURROGATE_ESCAPE.search(line):
            found = _lone_surrogate(record)
            if found is not None:
                raise DataError(
                    f"{self.where(n, found[0])}: a lone UTF-16 surrogate (a \\ud800-\\udfff escape without "
                    f"its pair) in {_show(found[1])}; it is not text and tokenizers fail on it. "
                    f"Fix the escape or remove this line."
                )
        self.add(record, n)

    def add(self, record: Any, n: int) -> None:
        schema = self.schema
        if not isinstance(record, dict):
            raise DataError(f"{self.where(n)}: expected a JSON object with fields {list(schema.required)}, "
                            f"got {_show(record)}")
        if not record.keys() >= schema.required_set:
            missing = [k for k in schema.required if k not in record]
            raise DataError(f"{self.where(n)}: missing field(s) {missing}; expected fields {list(schema.required)}")
        bad = schema.problem(record)
        if bad is None:
            for name, value in self.fixed.items():
                if record[name] != value:
                    bad = Bad(name, f"{value!r} (the file's {name})", record[name])
        if bad is not None:
            got = bad.found if bad.found is not None else _show(bad.value)
            raise DataError(f"{self.where(n, bad.field)}: expected {bad.expected}, got {got}. "
                            f"Fix or remove this record.")
        for (what, key_of), seen in zip(schema.keys, self.seen):
            key = key_of(record)
            first = seen.setdefault(key, n)
            if first != n:
                if schema.duplicates != "warn":
                    raise DataError(
                        f"{self.where(n)}: duplicate of {self.unit} {first} (same {what}: {_show(key)}); "
                        f"every record must appear once, or it is counted twice. Remove one of the two."
                    )
                self.duplicates.append((first, n, what))
                break
        self.records.append(record)

    def done(self) -> list[dict]:
        if not self.records:
            raise DataError(f"{self.source} holds no records")
        if self.duplicates and self.source not in _warned_duplicates:
            _warned_duplicates.add(self.source)
            pairs = ", ".join(f"{self.unit} {b} = {a}" for a, b, _ in self.duplicates[:5])
            log.warning("%s: %d record(s) repeat an earlier one (same %s: %s%s); kept, as in the published "
                        "%s data", self.source, len(self.duplicates), self.duplicates[0][2], pairs,
                        ", ..." if len(self.duplicates) > 5 else "", self.schema.family)
        return self.records


def check_records(rows: Iterable[dict], family: str, source: str) -> list[dict]:
    """``rows`` (e.g. from the Hub) checked against the schema of ``family``, as local files are."""
    out = Records(source, SCHEMAS[family], unit="row")
    for i, row in enumerate(rows):
        out.add(row, i)
    return out.done()
