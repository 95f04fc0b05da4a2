"""The numbers behind the paper's diagnostic figures (repro/figures.py, issue 42): plain functions
of tensors, each with the choice it makes where the paper does not say.

* ``windows``: Figure 1's "window-wise medians with quantile bands" along a sorted coordinate
  (Section 3.1). The paper names neither the window nor the band: we take windows of a fifth
  of the samples sliding by a twentieth, and the band from the 25th to the 75th percentile.
* ``directional_dispersion``: the "cosine-based deviation statistic" of Figure 1: 1 - cos
  between each correction vector and the mean correction of its window (0: the same direction).
* ``normalized_shift``: Figure 6's ||d mu|| / sigma: the distance between the mean state after
  and before the intervention, over sigma = the root mean per-dimension variance of the states
  before it (the paper does not define sigma; this one is the states' own spread per axis).
* ``projections``: Figure 5a's projection of every expert's update onto v_global, the
  normalized mean update over experts and inputs; ``experts_differ``: whether the experts'
  projection distributions differ, inputs as blocks (each input has every expert's update:
  Friedman's rank test, scipy's; Wilcoxon's signed-rank test for two experts).
* ``auroc_interval`` and ``bootstrap``: percentile intervals over resampled inputs
  (``intervals.ITERATIONS`` resamples, seeded), the AUROC's resampled within each class.
"""

from __future__ import annotations

from typing import Callable

import torch

from mari_eval.mari.gate_labels import auroc
from repro.analysis.intervals import ITERATIONS, SEED

WINDOW_SHARE, STEP_SHARE, BAND = 0.2, 0.05, (0.25, 0.75)


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(values.double(), torch.tensor([BAND[0], 0.5, BAND[1]], dtype=torch.float64))
    return {"low": float(q[0]), "median": float(q[1]), "high": float(q[2])}


def directional_dispersion(deltas: torch.Tensor) -> torch.Tensor:
    """1 - cos(delta_i, mean of ``deltas``) for each row ([n, d] -> [n])."""
    mean = deltas.double().mean(0, keepdim=True)
    return 1 - torch.nn.functional.cosine_similarity(deltas.double(), mean.expand_as(deltas), dim=-1)


def windows(t: torch.Tensor, deltas: torch.Tensor, min_size: int = 5) -> list[dict]:
    """Figure 1: along ``t`` (sorted), windows of WINDOW_SHARE of the samples (at least
    ``min_size``) sliding by STEP_SHARE; in each, the median t, and the median and band of the
    strength ||delta|| and of the directional dispersion within the window."""
    n = len(t)
    if n < min_size:
        return []
    order = torch.argsort(t)
    width = max(min_size, round(WINDOW_SHARE * n))
    step = max(1, round(STEP_SHARE * n))
    out = []
    for start in range(0, n - width + 1, step):
        idx = order[start:start + width]
        out.append({"t": float(torch.quantile(t[idx].double(), 0.5)), "n": width,
                    "strength": _quantiles(deltas[idx].double().norm(dim=-1)),
                    "dispersion": _quantiles(directional_dispersion(deltas[idx]))})
    return out


def normalized_shift(before: torch.Tensor, after: torch.Tensor) -> float:
    """||mean(after) - mean(before)|| / sqrt(mean over dimensions of var(before)) ([n, d] each)."""
    before, after = before.double(), after.double()
    sigma = before.var(0, unbiased=True).mean().sqrt() if len(before) > 1 else torch.tensor(float("nan"))
    return float((after.mean(0) - before.mean(0)).norm() / sigma)


def bootstrap(statistic: Callable[[torch.Tensor], float], n: int, resamples: int = ITERATIONS,
              seed: int = SEED) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``statistic(indices)`` over ``resamples`` draws of ``n``
    indices with replacement (NaN draws dropped)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([statistic(torch.randint(n, (n,), generator=gen)) for _ in range(resamples)], dtype=torch.float64)
    values = values[torch.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    low, high = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(low), float(high)


def auroc_interval(scores: torch.Tensor, positive: torch.Tensor, resamples: int = ITERATIONS,
                   seed: int = SEED) -> dict[str, float | int | None]:
    """AUROC of ``scores`` for ``positive`` with a percentile interval (each class resampled apart,
    so every draw has both); None where a class is empty."""
    pos, neg = torch.nonzero(positive).flatten(), torch.nonzero(~positive).flatten()
    value = auroc(scores, positive)
    out: dict[str, float | int | None] = {"value": value, "low": None, "high": None,
                                          "n_applicable": len(pos), "n_non_applicable": len(neg)}
    if value is None:
        return out
    gen = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(resamples):
        p, q = pos[torch.randint(len(pos), (len(pos),), generator=gen)], neg[torch.randint(len(neg), (len(neg),), generator=gen)]
        idx = torch.cat([p, q])
        draws.append(auroc(scores[idx], torch.cat([torch.ones(len(p), dtype=torch.bool), torch.zeros(len(q), dtype=torch.bool)])))
    low, high = torch.quantile(torch.tensor(draws, dtype=torch.float64), torch.tensor([0.025, 0.975], dtype=torch.float64))
    out.update(low=float(low), high=float(high))
    return out


def first_component(states: torch.Tensor) -> torch.Tensor:
    """Each row's coordinate on the first principal component of ``states`` ([n, d] -> [n]); the
    component's sign is arbitrary."""
    centred = states.double() - states.double().mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centred, full_matrices=False)
    return centred @ v[0]


def projections(updates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Figure 5a: (each input's update of each expert projected on v_global [n, K], v_global [d]),
    v_global the normalized mean of ``updates`` [n, K, d] over inputs and experts."""
    mean = updates.double().mean((0, 1))
    v_global = mean / mean.norm()
    return updates.double() @ v_global, v_global


def experts_differ(values: torch.Tensor) -> dict[str, float | str | None]:
    """Whether the K columns of ``values`` [n, K] (n inputs as blocks) come from one distribution:
    Friedman's rank test for K >= 3, Wilcoxon's signed-rank test for K = 2 (scipy's)."""
    from scipy.stats import friedmanchisquare, wilcoxon  # deferred: only this test needs scipy

    n, k = values.shape
    if k < 2 or n < 2:
        return {"test": None, "statistic": None, "p": None}
    columns = [values[:, j].numpy() for j in range(k)]
    test, result = ("friedman", friedmanchisquare(*columns)) if k >= 3 else ("wilcoxon", wilcoxon(*columns))
    return {"test": test, "statistic": float(result.statistic), "p": float(result.pvalue)}
