"""Benchmark loading and the paper's data splits (Appendix B).

Every loader returns a list of records in the Hugging Face schema of the dataset,
each with an added stable ``id``. Records come from the local copy under
``$MARI_DATA_DIR`` when that variable is set (layout of ``shared/data``: see
``DATA_FILES``), otherwise from the Hugging Face Hub.

Splits (``make_splits``) are a pure function of (dataset, seed):

* a training pool (TruthfulQA: 200 questions sampled uniformly at random; other
  attributes: 20% of the examples), halved into D_pca (question text only, for the
  PCA basis of the energy gate) and D_train (adapter and probe training);
* D_ctrl: held-out attribute examples (10%, at most 100) plus a small seeded subset
  of ARC-Easy *train* questions (100), disjoint from D_pca and D_train and from
  every reported test set;
* the test split: every remaining attribute example.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import random
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

DATA_ENV = "MARI_DATA_DIR"

# The 11 BBQ categories of Parrish et al. (2022), file names of nyu-mll/BBQ.
BBQ_CATEGORIES = (
    "Age",
    "Disability_status",
    "Gender_identity",
    "Nationality",
    "Physical_appearance",
    "Race_ethnicity",
    "Race_x_SES",
    "Race_x_gender",
    "Religion",
    "SES",
    "Sexual_orientation",
)
ARC_CONFIGS = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}

# ----------------------------------------------------------------------------- record schemas
#
# Every local file (and every Hub row) is checked against the schema of its family before
# anything uses it: field types (a JSON true is not the integer 1), nested shapes, value
# ranges, blank prompts and options, and duplicate records. A record that fails names the
# file, the line, the field, what was expected and what was found. The checks are plain
# isinstance/range tests on fields the tasks read anyway (a few microseconds a record).

MAX_DEPTH = 32  # JSON nesting allowed in a data line (the HF schemas need 3; Arrow fails near 200)

# lm-eval 0.4.13's BBQ "unknown" answers (lm_eval/tasks/bbq/utils.py UNKNOWN_RESPONSES): its
# doc_to_choice replaces the one such answer of a record by all of these, and fails with an
# IndexError when a record has none. tests/test_data.py checks that the two lists agree.
BBQ_UNKNOWN_RESPONSES = (
    "Unknown", "Cannot answer", "Can't be determined", "Cannot be determined", "Can't answer",
    "Not known", "Not enough info", "Not enough information", "Not answerable", "Undetermined",
)
_BBQ_UNKNOWN = frozenset(BBQ_UNKNOWN_RESPONSES)
SORRY_BENCH_CATEGORIES = tuple(str(i) for i in range(1, 46))  # category ids of the 202406 release


class _Bad(Exception):
    """One field of one record is wrong: where (a path such as ``mc1_targets.labels[2]``), what was expected."""

    def __init__(self, field: str, expected: str, value: Any = None, found: str | None = None):
        super().__init__(field)
        self.field, self.expected, self.value, self.found = field, expected, value, found


class T:
    """The type of one field (build with TEXT, STR, _int, _enum, _list, _obj).

    ``expr(v, ns)`` is a Python expression testing the value ``v`` (itself an expression);
    the constants it uses go into ``ns``. A schema compiles its fields' expressions into one
    function (``Schema.fits``), so that checking a good record is a single call with no
    allocation. ``why(value, path)`` finds the first wrong part once that said no.
    """

    def __init__(self, expr, expected: str, item: "T | None" = None, fields: tuple = (), min_len: int = 0):
        self.expr, self.expected, self.item, self.fields, self.min_len = expr, expected, item, fields, min_len
        fast = _compile(lambda ns: expr("v", ns), "v")

        def ok(v: Any) -> bool:
            try:
                return fast(v)
            except TypeError:  # a list item of the wrong type (see _list)
                return False

        self.ok = ok

    def why(self, v: Any, path: str) -> _Bad:
        if self.item is not None and type(v) is list and len(v) >= self.min_len:
            for i, x in enumerate(v):
                if not self.item.ok(x):
                    return self.item.why(x, f"{path}[{i}]")
        if self.fields and type(v) is dict:
            for name, t in self.fields:
                if name not in v:
                    return _Bad(f"{path}.{name}", t.expected, found="no such field")
                if not t.ok(v[name]):
                    return t.why(v[name], f"{path}.{name}")
        return _Bad(path, self.expected, v)


def _compile(body, arg: str):
    """``lambda arg: <body(ns)>``, compiled once."""
    ns: dict[str, Any] = {}
    code = body(ns)
    exec(f"def test({arg}):\n    return {code}", ns)  # noqa: S102 (our own expressions, no data)
    return ns["test"]


def _const(ns: dict, value: Any) -> str:
    name = f"C{len(ns)}"
    ns[name] = value
    return name


TEXT = T(lambda v, ns: f"(type({v}) is str and {v} != '' and not {v}.isspace())", "a non-blank string")
STR = T(lambda v, ns: f"type({v}) is str", "a string")


def _int(lo: int | None = None, hi: int | None = None) -> T:
    span = "" if lo is None and hi is None else f" >= {lo}" if hi is None else f" in {lo}..{hi}"
    bounds = "".join(f" and {v}" for v in ((f"{lo} <= {{v}}" if lo is not None else ""),
                                          (f"{{v}} <= {hi}" if hi is not None else "")) if v)
    # type(v) is int, not isinstance: a JSON true is a bool, never the integer 1.
    return T(lambda v, ns: f"(type({v}) is int{bounds.format(v=v)})", f"an integer{span}")


def _enum(*values: str) -> T:
    allowed = frozenset(values)
    return T(lambda v, ns: f"(type({v}) is str and {v} in {_const(ns, allowed)})",
             "one of " + ", ".join(map(repr, values)))


def _list(item: T, min_len: int = 1, lo: int | None = None, hi: int | None = None) -> T:
    """A list of ``item`` (TEXT, STR, or an integer in lo..hi when item is None)."""
    if item is None:
        item = _int(lo, hi)
        many = item.expected.replace("an integer", "integers", 1)
    else:
        many = {TEXT: "non-blank strings", STR: "strings"}[item]

    def expr(v, ns):
        # Whole-list tests in C, no Python call per item. str.join and str.isspace raise
        # TypeError on a non-string item, which Schema.problem reads as "does not fit".
        if item is TEXT:
            return f"(type({v}) is list and len({v}) >= {min_len} and all({v}) and not any(map(str.isspace, {v})))"
        if item is STR:
            return f"(type({v}) is list and len({v}) >= {min_len} and ''.join({v}) is not None)"
        of = f"set(map(type, {v})) <= {_const(ns, frozenset({int}))}"  # type(): bools are no ints
        if lo is not None:
            of += f" and (not {v} or {lo} <= min({v}))"
        if hi is not None:
            of += f" and (not {v} or max({v}) <= {hi})"
        return f"(type({v}) is list and len({v}) >= {min_len} and {of})"

    return T(expr, f"a {'non-empty ' if min_len else ''}list of {many}", item=item, min_len=min_len)


def _obj(**fields: T) -> T:
    pairs = tuple(fields.items())

    def expr(v, ns):
        return (f"(type({v}) is dict and {v}.keys() >= {_const(ns, frozenset(fields))}"
                + "".join(f" and {t.expr(f'{v}[{name!r}]', ns)}" for name, t in pairs) + ")")

    return T(expr, "an object with fields " + ", ".join(fields), fields=pairs)


_TARGETS = _obj(choices=_list(TEXT), labels=_list(None, lo=0, hi=1))


def _check_targets(r: dict) -> None:
    for name in ("mc1_targets", "mc2_targets"):
        t = r[name]
        if len(t["labels"]) != len(t["choices"]):
            raise _Bad(f"{name}.labels", f"one label per choice ({len(t['choices'])})",
                       found=f"{len(t['labels'])} labels")
    labels = r["mc1_targets"]["labels"]
    if labels[0] != 1 or sum(labels) != 1:  # lm-eval's truthfulqa_mc1 scores choice 0 as the answer
        raise _Bad("mc1_targets.labels", "exactly one 1, on the first choice (truthfulqa_mc1 scores choice 0 "
                   "as the correct one)", labels)
    labels = r["mc2_targets"]["labels"]
    if 1 not in labels or 0 not in labels:  # otherwise MC2 is 0 (or 1) whatever the model does
        raise _Bad("mc2_targets.labels", "at least one 1 (true) and one 0 (false)", labels)


def _check_bbq(r: dict) -> None:
    info = r["answer_info"]
    if ((r["ans0"] in _BBQ_UNKNOWN) + (r["ans1"] in _BBQ_UNKNOWN) + (r["ans2"] in _BBQ_UNKNOWN) == 1
            and any(info["ans0"]) and any(info["ans1"]) and any(info["ans2"])):
        return  # the common case, tested cheaply; the rest says what is wrong
    unknown = [k for k in ("ans0", "ans1", "ans2") if r[k] in _BBQ_UNKNOWN]
    if len(unknown) != 1:
        raise _Bad("ans0/ans1/ans2", f"exactly one \"unknown\" answer (one of {list(BBQ_UNKNOWN_RESPONSES)}; "
                   "lm-eval's BBQ scoring relies on it)", found=f"{len(unknown)} ({unknown})")
    for k in ("ans0", "ans1", "ans2"):
        # lm-eval reads the answer's group from answer_info; an empty one it fills only for "Latina"
        # answers, else it reuses the previous answer's group (or fails on ans0).
        if not any(r["answer_info"][k]) and "Latina" not in r[k]:
            raise _Bad(f"answer_info.{k}", "the answer's group (a non-empty string)", r["answer_info"][k])


def _check_sorry(r: dict) -> None:
    if len(r["turns"]) != 1:  # the base prompts are single-turn; training and the tasks use turns[0]
        raise _Bad("turns", "exactly one turn (SORRY-Bench base prompts are single-turn)",
                   found=f"{len(r['turns'])} turns")


def _check_mmlu(r: dict) -> None:
    if r["answer"] >= len(r["choices"]):
        raise _Bad("answer", f"an index into choices (0..{len(r['choices']) - 1})", r["answer"])


def _check_arc(r: dict) -> None:
    labels = r["choices"]["label"]
    if len(labels) != len(r["choices"]["text"]):
        raise _Bad("choices.label", f"one label per choice text ({len(r['choices']['text'])})",
                   found=f"{len(labels)} labels")
    if len(set(labels)) != len(labels):
        raise _Bad("choices.label", "distinct labels", labels)
    if r["answerKey"] not in labels:
        raise _Bad("answerKey", f"one of choices.label {labels}", r["answerKey"])


def _check_gsm8k(r: dict) -> None:
    answer = r["answer"]
    at = answer.rfind("#### ")
    if at < 0 or at + 5 == len(answer) or answer[at + 5:].isspace():
        raise _Bad("answer", "a solution ending in '#### <final answer>'", answer)


class Schema:
    """What every record of one file family must hold, and what makes two records the same one.

    ``fields``: (name, T) pairs, the required fields and their types (T None: any value).
    ``check``: a cross-field test of a well-typed record, raising _Bad. ``keys``: (what,
    function) pairs; two records with equal function values are duplicates, refused unless
    ``duplicates`` is "warn" (kept, and said once per file and process).
    """

    def __init__(self, family: str, fields: tuple, check=None, keys: tuple = (), duplicates: str = "refuse"):
        self.family, self.fields, self.check, self.keys, self.duplicates = family, fields, check, keys, duplicates
        self.required = tuple(name for name, _ in fields)
        self.required_set = frozenset(self.required)
        typed = [(name, t) for name, t in fields if t is not None]
        self.fits = _compile(lambda ns: " and ".join([f"r.keys() >= {_const(ns, self.required_set)}"]
                                                     + [t.expr(f"r[{name!r}]", ns) for name, t in typed]), "r")

    def problem(self, r: dict) -> _Bad | None:
        """None when ``r`` (a dict holding every required field) fits, else the first wrong field."""
        try:
            fits = self.fits(r)
        except TypeError:  # a list item of the wrong type (see _list)
            fits = False
        if not fits:
            for name, t in self.fields:
                if t is not None and not t.ok(r[name]):
                    return t.why(r[name], name)
        if self.check is not None:
            try:
                self.check(r)
            except _Bad as e:
                return e
        return None


def _schema(family, check=None, keys=(), duplicates="refuse", **fields: T) -> Schema:
    return Schema(family, tuple(fields.items()), check, keys, duplicates)


def _field(name: str):
    return lambda r: r[name]


SCHEMAS = {
    "truthfulqa/mc": _schema(
        "truthfulqa/mc", _check_targets, keys=(("question", _field("question")),),
        question=TEXT, mc1_targets=_TARGETS, mc2_targets=_TARGETS),
    # The generation answers keep the empty strings of the HF data (31 in correct/incorrect_answers).
    "truthfulqa/generation": _schema(
        "truthfulqa/generation", keys=(("question", _field("question")),),
        question=TEXT, best_answer=TEXT, correct_answers=_list(STR), incorrect_answers=_list(STR), category=TEXT),
    "bbq": _schema(
        "bbq", _check_bbq, keys=(("example_id", _field("example_id")),),
        example_id=_int(0), question_polarity=_enum("neg", "nonneg"), context_condition=_enum("ambig", "disambig"),
        category=_enum(*BBQ_CATEGORIES),
        answer_info=_obj(ans0=_list(STR, 0), ans1=_list(STR, 0), ans2=_list(STR, 0)),
        additional_metadata=_obj(stereotyped_groups=_list(STR, 0)),
        context=TEXT, question=TEXT, ans0=TEXT, ans1=TEXT, ans2=TEXT, label=_int(0, 2)),
    "sorry_bench": _schema(
        "sorry_bench", _check_sorry, keys=(("question_id", _field("question_id")), ("prompt", lambda r: r["turns"][0])),
        question_id=_int(), category=_enum(*SORRY_BENCH_CATEGORIES), turns=_list(TEXT)),
    # MMLU as published (cais/mmlu, and lm-eval's mmlu) repeats 28 questions (1 in dev, 27 in
    # test, same subject, choices and answer); they are kept, so that scores stay comparable.
    "mmlu": _schema(
        "mmlu", _check_mmlu,
        keys=(("subject, question and choices", lambda r: (r["subject"], r["question"], tuple(r["choices"]))),),
        duplicates="warn", question=TEXT, subject=TEXT, choices=_list(TEXT), answer=_int(0)),
    # ARC repeats a few questions under two exam ids (e.g. MEA_2011_8_8, MEA_2012_5_8): distinct records.
    "arc": _schema(
        "arc", _check_arc, keys=(("id", _field("id")),),
        id=TEXT, question=TEXT, choices=_obj(text=_list(TEXT), label=_list(TEXT)), answerKey=TEXT),
    "gsm8k": _schema("gsm8k", _check_gsm8k, keys=(("question", _field("question")),), question=TEXT, answer=STR),
}
# Fields every record must carry, per local file family (the HF schemas); the types are in SCHEMAS.
REQUIRED_FIELDS = {family: schema.required for family, schema in SCHEMAS.items()}


class DataError(RuntimeError):
    """A dataset could not be read: the message names the file or source and the fix."""


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
_TOO_DEEP = object()
_checked: set[tuple] = set()  # (sha256 of a file's bytes, schema, fixed fields) that read_jsonl accepted
_warned_duplicates: set[str] = set()


class _Records:
    """Collects the records of one source, checking each against a schema and for duplicates."""

    def __init__(self, source: str, schema: Schema, unit: str = "line", fixed: dict | None = None):
        self.source, self.schema, self.unit, self.fixed = source, schema, unit, fixed or {}
        self.records: list[dict] = []
        self.seen: list[dict] = [{} for _ in schema.keys]
        self.duplicates: list[tuple[int, int, str]] = []

    def where(self, n: int, field: str | None = None) -> str:
        return f"{self.source}, {self.unit} {n}" + (f", field '{field}'" if field else "")

    def add(self, record: Any, n: int) -> None:
        schema = self.schema
        if not isinstance(record, dict):
            raise DataError(f"{self.where(n)}: expected a JSON object with fields {list(schema.required)}, "
                            f"got {_show(record)}")
        if not record.keys() >= schema.required_set:
            missing = [k for k in schema.required if k not in record]
            raise DataError(f"{self.where(n)}: missing field(s) {missing}; expected fields {list(schema.required)}")
        bad = schema.problem(record)
        if bad is None and self.fixed:
            for name, value in self.fixed.items():
                if record[name] != value:
                    bad = _Bad(name, f"{value!r} (the file's {name})", record[name])
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


# ----------------------------------------------------------------------------- sources


def data_dir() -> Path | None:
    value = os.environ.get(DATA_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise DataError(f"{DATA_ENV}={value} is not a directory; point it at a folder laid out like shared/data")
    return path


def read_jsonl(path: Path, required: "Schema | Iterable[str]", fixed: dict | None = None) -> list[dict]:
    """Read a (gzipped) JSON-lines file, refusing missing files, bad lines and records that do not fit.

    ``required`` is a ``Schema`` (types, shapes, duplicates; see ``SCHEMAS``) or just the field
    names every record must carry. ``fixed``: fields whose value every record must equal.
    """
    schema = required if isinstance(required, Schema) else Schema(str(path), tuple((k, None) for k in required))
    if not path.exists():
        raise DataError(
            f"Missing data file {path} (under {DATA_ENV}). Restore it, or unset {DATA_ENV} to read from the Hub."
        )
    out = _Records(str(path), schema, fixed=fixed)
    lineno = 0
    try:
        raw = path.read_bytes()
        # The checks are a pure function of the bytes: bytes already checked in this process
        # (the tests read the real files many times) are only parsed.
        verdict = (hashlib.sha256(raw).digest(), schema.family, schema.required, tuple(sorted((fixed or {}).items())))
        stream = io.BytesIO(raw)
        text = gzip.open(stream, "rt", encoding="utf-8") if path.suffix == ".gz" else io.TextIOWrapper(stream, "utf-8")
        with text as fh:
            if verdict in _checked:
                return [json.loads(line) for line in fh if line.strip()]
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
                except RecursionError:
                    record = _TOO_DEEP  # nested past Python's recursion limit: refused just below
                if record is _TOO_DEEP or line.count("[") + line.count("{") > MAX_DEPTH and _depth(record) > MAX_DEPTH:
                    raise DataError(f"{path}, line {lineno}: JSON nested more than {MAX_DEPTH} levels deep; "
                                    f"no field of these datasets is. Fix or remove this line.")
                if "\\u" in line and _SURROGATE_ESCAPE.search(line):
                    found = _lone_surrogate(record)
                    if found is not None:
                        raise DataError(
                            f"{path}, line {lineno}, field '{found[0]}': a lone UTF-16 surrogate (a \\ud800-\\udfff "
                            f"escape without its pair) in {_show(found[1])}; it is not text and tokenizers fail "
                            f"on it. Fix the escape or remove this line."
                        )
                out.add(record, lineno)
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:  # truncated or corrupt gzip, not gzip, not UTF-8
        raise DataError(f"{path}: unreadable after line {lineno} ({e}); the file is truncated or damaged, restore it") from None
    records = out.done()
    _checked.add(verdict)
    return records


def check_records(rows: Iterable[dict], family: str, source: str) -> list[dict]:
    """``rows`` (e.g. from the Hub) checked against the schema of ``family``, as local files are."""
    out = _Records(source, SCHEMAS[family], unit="row")
    for i, row in enumerate(rows):
        out.add(row, i)
    return out.done()


def _hub(path: str, name: str | None, split: str, family: str | None = None) -> list[dict]:
    import datasets

    try:
        rows = list(datasets.load_dataset(path, name, split=split))
    except Exception as e:  # offline, gated, renamed...: say what to do instead
        raise DataError(
            f"Could not load {path}" + (f" ({name})" if name else "") + f" split '{split}' from the Hugging Face Hub: "
            f"{type(e).__name__}: {e}. Set {DATA_ENV} to a folder holding a local copy (see shared/data/SOURCES.md)."
        ) from None
    if family is None:
        return rows
    return check_records(rows, family, f"Hugging Face Hub {path}" + (f" ({name})" if name else "") + f" split '{split}'")


def _local_or_hub(rel: str, family: str, hub: tuple[str, str | None, str]) -> list[dict]:
    root = data_dir()
    if root is not None:
        return read_jsonl(root / rel, SCHEMAS[family])
    return _hub(*hub, family=family)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- loaders


def load_truthfulqa_mc() -> list[dict]:
    rows = _local_or_hub("truthfulqa/mc.jsonl.gz", "truthfulqa/mc", ("truthfulqa/truthful_qa", "multiple_choice", "validation"))
    return [{"id": f"tqa-{i}", **r} for i, r in enumerate(rows)]


def load_truthfulqa_gen() -> list[dict]:
    rows = _local_or_hub("truthfulqa/generation.jsonl.gz", "truthfulqa/generation", ("truthfulqa/truthful_qa", "generation", "validation"))
    return [{"id": f"tqa-{i}", **r} for i, r in enumerate(rows)]


def load_bbq(context: str | None = "disambig") -> tuple[list[dict], list[str]]:
    """BBQ records (``context``: "disambig", "ambig" or None for both) and the categories covered.

    Every category present under $MARI_DATA_DIR/bbq is read; the others are fetched from
    the Hub when it is reachable and otherwise skipped with a warning. Results that use
    BBQ must name the returned categories.
    """
    root = data_dir()
    rows: list[dict] = []
    covered: list[str] = []
    for category in BBQ_CATEGORIES:
        local = root / "bbq" / f"{category}.jsonl.gz" if root is not None else None
        if local is not None and local.exists():
            part = read_jsonl(local, SCHEMAS["bbq"], fixed={"category": category})
        else:
            try:
                part = _hub("oskarvanderwal/bbq", category, "test", family="bbq")
            except DataError as e:
                log.warning("BBQ category %s is not available locally or from the Hub; skipped (%s)", category, e)
                continue
        covered.append(category)
        rows.extend(part)
    if not rows:
        raise DataError(f"No BBQ category could be read (looked in {root and root / 'bbq'} and on the Hub)")
    records = []
    seen: set[str] = set()
    for r in rows:
        rid = f"bbq-{r['category']}-{r['example_id']}"
        if rid in seen:  # across Hub configs (a file's records have its category and distinct example_ids)
            raise DataError(f"BBQ: two records have category {r['category']!r} and example_id {r['example_id']}; "
                            f"each record must appear once. Restore the data.")
        seen.add(rid)
        if context is not None and r["context_condition"] != context:
            continue
        records.append({"id": rid, **r})
    return records, covered


def load_sorry_bench() -> list[dict]:
    root = data_dir()
    if root is not None:
        rows = read_jsonl(root / "sorry_bench" / "question.jsonl.gz", SCHEMAS["sorry_bench"])
    else:
        rows = _hub_sorry_bench()
    return [{"id": f"sorry-{r['question_id']}", **r} for r in rows]


def _hub_sorry_bench() -> list[dict]:
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download("sorry-bench/sorry-bench-202406", "question.jsonl", repo_type="dataset")
    except Exception as e:
        raise DataError(
            f"Could not fetch SORRY-Bench (gated dataset sorry-bench/sorry-bench-202406) from the Hub: {e}. "
            f"Accept its terms and log in, or set {DATA_ENV} to a local copy."
        ) from None
    rows = read_jsonl(Path(path), REQUIRED_FIELDS["sorry_bench"])
    base = [r for r in rows if r.get("prompt_style", "base") == "base"]
    return check_records(base, "sorry_bench", f"{path} (its prompt_style 'base' records)")


def load_mmlu(split: str) -> list[dict]:
    rows = _local_or_hub(f"mmlu/{split}.jsonl.gz", "mmlu", ("cais/mmlu", "all", split))
    counters: dict[str, int] = {}
    records = []
    for r in rows:
        n = counters[r["subject"]] = counters.get(r["subject"], -1) + 1
        records.append({"id": f"mmlu-{split}-{r['subject']}-{n}", **r})
    return records


def load_arc(task: str, split: str) -> list[dict]:
    config = ARC_CONFIGS[task]
    return _local_or_hub(f"arc/{config}-{split}.jsonl.gz", "arc", ("allenai/ai2_arc", config, split))


def load_gsm8k(split: str) -> list[dict]:
    rows = _local_or_hub(f"gsm8k/{split}.jsonl.gz", "gsm8k", ("openai/gsm8k", "main", split))
    return [{"id": f"gsm8k-{split}-{i}", **r} for i, r in enumerate(rows)]


# The attribute datasets that are split, and how to load each one.
ATTRIBUTES = {
    "truthfulqa": load_truthfulqa_mc,
    "bbq": lambda: load_bbq("disambig")[0],
    "sorry_bench": load_sorry_bench,
}
ATTRIBUTE_FILES = {
    "truthfulqa": ["truthfulqa/mc.jsonl.gz"],
    "bbq": [f"bbq/{c}.jsonl.gz" for c in BBQ_CATEGORIES],
    "sorry_bench": ["sorry_bench/question.jsonl.gz"],
    "arc_easy": ["arc/ARC-Easy-train.jsonl.gz"],
}


def data_fingerprint(attribute: str) -> dict[str, str]:
    """sha256 of each local file an attribute's split reads (or 'hub' when read from the Hub)."""
    root = data_dir()
    out = {}
    for rel in ATTRIBUTE_FILES[attribute] + ATTRIBUTE_FILES["arc_easy"]:
        out[rel] = file_sha256(root / rel) if root is not None and (root / rel).exists() else "hub"
    return out


