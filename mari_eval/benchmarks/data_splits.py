"""The paper's data splits (Appendix B) of the attribute datasets, read through ``mari_eval.benchmarks.data``.

Splits (``make_splits``) are a pure function of (dataset, seed):

* a training pool (TruthfulQA: 200 questions sampled uniformly at random; other
  attributes: 20% of the examples), halved into D_pca (question text only, for the
  PCA basis of the energy gate) and D_train (adapter and probe training);
* D_ctrl: held-out attribute examples (10%, at most 100) plus general-capability controls,
  rendered at training as their test tasks are evaluated (``mari_eval.training.examples``): a seeded
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

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from mari_eval.benchmarks.data import (BBQ_CATEGORIES, DATA_ENV, DataError, bbq_context_key, data_dir, load_arc, load_bbq,
                                       load_mmlu, load_sorry_bench, load_truthfulqa_mc)
from mari_eval.storage.files import file_sha256


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
            f"edited by hand does this: recompute it with mari_eval.benchmarks.data_splits.make_splits('bbq', {splits.seed}), which "
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
