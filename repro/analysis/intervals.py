"""Uncertainty of a table cell from its per-document scores: intervals and paired tests.

Units and strata. A cell's documents (a question, a prompt; keyed by a document id) sit in
one *stratum* per seed (each seed has its own held-out split). The cell's figure is the mean
over the S strata of the per-stratum mean over documents, as the tables print it. The
sampling *unit* is a document, or for a clustered benchmark a *cluster* of documents: BBQ's
context (``mari_eval.benchmarks.data.bbq_context_key``), which holds two paired questions that share
its text and answers, so they are not independent (issue 36.6). Everything below resamples
or permutes units, never documents of one cluster apart.

Cell interval: the percentile bootstrap (``ITERATIONS`` resamples, seeded by ``SEED``: the same
numbers every run). Within each stratum the units are drawn with replacement; a resample's
stratum mean is (sum of the drawn units' scores) / (number of their documents) (the cluster
bootstrap's ratio estimator; with one document per unit the plain bootstrap), and its
figure the mean over strata.

Paired difference. A row is compared with the reference row (Vanilla) on the documents both
scored: d_i = row_i - reference_i, and the difference is D = (1/S) sum_s (1/n_s) sum_{i in s} d_i.
Two tests, each with the interval that inverts it, so that the interval excludes 0 exactly
when p < ``ALPHA`` (a percentile bootstrap of a 0/1 difference did not: it could exclude 0 at
McNemar p = 0.065):

* ``"mcnemar"``: 0/1 scores (accuracy, refusal; 0/100 in percent), one document per unit and
  strata of equal size (then D = (b - c)/N over all N pairs). McNemar's exact test: given the
  m = b + c discordant pairs (b: row right and reference wrong; c: the reverse), b ~
  Binomial(m, 1/2) under no difference; p = min(1, 2 P(X <= min(b, c))), computed in integers
  (no floor). Interval (issue 55.7): Tango's (1998) score interval of the paired difference,
  unconditional on m: the deltas whose score statistic
  T(delta) = (b - c - N delta) / sqrt(N (2 q(delta) + delta (1 - delta))), with q(delta) the
  restricted maximum-likelihood share of c-type pairs under D = delta, lies within +-1.96
  (``tango_interval``, by bisection: T falls as delta grows). T(0) is McNemar's asymptotic
  statistic (b - c) / sqrt(b + c), so the interval excludes 0 exactly when that test rejects;
  the exact test is more conservative, and where the two disagree (the interval excludes 0,
  the exact p >= 0.05: a one-sided split of few discordant pairs) the exact test decides,
  the difference records ``interval_agrees`` false and the tables mark it "‡". The
  conditional Clopper-Pearson interval of b/m used before (``mcnemar_interval``) ended at the
  point estimate when the discordant pairs all went one way (-3.00 [-3.00, 1.25] for 0 against
  3 of 100; Tango: [-8.45, 0.81]).
* ``"sign-flip"``: every other case (continuous scores such as MC2, clusters, strata of unequal
  sizes). Units u with difference sum d_u over their n_u documents enter the statistic
  T = sum_u w_u d_u (w_u = 1 / (S n_s) in stratum s; T = D). Under no difference each unit's
  difference is as likely negated (the row and reference labels of a pair exchangeable), so
  T* = sum_u e_u w_u d_u with independent random signs e_u = +-1 is T's null distribution
  (Fisher's paired randomisation test, *The Design of Experiments*, 1935, sec. 21). Two-sided
  p = share of sign vectors with |T*| >= |T|: all 2^k of them when there are k <= ``EXACT_UNITS``
  units (exact), else ``PERMUTATIONS`` seeded random ones with p = (1 + count) / (1 + B), a
  valid p-value whose floor 1/(B + 1) ~ 1e-5 is far below Holm's smallest threshold in our
  largest table (0.05 / 91 ~ 5.5e-4). A Monte Carlo p has a standard error, sqrt(p (1 - p) / B):
  a decision it sits within ``STABLE_SE`` of (0.05, or its Holm threshold in the table) is
  drawn again with ten times the sign vectors, up to ``MAX_PERMUTATIONS``
  (``repro.analysis.differences.paired_family``), and the draws are recorded. When no draw is as extreme, p = 1/(B + 1) < 1e-5 is all
  B draws can show (the exact permutation p is below 3/B with 95% confidence, and may be far
  smaller): it is stored with ``p_bound`` true and printed "p<1e-05". Interval: the shifts
  delta that the same test does not reject at ``ALPHA`` when every document's difference is
  moved by delta (unit value d_u - n_u delta; the same sign draws for every delta), its ends
  found by bisection from D; the side of 0 is decided by p itself, so the interval holds 0
  exactly when p >= ALPHA (a test's confidence set: Lehmann & Romano, *Testing Statistical
  Hypotheses*, 2005, sec. 3.5).
  Beyond the range of the unit means n_u^-1 d_u every shifted unit has one sign and p is
  its minimum; with 5 units or fewer that minimum is >= 0.05 and the interval is that range.

A table makes many such tests; ``holm`` gives Holm's (1979) step-down adjustment across them,
so a reader can tell "p < 0.05 once" from "p < 0.05 after correcting for the whole table".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ITERATIONS = 2000  # bootstrap resamples of a cell's interval
PERMUTATIONS = 100_000  # Monte Carlo sign vectors of a sign-flip test beyond EXACT_UNITS units
MAX_PERMUTATIONS = 10_000_000  # ... drawn again, ten times as many each time, while a decision is not stable
STABLE_SE = 3.0  # a Monte Carlo p this many standard errors or more from a threshold decides it
EXACT_UNITS = 20  # up to 2^20 sign vectors: enumerated
LEVEL = 0.95
SEED = 0  # of every bootstrap and permutation draw: the same numbers to the last digit every run
ALPHA = 0.05
_CHUNK = 1_000_000  # sign vectors x bytes of units per chunk of draws (16 bytes each in memory)

# One cell's documents: per seed (stratum), {document id: score}; None marks a document
# without a score (a SORRY-Bench response the judge could not read), left out of the mean.
Documents = list[dict[str, float | None]]
# Their clusters, per stratum {document id: cluster id}; None: every document is its own unit.
Clusters = list[dict[str, str]] | None


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
    test: str  # "mcnemar" or "sign-flip"
    pairs: int  # documents behind the difference (all strata)
    discordant: tuple[int, int] | None = None  # McNemar: (row right and reference wrong, the reverse)
    p_bound: bool = False  # p is the Monte Carlo floor 1/(draws + 1): the exact p is smaller
    units: int = 0  # units the test flips: documents, or clusters (all strata)
    clusters: int | None = None  # clusters behind the difference (None: unclustered)
    draws: int | None = None  # Monte Carlo sign vectors (None: exact)
    interval_agrees: bool = True  # the interval excludes 0 exactly when p < ALPHA (McNemar: Tango's may not)


def _scored(stratum: dict[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in stratum.items() if v is not None and v == v}


def _units(scores: dict[str, float], clusters: dict[str, str] | None) -> tuple[np.ndarray, np.ndarray]:
    """(sum of scores, number of documents) per unit, units in sorted order (of document or
    cluster id: the draws do not depend on the order documents were logged in)."""
    if clusters is None:
        keys = sorted(scores)
        return np.array([scores[k] for k in keys], dtype=float), np.ones(len(keys))
    sums: dict[str, list[float]] = {}
    for doc, score in scores.items():
        if doc not in clusters:
            raise ValueError(f"document {doc!r} has no cluster id")
        sums.setdefault(clusters[doc], []).append(score)
    keys = sorted(sums)
    return np.array([math.fsum(sums[k]) for k in keys]), np.array([len(sums[k]) for k in keys], dtype=float)


def cluster_count(documents: Documents, clusters: Clusters) -> int | None:
    """The clusters holding a scored document, summed over strata (None when unclustered)."""
    if clusters is None:
        return None
    return sum(len({c[k] for k in _scored(s)}) for s, c in zip(documents, clusters))


def interval(documents: Documents, clusters: Clusters = None, seed: int = SEED) -> Interval | None:
    """The 95% (cluster) bootstrap interval of the cell's figure; None without documents."""
    strata = [_units(_scored(s), c) for s, c in zip(documents, clusters or [None] * len(documents))]
    strata = [u for u in strata if u[0].size]
    if not strata:
        return None
    rng = np.random.default_rng(seed)
    per_stratum = []
    for sums, counts in strata:
        drawn = rng.integers(0, sums.size, size=(ITERATIONS, sums.size))
        per_stratum.append(sums[drawn].sum(axis=1) / counts[drawn].sum(axis=1))
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(np.mean(per_stratum, axis=0), [tail, 100 - tail])
    return Interval(float(low), float(high))