# ----------------------------------------------------------------------------- splits

TRUTHFULQA_POOL = 200  # Appendix B: 200 questions sampled uniformly at random
POOL_FRACTION = 0.20  # Appendix B: 20% of the dataset for every other attribute
CTRL_FRACTION, CTRL_MAX = 0.10, 100  # held-out attribute part of D_ctrl ("small", our choice)
CTRL_ARC = 100  # ARC-Easy train questions in D_ctrl (our choice; the paper says "a small subset")


@dataclass
class Splits:
    """Example ids of every split of one attribute dataset, for one seed."""

    dataset: str
    seed: int
    pca: list[str]
    train: list[str]
    ctrl: list[str]  # held-out attribute examples of D_ctrl
    ctrl_arc: list[str]  # ARC-Easy train ids of D_ctrl
    test: list[str]
    notes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Splits":
        return cls(**obj)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def _rng(*parts: object) -> random.Random:
    # Seeding Random with a string hashes it with SHA-512: stable across processes and platforms.
    return random.Random(":".join(map(str, parts)))


def make_splits(dataset: str, seed: int = 0, records: list[dict] | None = None) -> Splits:
    if dataset not in ATTRIBUTES:
        raise ValueError(f"No splits for '{dataset}'; choose one of {sorted(ATTRIBUTES)}")
    ids = [r["id"] for r in (records if records is not None else ATTRIBUTES[dataset]())]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        repeated = sorted({i for i in ids if i in seen or seen.add(i)})
        raise DataError(f"{dataset}: duplicate example ids {repeated[:5]}{' ...' if len(repeated) > 5 else ''}; "
                        f"each example must appear once. Restore the data.")
    order = sorted(ids)
    _rng(dataset, seed).shuffle(order)
    n = len(order)
    n_pool = min(TRUTHFULQA_POOL, n) if dataset == "truthfulqa" else round(POOL_FRACTION * n)
    n_ctrl = min(CTRL_MAX, round(CTRL_FRACTION * n))
    pool, ctrl, test = order[:n_pool], order[n_pool : n_pool + n_ctrl], order[n_pool + n_ctrl :]
    half = n_pool // 2
    arc_ids = sorted(r["id"] for r in load_arc("arc_easy", "train"))
    ctrl_arc = sorted(_rng("arc_easy-ctrl", dataset, seed).sample(arc_ids, CTRL_ARC))
    notes: dict[str, Any] = {"n_total": n}
    if dataset == "bbq":
        notes["bbq_categories"] = sorted({i.split("-")[1] for i in ids})
        notes["bbq_context"] = "disambig"
    # Keep the dataset's canonical order inside every split so that listings read naturally.
    rank = {i: k for k, i in enumerate(ids)}
    by_rank = lambda xs: sorted(xs, key=rank.__getitem__)  # noqa: E731
    return Splits(
        dataset=dataset,
        seed=seed,
        pca=by_rank(pool[:half]),
        train=by_rank(pool[half:]),
        ctrl=by_rank(ctrl),
        ctrl_arc=ctrl_arc,
        test=by_rank(test),
        notes=notes,
    )


def check_recorded_splits(attribute: str, recorded_splits: dict, recorded_files: dict | None) -> None:
    """Refuse when the current data no longer give the splits a bundle was trained on.

    ``recorded_splits`` and ``recorded_files`` are a bundle's ``splits`` and ``data_files``
    (``bundle.json``, written by ``mari-eval train``). Recomputes ``make_splits(attribute,
    recorded seed)`` and ``data_fingerprint(attribute)`` and raises ``DataError`` when the split
    fingerprint or any file's sha256 differs from the recorded one: a held-out test set cut
    from changed data may hold questions the bundle was trained on. The message names both
    fingerprints, each changed file with both hashes, and the fix. ``recorded_files`` None
    (not recorded) skips the file comparison. ``ValueError`` when ``recorded_splits`` is not a
    split of ``attribute`` or lacks its seed or fingerprint.
    """
    dataset, seed, recorded = (recorded_splits.get(k) for k in ("dataset", "seed", "fingerprint"))
    if dataset != attribute:
        raise ValueError(f"the recorded splits are of {dataset!r}, not {attribute!r}")
    if type(seed) is not int or not isinstance(recorded, str):
        raise ValueError(f"the recorded {attribute} splits lack an integer 'seed' and a 'fingerprint' "
                         f"(got seed {seed!r}, fingerprint {recorded!r})")
    current_files = data_fingerprint(attribute)
    changed = []
    if recorded_files is not None:
        for rel in sorted(set(recorded_files) | set(current_files)):
            before, now = recorded_files.get(rel, "not recorded"), current_files.get(rel, "not read now")
            if before != now:
                changed.append(f"{rel} (sha256 recorded {before}, current {now})")
    current = make_splits(attribute, seed).fingerprint()
    if current == recorded and not changed:
        return
    where = data_dir()
    raise DataError(
        f"The bundle was trained on {attribute} splits (seed {seed}) with fingerprint {recorded}; the current "
        f"data ({DATA_ENV}={where if where is not None else '(unset: the Hub)'}) give fingerprint {current}"
        + (" (the same)" if current == recorded else "")
        + (f". Changed files: {'; '.join(changed)}" if changed else "")
        + ". A held-out set cut from these data may hold examples the bundle was trained on, and "
        f"results would not be comparable. Restore the data the bundle was trained on, or retrain the "
        f"bundle on the current data (mari-eval train ... --seed {seed})."
    )
