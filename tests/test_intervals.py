"""Intervals and paired tests of the tables (repro/analysis/intervals.py), per-document scores
(repro/engine/documents.py) and how the tables carry them (repro/analysis/tables.py)."""

import json
import math

import numpy as np
import pytest
from scipy import stats

from mari_eval.injection.devices import Placement
from repro.analysis import intervals, tables
from repro.engine.cache import Store
from repro.engine.documents import check_against, document_scores
from repro.engine.profiles import Profile


def as_docs(values, prefix="d"):
    return {f"{prefix}{i}": float(v) for i, v in enumerate(values)}


def test_the_interval_of_a_proportion_matches_the_normal_approximation():
    rng = np.random.default_rng(1)
    values = (rng.random(400) < 0.3).astype(float)
    found = intervals.interval([as_docs(values)])
    p, n = values.mean(), values.size
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    assert found.low < p < found.high
    assert (found.high - found.low) == pytest.approx(2 * half, rel=0.1)
    assert intervals.interval([as_docs(values)]) == found  # seeded: the same numbers every time


def test_a_constant_cell_has_a_point_interval_and_no_documents_no_interval():
    assert intervals.interval([as_docs([1, 1, 1])]) == intervals.Interval(1.0, 1.0)
    assert intervals.interval([{}]) is None
    assert intervals.interval([{"a": None}]) is None  # an unscored document (unreadable verdict) is left out


def test_strata_are_resampled_apart_and_averaged_like_the_table():
    # Two seeds, each constant: the figure is the mean of the two seeds' means, with no spread.
    found = intervals.interval([as_docs([0] * 10), as_docs([1] * 90)])
    assert found == intervals.Interval(0.5, 0.5)


def test_mcnemar_exact_matches_scipys_binomial_test():
    for better, worse in [(0, 0), (3, 0), (10, 2), (7, 9), (30, 12)]:
        expected = 1.0 if better + worse == 0 else stats.binomtest(better, better + worse, 0.5).pvalue
        assert intervals.mcnemar_exact(better, worse) == pytest.approx(expected, rel=1e-9)


def test_paired_accuracy_uses_mcnemar_on_the_shared_documents():
    reference = as_docs([1, 0, 0, 1, 0, 1, 0, 0])
    row = as_docs([1, 1, 1, 1, 1, 1, 0, 0])
    row["extra"] = 1.0  # a document the reference did not score: not paired
    d = intervals.paired([row], [reference])
    assert d.test == "mcnemar" and d.pairs == 8 and d.discordant == (3, 0)
    assert d.mean == pytest.approx(3 / 8)
    assert d.p == pytest.approx(stats.binomtest(3, 3, 0.5).pvalue)
    assert d.interval.low <= d.mean <= d.interval.high
    # In percent (0 or 100) it is still a 0/1 score.
    scaled = intervals.paired([{k: 100 * v for k, v in row.items()}], [{k: 100 * v for k, v in reference.items()}])
    assert scaled.test == "mcnemar" and scaled.p == pytest.approx(d.p) and scaled.mean == pytest.approx(37.5)


def test_paired_continuous_scores_use_the_sign_flip_test_and_see_a_clear_shift():
    rng = np.random.default_rng(0)
    base = rng.random(200)
    shifted = intervals.paired([as_docs(base + 0.1 + 0.01 * rng.standard_normal(200))], [as_docs(base)])
    assert shifted.test == "sign-flip" and shifted.p < 0.01 and shifted.interval.low > 0.05
    assert shifted.draws == intervals.PERMUTATIONS and shifted.units == 200 and shifted.clusters is None
    same = intervals.paired([as_docs(base)], [as_docs(base)])
    assert same.mean == 0 and same.p == 1.0 and same.interval == intervals.Interval(0.0, 0.0)
    noise = intervals.paired([as_docs(base + 0.01 * rng.standard_normal(200))], [as_docs(base)])
    assert noise.p > 0.05 and noise.interval.low < 0 < noise.interval.high
    assert intervals.paired([as_docs(base, "x")], [as_docs(base)]) is None  # nothing shared


def test_holm_adjusts_step_down():
    assert intervals.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert intervals.holm([0.5]) == [0.5]


def sample(doc_id, acc, filt="none"):
    return {"doc_id": doc_id, "filter": filt, "metrics": ["acc", "bias"], "acc": acc, "bias": (1, 2)}


def test_document_scores_key_a_groups_documents_by_subtask_and_check_the_reported_mean():
    samples = {"sub_a": [sample(0, 1.0), sample(1, 0.0)], "sub_b": [sample(0, True)]}
    scores = document_scores(samples, ["sub_a", "sub_b"], "group")
    assert scores == {"acc,none": {"sub_a/0": 1.0, "sub_a/1": 0.0, "sub_b/0": 1.0}}  # tuples (bias) are not scores
    check_against(scores, {"acc,none": 2 / 3}, "group")
    with pytest.raises(ValueError, match="group acc,none: the mean of its 3 per-document scores"):
        check_against(scores, {"acc,none": 0.5}, "group")
    own = document_scores({"task": [sample(4, 0.0)]}, ["task"], "task")
    assert own == {"acc,none": {"4": 0.0}}


CELLS = {"m": {
    "Vanilla": {"acc": {"values": [50.0], "n": 8, "documents": [as_docs([100, 0, 0, 100, 0, 100, 0, 0])]}},
    "Better": {"acc": {"values": [87.5], "n": 8, "documents": [as_docs([100, 100, 100, 100, 100, 100, 100, 0])]},
               "gate": {"values": [0.5], "n": 8}},  # a column without documents: no interval, no test
}}


def test_tables_carry_intervals_paired_differences_and_a_plot(tmp_path):
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0], max_train={}, max_ctrl=None, limits={})
    record = tables.write_tables(tmp_path, "t", "Table T", "Intro.", CELLS, ["acc", "gate"],
                                 lambda model: ("P", {}), profile, "cmd", 1.0, store)
    vanilla, better = record["models"]["m"]["rows"]
    assert vanilla["ours"]["acc"]["difference"] is None and vanilla["ours"]["acc"]["ci"][0] < 50 < vanilla["ours"]["acc"]["ci"][1]
    d = better["ours"]["acc"]["difference"]
    assert d["test"] == "mcnemar" and d["discordant"] == [4, 0] and d["mean"] == pytest.approx(50.0)
    assert d["p_holm"] == pytest.approx(d["p"])  # the only test of the table
    assert better["ours"]["gate"]["ci"] is None and better["ours"]["gate"]["difference"] is None
    md = (tmp_path / "t.md").read_text()
    assert "### m: difference from Vanilla (paired, same documents)" in md
    assert f"+50.00 [{d['ci'][0]:.2f}, {d['ci'][1]:.2f}] p={d['p']:.3f}" in md
    assert json.loads((tmp_path / "t.json").read_text())["uncertainty"]["reference"] == "Vanilla"
    assert (tmp_path / "t_differences.png").stat().st_size > 0
    assert (tmp_path / "t.tex").read_text().count("\\begin{tabular}") == 2


def test_a_column_whose_reference_holds_chance_is_marked(tmp_path):
    # MMLU and ARC at chance for the model (issue 55.4): named under the table and in the JSON; a column
    # whose reference interval excludes 25 (arc_e here, all right) is not.
    low = as_docs([100, 0, 0, 0, 0, 100, 0, 0])  # 25% [0, 62.5]: holds 25
    cells = {"m": {"Vanilla": {"mmlu@bbq": {"values": [25.0], "n": 8, "documents": [low]},
                               "arc_e": {"values": [100.0], "n": 8, "documents": [as_docs([100] * 8)]}}}}
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0], max_train={}, max_ctrl=None, limits={})
    record = tables.write_tables(tmp_path, "t", "Table T", "Intro.", cells, ["mmlu@bbq", "arc_e"],
                                 lambda model: ("P", {}), profile, "cmd", 1.0, store)
    assert record["models"]["m"]["at_chance"] == {"mmlu@bbq": 25.0}
    assert "- At chance for this model: mmlu@bbq (Vanilla [0.00, " in (tmp_path / "t.md").read_text()


def test_a_difference_prints_a_small_p_in_two_digits_and_a_monte_carlo_floor_as_a_bound():
    from repro.analysis.tables import _difference_text

    tiny = {"mean": 4.67, "ci": [2.33, 7.33], "p": 1.2e-4, "significant": True, "significant_holm": True}
    assert _difference_text(tiny, 2).endswith("p=1.2e-04†")
    assert "p=0.000" not in _difference_text({**tiny, "p": 3e-12}, 2)
    assert _difference_text({**tiny, "p": 0.0125, "significant_holm": False}, 2).endswith("p=0.013*")
    floor = 1 / (intervals.PERMUTATIONS + 1)
    assert _difference_text({**tiny, "p": floor, "p_bound": True}, 2) == "+4.67 [2.33, 7.33] p<1e-05†"


def test_a_continuous_column_of_zeros_is_not_read_as_a_zero_one_outcome():
    # A closed MARI gate's KL is exactly 0 on every document, as is Vanilla's: McNemar's test would give the
    # interval of a 0/1 rate (about +-0.019 for 200 pairs); a KL difference of exactly 0 everywhere is 0.
    zeros = [as_docs([0.0] * 200)]
    binary = intervals.paired(zeros, zeros)
    continuous = intervals.paired(zeros, zeros, continuous=True)
    assert binary.test == "mcnemar" and binary.interval.low < -0.01
    assert continuous.test == "sign-flip" and (continuous.interval.low, continuous.interval.high) == (0.0, 0.0)
    assert continuous.p == 1.0


def test_the_tables_read_kl_ce_mc2_and_the_bias_score_as_continuous():
    from repro.engine.profiles import continuous_column

    assert all(map(continuous_column, ["kl", "ce@sorry", "kl@bbq", "tqa_mc2", "bbq_amb_bias"]))
    assert not any(map(continuous_column, ["tqa_mc1", "bbq_acc", "sorry_refusal", "xstest_safe_refusal", "mmlu@sorry"]))