def paired(row: Documents, reference: Documents, clusters: Clusters = None, seed: int = SEED,
           draws: int | None = None, unit: float | None = None, continuous: bool = False) -> Difference | None:
    """``row`` minus ``reference`` on the documents both scored, per stratum; None when none are shared.

    Strata pair by position (seed i of the row with seed i of the reference); ``clusters``
    (per stratum {document: cluster}) makes the units clusters (their summed differences);
    ``draws``: Monte Carlo sign vectors (default ``PERMUTATIONS``). The score of a right answer is the
    largest score seen (100 in a percent column, else 1); ``unit`` gives it where every score is 0,
    so that the interval of a column of zeros is in the column's units (None there: 1). ``continuous``:
    the column's scores are not 0/1 outcomes even where these all are 0 or 1 (a KL of exactly 0):
    the sign-flip test, never McNemar's."""
    if len(row) != len(reference):
        raise ValueError(f"{len(row)} seeds against {len(reference)} in the reference row: "
                         "a row and its reference must be scored under the same seeds")
    strata = []  # per stratum: {document: (row score, reference score)}, its clusters
    for i, (mine, theirs) in enumerate(zip(row, reference)):
        mine, theirs = _scored(mine), _scored(theirs)
        shared = {k: (mine[k], theirs[k]) for k in sorted(set(mine) & set(theirs))}
        if shared:
            strata.append((shared, None if clusters is None else clusters[i]))
    if not strata:
        return None
    pairs = sum(len(s) for s, _ in strata)
    mean = float(np.mean([np.mean([a - b for a, b in s.values()]) for s, _ in strata]))
    scores = np.array([v for s, _ in strata for v in s.values()])
    scale = float(np.abs(scores).max()) or unit or 1.0  # a percent column holds 0 and 100; a column of zeros: ``unit``
    binary = not continuous and set(np.unique(scores / scale)) <= {0.0, 1.0}
    if binary and clusters is None and len({len(s) for s, _ in strata}) == 1:
        better = sum(a > b for s, _ in strata for a, b in s.values())
        worse = sum(a < b for s, _ in strata for a, b in s.values())
        low, high = tango_interval(better, worse, pairs)
        p = mcnemar_exact(better, worse)
        return Difference(mean, Interval(scale * low, scale * high), p, "mcnemar", pairs, (better, worse), units=pairs,
                          interval_agrees=(not low <= 0 <= high) == (p < ALPHA))
    values, shifts, means = [], [], []  # per unit: w_u d_u, w_u n_u, d_u / n_u
    for shared, stratum_clusters in strata:
        sums, counts = _units({k: a - b for k, (a, b) in shared.items()}, stratum_clusters)
        weight = 1 / (len(strata) * counts.sum())
        values.append(weight * sums), shifts.append(weight * counts), means.append(sums / counts)
    test = sign_flip(np.concatenate(values), np.concatenate(shifts), np.concatenate(means), seed, draws)
    return Difference(mean, test.interval, test.p, "sign-flip", pairs, None, test.p_bound, test.units,
                      None if clusters is None else test.units, test.draws)


# ----------------------------------------------------------------------------- McNemar, Tango


def mcnemar_exact(better: int, worse: int) -> float:
    """Two-sided exact McNemar p: the binomial(better + worse, 1/2) probability of a split at
    least as uneven as the one seen (1 when no document changed)."""
    n = better + worse
    if n == 0:
        return 1.0
    term = tail = 1  # C(n, i) for i = 0..min(better, worse), summed in integers: exact
    for i in range(min(better, worse)):
        term = term * (n - i) // (i + 1)
        tail += term
    return max(min(1.0, 2 * tail / 2**n), math.ulp(0.0))  # an integer ratio below floats' range: the least


def _boundary(inside: float, outside: float, accepted) -> float:
    """The last point from ``inside`` towards ``outside`` that ``accepted`` holds, by bisection
    (``accepted(inside)`` true, ``accepted(outside)`` false): the end of an interval."""
    for _ in range(64):  # 2^-64 of the bracket: far below any printed digit
        middle = (inside + outside) / 2
        if middle in (inside, outside):
            break
        inside, outside = (middle, outside) if accepted(middle) else (inside, middle)
    return inside


_Z = 1.959963984540054  # the standard normal's 97.5% quantile


def _tango_statistic(better: int, worse: int, n: int, delta: float) -> float:
    """Tango's score statistic of D = delta (module docstring): b = ``better``, c = ``worse`` of n pairs."""
    a, b_coef, c_coef = 2 * n, -better - worse + (2 * n - better + worse) * delta, -worse * delta * (1 - delta)
    q = (math.sqrt(max(b_coef * b_coef - 4 * a * c_coef, 0.0)) - b_coef) / (2 * a)
    variance = n * (2 * q + delta * (1 - delta))
    return (better - worse - n * delta) / math.sqrt(max(variance, 1e-300))


def tango_interval(better: int, worse: int, n: int) -> tuple[float, float]:
    """Tango's (1998) 95% score interval of the paired difference (better - worse) / n, in [-1, 1]
    (Statistics in Medicine 17:891-908): every delta whose score statistic is within +-1.96."""
    if n < 1 or better < 0 or worse < 0 or better + worse > n:
        raise ValueError(f"tango_interval({better}, {worse}, {n}): the discordant pairs must fit in n >= 1 pairs")
    mean = (better - worse) / n
    inside = lambda z: (lambda delta: abs(_tango_statistic(better, worse, n, delta)) <= z)  # noqa: E731
    low = -1.0 if inside(_Z)(-1 + 1e-12) else _boundary(mean, -1 + 1e-12, inside(_Z))
    high = 1.0 if inside(_Z)(1 - 1e-12) else _boundary(mean, 1 - 1e-12, inside(_Z))
    return low, high


