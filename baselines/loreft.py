"""LoReFT's math, shared by ReFT's two recipes (``baselines.reft``'s adapted fit and
``baselines.reft_published``): the edit Phi(h) (Wu et al. 2024, eq. 2), the prompt positions it
edits, the context manager that applies it after several layers, and the published recipe's
parameters: where they start, how R stays orthonormal, how far they move.

The published starting point is ``torch.nn.Linear``'s default initialisation for W and b (pyreft's
LoReFT builds W as a Linear layer) and a random orthonormal R; ``continuous_rows`` keeps R's
rows from flipping sign during training; ``distance_from_init`` is what the fit records to
show the edit learned (issue 36.1); ``dropped`` is pyreft's dropout on the edit's output.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from mari_eval.injection import site
from mari_eval.injection.plan import Positions


def linear_init(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """``torch.nn.Linear``'s default initialisation of a layer reading ``shape[-1]`` inputs, for its
    weight and its bias alike: uniform in +-1/sqrt(fan_in) (kaiming_uniform with a = sqrt(5))."""
    return (torch.rand(*shape, generator=generator) * 2 - 1) / math.sqrt(shape[-1])


def linear_init_bias(generator: torch.Generator, fan_in: int, *shape: int) -> torch.Tensor:
    """The bias of that layer: uniform in +-1/sqrt(fan_in)."""
    return (torch.rand(*shape, generator=generator) * 2 - 1) / math.sqrt(fan_in)


def continuous_rows(free: torch.Tensor) -> torch.Tensor:
    """``reft.orthonormal_rows`` ([r, d] or [L, r, d]) with the signs that give QR's triangular factor a
    positive diagonal: the one factorisation continuous in ``free``. LAPACK's Householder QR takes the
    signs from the pivots', so a pivot crossing 0 in training flips a row of R and the edit jumps."""
    q, r = torch.linalg.qr(free.mT)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    return (q * torch.where(signs == 0, 1.0, signs).unsqueeze(-2)).mT


def initial_parameters(generator: torch.Generator, layers: int, rank: int, d: int) -> dict[str, torch.Tensor]:
    """The parameters the fit starts from, drawn from ``generator`` in this order: ``free`` (R =
    ``continuous_rows(free)``, a random orthonormal R), then W and b at torch.nn.Linear(d, rank)'s default."""
    free = torch.randn(layers, rank, d, generator=generator)
    W = linear_init(generator, layers, rank, d)
    return {"free": free, "W": W, "b": linear_init_bias(generator, d, layers, rank)}


def distance_from_init(initial: dict[str, torch.Tensor], final: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """How far the learned edit moved from its start, per layer (mean and max over the layers):
    ||W - W0|| / ||W0||, ||R - R0|| / ||R0|| (Frobenius; ||R0|| = sqrt(rank)), ||b - b0||, ||b - b0|| / ||b0||."""
    out = {}
    for key, name, relative in (("W_relative", "W", 1), ("R_relative", "R", 1), ("b", "b", 0), ("b_relative", "b", 1)):
        a, b = initial[name].double().flatten(1), final[name].double().flatten(1)
        values = (b - a).norm(dim=1) / (a.norm(dim=1) if relative else 1)
        out[key] = {"mean": round(float(values.mean()), 6), "max": round(float(values.max()), 6)}
    return out


def dropped(hidden: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Inverted dropout of the edited states (pyreft's dropout on the intervention's output), its
    mask drawn from ``generator`` so that a resumed run draws the same masks."""
    if p == 0:
        return hidden
    keep = torch.rand(hidden.shape, generator=generator) >= p
    return hidden * keep.to(hidden) / (1 - p)


def loreft(h: torch.Tensor, R: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Phi(h) = h + R^T (W h + b - R h), row-wise on [N, d]."""
    return h + (h @ W.T + b - h @ R.T) @ R


def orthonormal_rows(free: torch.Tensor) -> torch.Tensor:
    """R with orthonormal rows spanning the row space of ``free`` ([r, d], r <= d; or [L, r, d], one R per layer)."""
    return torch.linalg.qr(free.mT).Q.mT


def first_and_last(length: int, first: int, last: int) -> list[int]:
    """The first ``first`` and last ``last`` positions of a prompt of ``length`` tokens, p* excluded."""
    p_star = length - 1
    return sorted(({*range(min(first, p_star))} | {*range(max(0, length - last), p_star)}))


def pyreft_positions(length: int, first: int, last: int) -> list[int]:
    """``first_and_last`` with each count capped at half the prompt, as pyreft's
    get_intervention_locations does (a 9-token prompt under f7+l7 edits 4 + 4 tokens)."""
    return first_and_last(length, min(length // 2, first), min(length // 2, last))


@contextlib.contextmanager
def edits_at_layers(model: torch.nn.Module, layers: Sequence[int], edit_at: Callable[[int, torch.Tensor], torch.Tensor],
                    positions: Positions) -> Iterator[None]:
    """Forward passes inside edit the states after each of ``layers`` at ``positions``:
    ``edit_at(i, h)`` is the edit of ``layers[i]`` (one ``site.edit_site`` per layer)."""
    with contextlib.ExitStack() as stack:
        for i, layer in enumerate(layers):
            stack.enter_context(site.edit_site(model, layer, lambda h, i=i: edit_at(i, h), positions))
        yield


def python_rng_state(saved: list) -> tuple:
    """random.Random.getstate() after a JSON round trip (lists back to tuples)."""
    version, internal, gauss_next = saved
    return version, tuple(internal), gauss_next
