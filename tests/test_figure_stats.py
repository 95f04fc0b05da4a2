"""The statistics behind repro/figures.py's pictures (repro/plots/figure_stats.py), on data whose answer
is known by construction."""

import math

import pytest
import torch

from repro.plots import figure_stats


def test_windows_slide_along_t_and_summarise_strength_and_direction():
    n = 100
    t = torch.linspace(-1, 1, n)[torch.randperm(n, generator=torch.Generator().manual_seed(0))]
    # Corrections along one axis, their length growing with t: no dispersion, strength = 2 + t.
    deltas = torch.zeros(n, 8)
    deltas[:, 0] = 2 + t
    out = figure_stats.windows(t, deltas)
    assert len(out) == (n - 20) // 5 + 1 and all(w["n"] == 20 for w in out)  # a fifth of the samples, a twentieth apart
    assert [w["t"] for w in out] == sorted(w["t"] for w in out)
    for w in out:
        assert w["strength"]["median"] == pytest.approx(2 + w["t"], abs=1e-6)
        assert w["strength"]["low"] <= w["strength"]["median"] <= w["strength"]["high"]
        assert w["dispersion"]["median"] == pytest.approx(0, abs=1e-9)
    assert figure_stats.windows(t[:3], deltas[:3]) == []  # too few samples for a window


def test_directional_dispersion_is_one_minus_the_cosine_to_the_mean_correction():
    deltas = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # the mean points at 45 degrees
    assert figure_stats.directional_dispersion(deltas).tolist() == pytest.approx([1 - math.sqrt(0.5)] * 2)


def test_normalized_shift_is_the_mean_shift_over_the_per_axis_spread_before():
    g = torch.Generator().manual_seed(1)
    before = 2.0 * torch.randn(4000, 16, generator=g)
    shift = torch.zeros(16)
    shift[3] = 10.0
    assert figure_stats.normalized_shift(before, before + shift) == pytest.approx(10.0 / 2.0, rel=0.05)
    assert figure_stats.normalized_shift(before, before) == 0.0  # a closed gate leaves the states as they were


def test_auroc_interval_resamples_each_class_and_brackets_the_value():
    g = torch.Generator().manual_seed(2)
    positive = torch.tensor([True] * 40 + [False] * 60)
    scores = torch.randn(100, generator=g) + 1.5 * positive
    cell = figure_stats.auroc_interval(scores, positive, resamples=300)
    assert 0.7 < cell["value"] < 1 and cell["low"] <= cell["value"] <= cell["high"]
    assert (cell["n_applicable"], cell["n_non_applicable"]) == (40, 60)
    empty = figure_stats.auroc_interval(scores, torch.zeros(100, dtype=torch.bool))
    assert empty["value"] is None and empty["low"] is None  # one class only: no AUROC


def test_projections_on_the_global_mean_and_the_test_of_different_experts():
    g = torch.Generator().manual_seed(3)
    n = 50
    base = torch.zeros(n, 3, 4)
    base[..., 0] = torch.tensor([1.0, 2.0, 3.0])  # expert k pushes k + 1 along the first axis
    updates = base + 0.05 * torch.randn(n, 3, 4, generator=g)
    projected, v_global = figure_stats.projections(updates)
    assert v_global.norm() == pytest.approx(1.0) and abs(float(v_global[0])) == pytest.approx(1.0, abs=1e-3)
    assert projected.mean(0).tolist() == pytest.approx([1.0, 2.0, 3.0], abs=0.05)
    different = figure_stats.experts_differ(projected)
    assert different["test"] == "friedman" and different["p"] < 1e-10
    same = figure_stats.experts_differ(torch.randn(n, 3, generator=g))
    assert same["p"] > 0.001
    assert figure_stats.experts_differ(projected[:, :2])["test"] == "wilcoxon"  # two experts: the signed-rank test


def test_first_component_is_the_direction_of_largest_spread():
    g = torch.Generator().manual_seed(4)
    states = torch.randn(200, 5, generator=g) * torch.tensor([0.1, 5.0, 0.1, 0.1, 0.1])
    pc1 = figure_stats.first_component(states)
    assert abs(float(torch.corrcoef(torch.stack([pc1, states[:, 1].double()]))[0, 1])) > 0.99