# ----------------------------------------------------------------------------- sign-flip test


@dataclass(frozen=True)
class SignFlip:
    p: float
    interval: Interval
    p_bound: bool
    units: int
    draws: int | None  # None: all 2^units sign vectors


_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(float)  # bit j of each byte value


def _flipped(columns: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """sum_u e_u columns[u] for each row of ``codes`` (bit u of the row: e_u = +1, else -1), via
    a 256-entry table per byte of units: 8 units per lookup."""
    k, groups = columns.shape[0], codes.shape[1]
    padded = np.zeros((groups * 8, columns.shape[1]))
    padded[:k] = columns
    tables = np.einsum("bj,gjq->gbq", _BITS, padded.reshape(groups, 8, -1))  # (groups, 256, q)
    chosen = tables[np.arange(groups), codes].sum(axis=1)  # the units whose sign is +1
    return 2 * chosen - columns.sum(axis=0)


def _draws(columns: np.ndarray, seed: int, count: int) -> tuple[np.ndarray, bool]:
    """Every sign vector's flipped sums (k <= EXACT_UNITS: all 2^k, exact) or ``count`` seeded ones."""
    k = columns.shape[0]
    groups = max(1, -(-k // 8))
    chunk = max(1, _CHUNK // groups)
    if k <= EXACT_UNITS:  # sign vector j: the bits of the integer j, byte g holding units 8g..8g+7
        return np.concatenate([_flipped(columns, np.arange(start, min(start + chunk, 2**k), dtype="<u4")
                                        .view(np.uint8).reshape(-1, 4)[:, :groups]) for start in range(0, 2**k, chunk)]), True
    rng, out = np.random.default_rng(seed), []
    for start in range(0, count, chunk):
        codes = rng.integers(0, 256, size=(min(chunk, count - start), groups), dtype=np.uint8)
        out.append(_flipped(columns, codes))
    return np.concatenate(out), False


def sign_flip(values: np.ndarray, shifts: np.ndarray, means: np.ndarray, seed: int = SEED,
              count: int | None = None) -> SignFlip:
    """The paired sign-flip test of T = sum(values) (values[u] = w_u d_u) and the interval inverting it.

    ``shifts[u]`` = w_u n_u (summing to 1): a shift delta of every document's difference moves
    unit u's value by -shifts[u] delta and T by -delta. ``means[u]`` = d_u / n_u bound the
    shifts that can be accepted (see the module docstring)."""
    observed = float(math.fsum(values))
    draws, exact = _draws(np.stack([values, shifts], axis=1), seed, count or PERMUTATIONS)
    total, reach = float(np.abs(values).sum()), float(np.abs(shifts).sum())

    def p_at(delta: float) -> tuple[float, int]:
        statistic = abs(observed - delta)
        tolerance = 1e-9 * (total + abs(delta) * reach)  # the same sum in another order: a tie
        count = int(np.count_nonzero(np.abs(draws[:, 0] - delta * draws[:, 1]) >= statistic - tolerance))
        return (count / len(draws), count) if exact else ((count + 1) / (len(draws) + 1), count)

    p, count = p_at(0.0)
    accepted = lambda delta: p_at(delta)[0] >= ALPHA  # noqa: E731
    low_end, high_end = float(means.min()), float(means.max())
    if observed < 0 and p < ALPHA:
        high = _boundary(observed, 0.0, accepted)
    else:
        start = max(observed, 0.0)
        high = max(high_end, start) if high_end <= start or accepted(high_end) else _boundary(start, high_end, accepted)
    if observed > 0 and p < ALPHA:
        low = _boundary(observed, 0.0, accepted)
    else:
        start = min(observed, 0.0)
        low = min(low_end, start) if low_end >= start or accepted(low_end) else _boundary(start, low_end, accepted)
    return SignFlip(p, Interval(low, high), not exact and count == 0, int(values.size), None if exact else len(draws))


# ----------------------------------------------------------------------------- many tests


def monte_carlo_se(p: float, draws: int | None) -> float:
    """The standard error of a Monte Carlo p from ``draws`` sign vectors (0: exact)."""
    return 0.0 if draws is None else math.sqrt(max(p * (1 - p), 1 / draws) / draws)


def holm_thresholds(ps: list[float]) -> list[float]:
    """The level each of ``ps`` is compared with in Holm's step-down procedure: ALPHA / (m - rank)."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out = [0.0] * len(ps)
    for rank, i in enumerate(order):
        out[i] = ALPHA / (len(ps) - rank)
    return out


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values of ``ps`` (same order), for a family of tests."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted
