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
import json
import logging
import os
import random
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

# Fields every record must carry, per local file family (the HF schemas).
REQUIRED_FIELDS = {
    "truthfulqa/mc": ("question", "mc1_targets", "mc2_targets"),
    "truthfulqa/generation": ("question", "best_answer", "correct_answers", "incorrect_answers", "category"),
    "bbq": ("example_id", "question_polarity", "context_condition", "category", "answer_info",
            "additional_metadata", "context", "question", "ans0", "ans1", "ans2", "label"),
    "sorry_bench": ("question_id", "category", "turns"),
    "mmlu": ("question", "subject", "choices", "answer"),
    "arc": ("id", "question", "choices", "answerKey"),
    "gsm8k": ("question", "answer"),
}


class DataError(RuntimeError):
    """A dataset could not be read: the message names the file or source and the fix."""


# ----------------------------------------------------------------------------- sources


def data_dir() -> Path | None:
    value = os.environ.get(DATA_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise DataError(f"{DATA_ENV}={value} is not a directory; point it at a folder laid out like shared/data")
    return path


def read_jsonl(path: Path, required: Iterable[str]) -> list[dict]:
    """Read a (gzipped) JSON-lines file, refusing missing files, bad lines and wrong schemas."""
    required = tuple(required)
    if not path.exists():
        raise DataError(
            f"Missing data file {path} (under {DATA_ENV}). Restore it, or unset {DATA_ENV} to read from the Hub."
        )
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, line {lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}, line {lineno}: expected a JSON object with fields {list(required)}")
                missing = [k for k in required if k not in record]
                if missing:
                    raise DataError(
                        f"{path}, line {lineno}: missing field(s) {missing}; expected fields {list(required)}"
                    )
                records.append(record)
    except (EOFError, OSError, UnicodeDecodeError) as e:  # truncated gzip, not gzip, not UTF-8: never a partial set
        raise DataError(f"{path}: unreadable after line {lineno} ({e}); the file is truncated or damaged, restore it") from None
    if not records:
        raise DataError(f"{path} holds no records")
    return records


def _hub(path: str, name: str | None, split: str) -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(path, name, split=split))
    except Exception as e:  # offline, gated, renamed...: say what to do instead
        raise DataError(
            f"Could not load {path}" + (f" ({name})" if name else "") + f" split '{split}' from the Hugging Face Hub: "
            f"{type(e).__name__}: {e}. Set {DATA_ENV} to a folder holding a local copy (see shared/data/SOURCES.md)."
        ) from None


def _local_or_hub(rel: str, family: str, hub: tuple[str, str | None, str]) -> list[dict]:
    root = data_dir()
    if root is not None:
        return read_jsonl(root / rel, REQUIRED_FIELDS[family])
    return _hub(*hub)


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
            part = read_jsonl(local, REQUIRED_FIELDS["bbq"])
        else:
            try:
                part = _hub("oskarvanderwal/bbq", category, "test")
            except DataError as e:
                log.warning("BBQ category %s is not available locally or from the Hub; skipped (%s)", category, e)
                continue
        covered.append(category)
        rows.extend(part)
    if not rows:
        raise DataError(f"No BBQ category could be read (looked in {root and root / 'bbq'} and on the Hub)")
    records = []
    for r in rows:
        if context is not None and r["context_condition"] != context:
            continue
        records.append({"id": f"bbq-{r['category']}-{r['example_id']}", **r})
    return records, covered


def load_sorry_bench() -> list[dict]:
    root = data_dir()
    if root is not None:
        rows = read_jsonl(root / "sorry_bench" / "question.jsonl.gz", REQUIRED_FIELDS["sorry_bench"])
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
    return [r for r in rows if r.get("prompt_style", "base") == "base"]


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
        raise DataError(f"{dataset}: duplicate example ids; the local copy is corrupt")
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
