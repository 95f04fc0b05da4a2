"""Uncertainty of a table cell from its per-document scores: bootstrap intervals and paired tests.

A cell's documents are the units of its benchmark (a question, a prompt), keyed by a
document id, in one *stratum* per seed (each seed has its own held-out split). The cell's
figure is the mean over seeds of the per-seed mean over documents, as the tables print it;
the bootstrap resamples documents within each stratum and recomputes that figure
(percentile interval, ``ITERATIONS`` resamples, seeded: the same numbers every run).

A method's row is compared with the reference row (Vanilla) on the documents both scored,
so every difference is paired: the bootstrap resamples the per-document differences. The
test is McNemar's exact test when every score is 0 or 1 (accuracy, refusal: two-sided
binomial test on the discordant documents), else the paired bootstrap's two-sided p
(the share of resampled mean differences on the far side of zero, doubled). A table makes
many such tests; ``holm`` gives Holm's step-down adjustment across them, so a reader can
tell "p < 0.05 once" from "p < 0.05 after correcting for the whole table".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ITERATIONS = 2000
LEVEL = 0.95
SEED = 0  # of every bootstrap: intervals are reproducible to the last digit
ALPHA = 0.05

# One cell's documents: per seed (stratum), {document id: score}; None marks a document
# without a score (a SORRY-Bench response the judge could not read), left out of the mean.
Documents = list[dict[str, float | None]]


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


@dataclass(frozen=True)
class Difference:
    """A row minus the reference row on the documents both scored."""

    mean: float
    interval: Interval
    p: float
    test: str  # "mcnemar" or "bootstrap"
    pairs: int  # documents behind the difference (all strata)
    discordant: tuple[int, int] | None = None  # McNemar: (row right and reference wrong, the reverse)


def _scored(stratum: dict[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in stratum.items() if v is not None and v == v}


def _strata_arrays(documents: Documents) -> list[np.ndarray]:
    arrays = [np.array(list(_scored(s).values()), dtype=float) for s in documents]
    return [a for a in arrays if a.size]


def _bootstrap_means(arrays: list[np.ndarray], seed: int) -> np.ndarray:
    """ITERATIONS resampled figures: the mean over strata of each stratum's resampled mean."""
    rng = np.random.default_rng(seed)
    per_stratum = [a[rng.integers(0, a.size, size=(ITERATIONS, a.size))].mean(axis=1) for a in arrays]
    return np.mean(per_stratum, axis=0)


def _percentile(resampled: np.ndarray) -> Interval:
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return Interval(float(low), float(high))


def interval(documents: Documents, seed: int = SEED) -> Interval | None:
    """The 95% bootstrap interval of the cell's figure; None without documents."""
    arrays = _strata_arrays(documents)
    if not arrays:
        return None
    return _percentile(_bootstrap_means(arrays, seed))


def paired(row: Documents, reference: Documents, seed: int = SEED) -> Difference | None:
    """``row`` minus ``reference`` on the documents both scored, per stratum; None when none are shared.

    Strata pair by position (seed i of the row with seed i of the reference)."""
    if len(row) != len(reference):
        raise ValueError(f"{len(row)} seeds against {len(reference)} in the reference row: "
                         "a row and its reference must be scored under the same seeds")
    rows, refs = [], []
    for mine, theirs in zip(row, reference):
        mine, theirs = _scored(mine), _scored(theirs)
        shared = sorted(set(mine) & set(theirs))
        if shared:
            rows.append(np.array([mine[k] for k in shared]))
            refs.append(np.array([theirs[k] for k in shared]))
    if not rows:
        return None
    diffs = [a - b for a, b in zip(rows, refs)]
    mean = float(np.mean([d.mean() for d in diffs]))
    resampled = _bootstrap_means(diffs, seed)
    pairs = sum(d.size for d in diffs)
    a, b = np.concatenate(rows), np.concatenate(refs)
    scale = max(float(np.abs(np.concatenate([a, b])).max()), 1e-12)  # a percent column holds 0 and 100
    if set(np.unique(np.concatenate([a, b]) / scale)) <= {0.0, 1.0}:
        better, worse = int(np.sum((a > b))), int(np.sum((a < b)))
        return Difference(mean, _percentile(resampled), mcnemar_exact(better, worse), "mcnemar", pairs, (better, worse))
    far = min(np.mean(resampled <= 0), np.mean(resampled >= 0))
    p = min(1.0, 2 * (far * ITERATIONS + 1) / (ITERATIONS + 1))
    if np.all(np.concatenate(diffs) == 0):
        p = 1.0
    return Difference(mean, _percentile(resampled), float(p), "bootstrap", pairs)


def mcnemar_exact(better: int, worse: int) -> float:
    """Two-sided exact McNemar p: the binomial(better + worse, 1/2) probability of a split at
    least as uneven as the one seen (1 when no document changed)."""
    n = better + worse
    if n == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values of ``ps`` (same order), for a family of tests."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted
