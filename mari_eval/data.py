"""Benchmark loading and the paper's data splits (Appendix B).

Every loader returns a list of records in the Hugging Face schema of the dataset,
each with an added stable ``id``: the dataset's own id where it has one (BBQ, SORRY-Bench,
ARC), otherwise one derived from the record's content (``content_id``), so that no id moves
when a line is added to or removed from a file. Records come from the local copy under
``$MARI_DATA_DIR`` when that variable is set (layout of ``shared/data``: see
``ATTRIBUTE_FILES`` and the loaders), otherwise from the Hugging Face Hub, and are checked
against the schema of its family first (``data_schema.py``: types, shapes, duplicates; a bad
record raises ``DataError`` naming the file, line and field).

Splits (``make_splits``) are a pure function of (dataset, seed):

* a training pool (TruthfulQA: 200 questions sampled uniformly at random; other
  attributes: 20% of the examples), halved into D_pca (question text only, for the
  PCA basis of the energy gate) and D_train (adapter and probe training);
* D_ctrl: held-out attribute examples (10%, at most 100) plus general-capability controls,
  rendered at training as their test tasks are evaluated (``mari_eval.examples``): a seeded
  100 of the ARC-Easy *train* questions after the first 25 (which are every ARC question's
  25 shots) and a seeded 100 of the MMLU *validation* questions (whose 5 shots are their
  subject's dev questions); disjoint from D_pca and D_train and from every reported test set;
* the test split: every remaining attribute example.

The units (an example; for BBQ a context, ``bbq_context_key``: its two paired questions go
to one split) are ordered by sha256("dataset:seed:unit") and cut in that order where the
examples add up closest to the sizes above: a uniformly random order that an added or
removed unit does not reshuffle (each other unit keeps its rank), so a changed file moves a
few examples across a boundary at most; a bundle trained on other splits is refused anyway
(``check_recorded_splits``). ``check_bbq_contexts`` refuses a BBQ held-out set sharing a
context with D_pca, D_train or D_ctrl.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

# The record schemas and their checks (data_schema.py); the names below are also read as data.X.
from .data_schema import (  # noqa: F401
    BBQ_CATEGORIES,
    BBQ_UNKNOWN_RESPONSES,
    MAX_DEPTH,
    REQUIRED_FIELDS,
    SCHEMAS,
    SORRY_BENCH_CATEGORIES,
    DataError,
    Records,
    Schema,
    check_records,
)

log = logging.getLogger(__name__)

DATA_ENV = "MARI_DATA_DIR"
ARC_CONFIGS = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}

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
    out = Records(str(path), schema, fixed=fixed)
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
                if line.strip():
                    out.add_line(line, lineno)
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:  # truncated or corrupt gzip, not gzip, not UTF-8
        raise DataError(f"{path}: unreadable after line {lineno} ({e}); the file is truncated or damaged, restore it") from None
    records = out.done()
    _checked.add(verdict)
    return records


_checked: set[tuple] = set()  # (sha256 of a file's bytes, schema, fixed fields) that read_jsonl accepted


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


def content_id(prefix: str, *content: object) -> str:
    """``prefix-`` and 12 hex digits of the sha256 of ``content`` (as JSON, runs of whitespace in
    its strings read as one space): an id that names the example, not its line, so that it stays
    put when other lines are added or removed. (TruthfulQA's two published files differ in one
    question by a trailing space; it keeps one id.)"""
    def norm(x: object) -> object:
        return " ".join(x.split()) if isinstance(x, str) else [norm(v) for v in x] if isinstance(x, (list, tuple)) else x
    digest = hashlib.sha256(json.dumps(norm(content), ensure_ascii=False).encode("utf-8")).hexdigest()
    return f"{prefix}-{digest[:12]}"


def _with_content_ids(rows: list[dict], id_of) -> list[dict]:
    """``rows`` with ``id = id_of(row)``; a repeated record (MMLU publishes 28, kept on purpose,
    see data_schema) gets ``-r2``, ``-r3``... after the first, in file order."""
    count: dict[str, int] = {}
    out = []
    for r in rows:
        rid = id_of(r)
        n = count[rid] = count.get(rid, 0) + 1
        out.append({"id": rid if n == 1 else f"{rid}-r{n}", **r})
    return out


def load_truthfulqa_mc() -> list[dict]:
    rows = _local_or_hub("truthfulqa/mc.jsonl.gz", "truthfulqa/mc", ("truthfulqa/truthful_qa", "multiple_choice", "validation"))
    return _with_content_ids(rows, lambda r: content_id("tqa", r["question"]))


def load_truthfulqa_gen() -> list[dict]:
    """TruthfulQA's generation config; a question has the same id here as in ``load_truthfulqa_mc``
    (the two published files list the questions in different orders)."""
    rows = _local_or_hub("truthfulqa/generation.jsonl.gz", "truthfulqa/generation", ("truthfulqa/truthful_qa", "generation", "validation"))
    return _with_content_ids(rows, lambda r: content_id("tqa", r["question"]))


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


def bbq_context_key(record: dict) -> str:
    """The BBQ context a record belongs to: its category, template (``question_index``) and
    context text. The paired questions of one context (negative and non-negative polarity)
    share it, so they are one sampling unit: splits keep a context on one side, and intervals
    and paired tests resample contexts, not questions (issue 36.4)."""
    return f"{record['category']}|{record['question_index']}|{record['context']}"


def bbq_template_key(record: dict) -> str:
    """The BBQ template (category and ``question_index``) a record was generated from."""
    return f"{record['category']}|{record['question_index']}"


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
    return _with_content_ids(rows, lambda r: content_id(f"mmlu-{split}-{r['subject']}", r["question"], r["choices"], r["answer"]))


def load_arc(task: str, split: str) -> list[dict]:
    config = ARC_CONFIGS[task]
    return _local_or_hub(f"arc/{config}-{split}.jsonl.gz", "arc", ("allenai/ai2_arc", config, split))


def load_gsm8k(split: str) -> list[dict]:
    rows = _local_or_hub(f"gsm8k/{split}.jsonl.gz", "gsm8k", ("openai/gsm8k", "main", split))
    return _with_content_ids(rows, lambda r: content_id(f"gsm8k-{split}", r["question"]))


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
    "mmlu": ["mmlu/validation.jsonl.gz"],
}


def data_fingerprint(attribute: str) -> dict[str, str]:
    """sha256 of each local file an attribute's split reads (or 'hub' when read from the Hub)."""
    root = data_dir()
    out = {}
    for rel in ATTRIBUTE_FILES[attribute] + ATTRIBUTE_FILES["arc_easy"] + ATTRIBUTE_FILES["mmlu"]:
        out[rel] = file_sha256(root / rel) if root is not None and (root / rel).exists() else "hub"
    return out


# ----------------------------------------------------------------------------- splits

TRUTHFULQA_POOL = 200  # Appendix B: 200 questions sampled uniformly at random
POOL_FRACTION = 0.20  # Appendix B: 20% of the dataset for every other attribute
CTRL_FRACTION, CTRL_MAX = 0.10, 100  # held-out attribute part of D_ctrl ("small", our choice)
CTRL_ARC = 100  # ARC-Easy train questions in D_ctrl (our choice; the paper says "a small subset")
ARC_CTRL_SHOTS = 25  # the ARC controls' shots: the first 25 train questions, as arc_*_first25 (kept out of D_ctrl)
CTRL_MMLU = 100  # MMLU validation questions in D_ctrl (our choice; issue 36.3)
MMLU_CTRL_SHOTS = 5  # the MMLU controls' shots: their subject's 5 dev questions, as mmlu_<subject>


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
    ctrl_mmlu: list[str] = field(default_factory=list)  # MMLU validation ids of D_ctrl
    notes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Splits":
        return cls(**obj)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def seeded_order(ids: Iterable[str], *salt: object) -> list[str]:
    """``ids`` in the order of sha256("salt:...:id"): uniformly random for a given salt, the same
    in every process and platform, and each id's rank relative to the others does not depend
    on which other ids are present (an added or removed example reshuffles nothing)."""
    prefix = "".join(f"{part}:" for part in salt)
    return sorted(ids, key=lambda i: hashlib.sha256(f"{prefix}{i}".encode("utf-8")).digest())




def _cut(sizes: list[int], target: int) -> int:
    """How many leading units (of ``sizes`` examples each) add up closest to ``target`` examples (a tie: fewer)."""
    total, best = 0, (abs(target), 0)
    for k, size in enumerate(sizes, start=1):
        total += size
        best = min(best, (abs(total - target), k))
        if total >= target:
            break
    return best[1]


def make_splits(dataset: str, seed: int = 0, records: list[dict] | None = None) -> Splits:
    if dataset not in ATTRIBUTES:
        raise ValueError(f"No splits for '{dataset}'; choose one of {sorted(ATTRIBUTES)}")
    records = records if records is not None else ATTRIBUTES[dataset]()
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        repeated = sorted({i for i in ids if i in seen or seen.add(i)})
        raise DataError(f"{dataset}: duplicate example ids {repeated[:5]}{' ...' if len(repeated) > 5 else ''}; "
                        f"each example must appear once. Restore the data.")
    # The unit ordered and cut: an example, or a BBQ context with its paired questions (issue 36.4).
    members: dict[str, list[str]] = {}
    for r in records:
        members.setdefault(bbq_context_key(r) if dataset == "bbq" else r["id"], []).append(r["id"])
    units = seeded_order(members, dataset, "context", seed) if dataset == "bbq" else seeded_order(ids, dataset, seed)
    sizes = [len(members[u]) for u in units]
    n = len(ids)
    n_pool = min(TRUTHFULQA_POOL, n) if dataset == "truthfulqa" else round(POOL_FRACTION * n)
    n_ctrl = min(CTRL_MAX, round(CTRL_FRACTION * n))
    pool_end = _cut(sizes, n_pool)
    half, ctrl_end = _cut(sizes, sum(sizes[:pool_end]) // 2), _cut(sizes, sum(sizes[:pool_end]) + n_ctrl)
    bounds = {"pca": (0, half), "train": (half, pool_end), "ctrl": (pool_end, ctrl_end), "test": (ctrl_end, len(units))}
    arc_ids = [r["id"] for r in load_arc("arc_easy", "train")][ARC_CTRL_SHOTS:]  # not the shots themselves
    ctrl_arc = sorted(seeded_order(arc_ids, "arc_easy-ctrl", dataset, seed)[:CTRL_ARC])
    mmlu_ids = [r["id"] for r in load_mmlu("validation")]
    ctrl_mmlu = sorted(seeded_order(mmlu_ids, "mmlu-ctrl", dataset, seed)[:CTRL_MMLU])
    notes: dict[str, Any] = {"n_total": n}
    if dataset == "bbq":
        notes.update(bbq_categories=sorted({i.split("-")[1] for i in ids}), bbq_context="disambig",
                     unit="context", contexts={name: b - a for name, (a, b) in bounds.items()})
    # Keep the dataset's canonical order inside every split so that listings read naturally.
    rank = {i: k for k, i in enumerate(ids)}
    part = {name: sorted((i for u in units[a:b] for i in members[u]), key=rank.__getitem__)
            for name, (a, b) in bounds.items()}
    splits = Splits(dataset=dataset, seed=seed, ctrl_arc=ctrl_arc, ctrl_mmlu=ctrl_mmlu, notes=notes, **part)
    if dataset == "bbq":
        check_bbq_contexts(splits, records)
    return splits


def check_bbq_contexts(splits: Splits, records: Iterable[dict], heldout: Iterable[str] | None = None) -> None:
    """``DataError`` when a held-out BBQ id (``heldout``, default ``splits.test``; ``records`` hold
    them all) shares its context (``bbq_context_key``) with D_pca, D_train or D_ctrl."""
    key = {r["id"]: bbq_context_key(r) for r in records}
    used = [i for name in ("pca", "train", "ctrl") for i in getattr(splits, name)]
    heldout = list(splits.test if heldout is None else heldout)
    if unknown := [i for i in used + heldout if i not in key]:
        raise DataError(f"BBQ split (seed {splits.seed}): {len(unknown)} id(s) not among the records, e.g. {unknown[:3]}; "
                        f"the data changed since the split was made: recompute it (make_splits)")
    trained = {key[i] for i in used}
    if shared := [i for i in heldout if key[i] in trained]:
        raise DataError(
            f"BBQ split (seed {splits.seed}, fingerprint {splits.fingerprint()}): {len(shared)} held-out example(s) in "
            f"{len({key[i] for i in shared})} context(s) share their context with a pca/train/ctrl example (e.g. "
            f"{shared[:3]}), whose paired question was trained on. A split cut per example (before issue 36.4) or "
            f"edited by hand does this: recompute it with mari_eval.data.make_splits('bbq', {splits.seed}), which "
            f"keeps each context on one side, and retrain the bundles trained on the old split.")


def check_recorded_splits(attribute: str, recorded_splits: dict, recorded_files: dict | None) -> None:
    """Refuse (``DataError`` naming both fingerprints, each changed file's hashes and the fix) when
    ``make_splits(attribute, recorded seed)`` or ``data_fingerprint(attribute)`` differ from a
    bundle's recorded ``splits`` and ``data_files`` (``bundle.json``; ``recorded_files`` None skips
    the files): a held-out set cut from changed data may hold questions the bundle was trained on.
    ``ValueError`` when ``recorded_splits`` is not of ``attribute`` or lacks its seed or fingerprint."""
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
