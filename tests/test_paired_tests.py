"""The paired tests and their intervals (repro/analysis/intervals.py, issues 36.4, 36.6 and 55.7): McNemar's exact
test with Tango's score interval (which may exclude 0 where the exact test does not reject: marked), the
sign-flip permutation test with the interval that inverts it (excluding 0 exactly when p < 0.05),
clusters as units, and Monte Carlo p values drawn again until a decision is stable."""

import itertools
import math

import numpy as np
import pytest

from repro.analysis import intervals


def docs(values, prefix="d"):
    return {f"{prefix}{i:04d}": float(v) for i, v in enumerate(values)}


def _restricted_q(b, c, n, delta):
    """The maximum-likelihood share of c-type pairs when the paired difference is delta, found numerically:
    maximise b log(q + delta) + c log q + (n - b - c) log(1 - 2q - delta) over the q that keep every cell positive."""
    optimize = pytest.importorskip("scipy.optimize")
    low, high = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12

    def minus_loglik(q):
        return -(b * math.log(q + delta) if b else 0) - (c * math.log(q) if c else 0) - \
            ((n - b - c) * math.log(1 - 2 * q - delta) if n - b - c else 0)
    return optimize.minimize_scalar(minus_loglik, bounds=(low, high), method="bounded", options={"xatol": 1e-13}).x


@pytest.mark.parametrize("b, c, n", [(0, 3, 100), (95, 15, 600), (5, 0, 100), (19, 9, 600), (30, 12, 80), (7, 9, 40)])
def test_tangos_interval_ends_where_the_score_statistic_reaches_1_96(b, c, n):
    low, high = intervals.tango_interval(b, c, n)
    assert low < (b - c) / n < high
    for end in (low, high):
        if abs(end) < 1 - 1e-9:  # an end inside (-1, 1): the score statistic is +-1.96 there
            q = _restricted_q(b, c, n, end)
            statistic = (b - c - n * end) / math.sqrt(n * (2 * q + end * (1 - end)))
            assert abs(statistic) == pytest.approx(1.959963984540054, abs=1e-4)
    # at 0 the score statistic is McNemar's asymptotic one
    assert intervals._tango_statistic(b, c, n, 0.0) == pytest.approx((b - c) / math.sqrt(b + c))


def test_tangos_interval_excludes_zero_exactly_when_the_score_test_rejects():
    cases = [(b, c) for m in range(1, 41) for b in range(m + 1) for c in [m - b]]
    for b, c in cases:
        low, high = intervals.tango_interval(b, c, 100)
        assert (not low <= 0 <= high) == (abs(b - c) / math.sqrt(b + c) > 1.959963984540054), (b, c)
    assert intervals.tango_interval(0, 0, 50)[0] < 0 < intervals.tango_interval(0, 0, 50)[1]
    with pytest.raises(ValueError, match="must fit"):
        intervals.tango_interval(60, 50, 100)


def test_a_one_sided_split_no_longer_ends_at_the_point_estimate():
    # MARI ARC-C under the SORRY-Bench bundle: 0 won, 3 lost of 100 (results/main_table.json)
    reference = [100.0] * 30 + [0.0] * 70
    row = [0.0] * 3 + [100.0] * 27 + [0.0] * 70
    d = intervals.paired([docs(row)], [docs(reference)])
    assert d.test == "mcnemar" and d.discordant == (0, 3) and d.mean == pytest.approx(-3.0)
    assert d.interval.low < -3.0 - 4 and 0 < d.interval.high  # Tango: about [-8.45, 0.81]
    assert d.interval_agrees  # p = 0.25 and the interval holds 0


def test_the_exact_test_decides_where_the_score_interval_excludes_zero():
    reference, row = [0.0] * 100, [100.0] * 5 + [0.0] * 95  # 5 won, 0 lost: exact p = 0.0625
    d = intervals.paired([docs(row)], [docs(reference)])
    assert d.p == pytest.approx(0.0625) and d.interval.low > 0 and not d.interval_agrees


def test_paired_accuracy_maps_tangos_interval_to_the_difference_in_the_scores_units():
    rng = np.random.default_rng(3)
    reference = (rng.random(300) < 0.5).astype(float)
    row = np.where(rng.random(300) < 0.15, 1 - reference, reference)  # 15% of answers change, either way
    row[:12] = 1.0
    d = intervals.paired([docs(100 * row)], [docs(100 * reference)])
    better, worse = d.discordant
    low, high = intervals.tango_interval(better, worse, 300)
    assert d.test == "mcnemar" and d.units == 300 and d.clusters is None and not d.p_bound
    assert d.mean == pytest.approx(100 * (better - worse) / 300)
    assert (d.interval.low, d.interval.high) == pytest.approx((100 * low, 100 * high))
    assert d.interval_agrees == ((not d.interval.low <= 0 <= d.interval.high) == (d.p < 0.05))


def test_a_monte_carlo_decision_near_its_holm_line_is_drawn_again_until_stable(monkeypatch):
    from repro.analysis import differences

    monkeypatch.setattr(intervals, "PERMUTATIONS", 2000)
    monkeypatch.setattr(intervals, "MAX_PERMUTATIONS", 200_000)
    rng = np.random.default_rng(5)
    base = {f"d{i:03d}": float(v) for i, v in enumerate(rng.random(60))}
    rows = {"Ref": {"x": {"values": [0.5], "documents": [base]}}}
    for shift, name in ((0.0, "A"), (0.026, "B"), (0.3, "C")):  # B's p sits near 0.05
        noisy = {k: v + shift + 0.1 * rng.standard_normal() for k, v in base.items()}
        rows[name] = {"x": {"values": [0.5], "documents": [noisy]}}
    found = differences.reference_differences(rows, ["x"], "Ref")
    lines = intervals.holm_thresholds([d["p"] for d in found.values()])
    for (label, _), d, line in zip(found, found.values(), lines):
        if d["draws"] is None or d["p_bound"]:
            continue
        se = intervals.monte_carlo_se(d["p"], d["draws"])
        stable = min(abs(d["p"] - line), abs(d["p"] - 0.05)) >= intervals.STABLE_SE * se
        assert stable or d["draws"] == intervals.MAX_PERMUTATIONS, (label, d)
        assert d["p_mc_se"] == pytest.approx(se)
    assert max(d["draws"] or 0 for d in found.values()) > 2000  # at least one was drawn again


def test_the_exact_sign_flip_test_of_zero_one_differences_is_mcnemars_test():
    for better, worse in [(5, 0), (9, 3), (4, 4), (12, 2), (0, 1)]:
        diffs = np.array([1.0] * better + [-1.0] * worse + [0.0] * 3)
        n = diffs.size
        test = intervals.sign_flip(diffs / n, np.full(n, 1 / n), diffs)
        assert test.draws is None and not test.p_bound
        assert test.p == pytest.approx(intervals.mcnemar_exact(better, worse), rel=1e-12)


def test_the_exact_sign_flip_p_counts_every_sign_vector():
    rng = np.random.default_rng(7)
    values, shifts = rng.normal(0.3, 1, 9) / 9, np.full(9, 1 / 9)
    observed = abs(values.sum())
    count = sum(abs(np.dot(signs, values)) >= observed - 1e-12 for signs in itertools.product([-1, 1], repeat=9))
    test = intervals.sign_flip(values, shifts, values * 9)
    assert test.p == pytest.approx(count / 2**9) and test.draws is None


def test_a_strong_shift_gets_the_monte_carlo_floor_as_a_bound_far_below_holms_thresholds():
    rng = np.random.default_rng(0)
    base = rng.random(150)
    d = intervals.paired([docs(base + 0.2 + 0.02 * rng.standard_normal(150))], [docs(base)])
    assert d.p_bound and d.draws == intervals.PERMUTATIONS
    assert d.p == pytest.approx(1 / (intervals.PERMUTATIONS + 1)) and d.p < 1e-5
    assert max(intervals.holm([d.p] * 65)) < 0.05 / 60  # the largest table's smallest Holm threshold


@pytest.mark.parametrize("seed", range(12))
def test_the_sign_flip_interval_inverts_the_test(monkeypatch, seed):
    monkeypatch.setattr(intervals, "PERMUTATIONS", 4000)  # a faster test; the same construction
    rng = np.random.default_rng(seed)
    n = int(rng.integers(25, 80))
    base = rng.random(n)
    shift = rng.choice([0.0, 0.01, 0.02, 0.04])
    d = intervals.paired([docs(base + shift + 0.06 * rng.standard_normal(n))], [docs(base)])
    assert d.test == "sign-flip" and d.interval.low <= d.mean <= d.interval.high
    assert (not d.interval.low <= 0 <= d.interval.high) == (d.p < intervals.ALPHA)


def test_the_sign_flip_interval_ends_where_the_shifted_test_starts_to_reject(monkeypatch):
    monkeypatch.setattr(intervals, "PERMUTATIONS", 4000)
    rng = np.random.default_rng(21)
    diffs = rng.normal(0.1, 0.5, 60)
    values, shifts = diffs / 60, np.full(60, 1 / 60)
    test = intervals.sign_flip(values, shifts, diffs)
    width = test.interval.high - test.interval.low
    p_at = lambda delta: intervals.sign_flip(values - shifts * delta, shifts, diffs - delta).p  # noqa: E731
    for end, outwards in ((test.interval.low, -1), (test.interval.high, 1)):
        assert p_at(end - outwards * 1e-6 * width) >= intervals.ALPHA
        assert p_at(end + outwards * 1e-3 * width) < intervals.ALPHA


def test_the_sign_flip_interval_is_close_to_the_t_interval_on_normal_data():
    rng = np.random.default_rng(11)
    diffs = rng.normal(0.05, 0.2, 400)
    d = intervals.paired([docs(diffs)], [docs(np.zeros(400))])
    half = 1.96 * diffs.std(ddof=1) / math.sqrt(400)
    assert d.interval.low == pytest.approx(diffs.mean() - half, abs=0.1 * half)
    assert d.interval.high == pytest.approx(diffs.mean() + half, abs=0.1 * half)


def test_strata_of_unequal_size_weigh_each_seed_equally():
    first, second = (np.arange(40) % 3 == 0).astype(float), (np.arange(10) % 2 == 0).astype(float)
    row = [docs(np.ones(40)), docs(np.ones(10))]
    d = intervals.paired(row, [docs(first), docs(second)])
    assert d.test == "sign-flip"  # 0/1 scores, but a pooled McNemar would weigh documents, not seeds
    assert d.mean == pytest.approx(((1 - first).mean() + (1 - second).mean()) / 2)
    assert d.interval.low <= d.mean <= d.interval.high and d.units == 50
    equal = intervals.paired([docs(np.ones(40)), docs(np.ones(40))], [docs(first), docs(first[::-1])])
    assert equal.test == "mcnemar" and equal.mean == pytest.approx(equal.discordant[0] / 80)


def context_pairs(values):
    """Each value twice, the two documents of one context: (documents, clusters)."""
    documents = {f"q{i:04d}{side}": float(v) for i, v in enumerate(values) for side in "ab"}
    return documents, {doc: f"c{doc[1:5]}" for doc in documents}


def test_a_cluster_bootstrap_of_identical_pairs_is_the_bootstrap_of_one_per_pair():
    values = (np.random.default_rng(2).random(120) < 0.4).astype(float)
    documents, clusters = context_pairs(values)
    assert intervals.interval([documents], [clusters]) == pytest.approx(intervals.interval([docs(values)]))
    naive = intervals.interval([documents])  # pairs taken for independent questions: too narrow
    clustered = intervals.interval([documents], [clusters])
    assert (naive.high - naive.low) < 0.85 * (clustered.high - clustered.low)
    assert intervals.cluster_count([documents], [clusters]) == 120
    singletons = {doc: doc for doc in documents}  # each document its own cluster: the plain bootstrap
    assert intervals.interval([documents], [singletons]) == pytest.approx(intervals.interval([documents]))


def test_a_clustered_paired_test_flips_contexts():
    rng = np.random.default_rng(5)
    reference = (rng.random(60) < 0.5).astype(float)
    row = np.where(rng.random(60) < 0.3, 1.0, reference)
    mine, clusters = context_pairs(row)
    theirs, _ = context_pairs(reference)
    d = intervals.paired([mine], [theirs], [clusters])
    assert d.test == "sign-flip" and d.units == 60 and d.clusters == 60 and d.pairs == 120
    one_per_context = intervals.paired([docs(row)], [docs(reference)])  # the same units, one document each
    assert d.mean == pytest.approx(one_per_context.mean)
    flipped = intervals.sign_flip((row - reference) / 60, np.full(60, 1 / 60), row - reference)
    assert d.p == pytest.approx(flipped.p) and d.interval.low == pytest.approx(flipped.interval.low)
    assert (not d.interval.low <= 0 <= d.interval.high) == (d.p < intervals.ALPHA)
    naive = intervals.paired([mine], [theirs])  # 120 independent questions: McNemar on twice the evidence
    assert naive.test == "mcnemar" and naive.p < d.p


def test_a_document_without_a_cluster_is_refused():
    with pytest.raises(ValueError, match="no cluster id"):
        intervals.interval([{"a": 1.0, "b": 0.0}], [{"a": "c1"}])


def test_a_column_of_zeros_gets_its_interval_in_the_columns_units():
    """GSM8K at 0 of 20 in every row: no discordant pair, and Tango's interval still has a width, in percent
    for a percent column (the unit the table passes), not in the units of a score never seen."""
    from repro.analysis import differences

    zeros = [docs([0.0] * 20)]
    low, high = intervals.tango_interval(0, 0, 20)
    assert intervals.paired(zeros, zeros, unit=100.0).interval == intervals.Interval(100 * low, 100 * high)
    assert intervals.paired(zeros, zeros).interval == intervals.Interval(low, high)  # unknown: a fraction
    rows = {"Vanilla": {"gsm8k": {"values": [0.0], "documents": zeros}}, "MARI": {"gsm8k": {"values": [0.0], "documents": zeros}}}
    found = differences.reference_differences(rows, ["gsm8k"], "Vanilla")[("MARI", "gsm8k")]
    assert found["ci"] == pytest.approx([100 * low, 100 * high]) and 16 < found["ci"][1] < 16.2
