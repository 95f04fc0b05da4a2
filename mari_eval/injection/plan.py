"""What a method hands the runner: one ``Plan`` per loaded intervention, and what comes back.

A *variant* is one alternative edit a method proposes for a prompt (MARI: one per
expert, plus its gate's probe); ``BASE`` (-1) is the untouched model. The runner
(``mari_eval.evaluation.runner`` for log-likelihoods, ``mari_eval.evaluation.generation`` for free text) runs
the plan's variants side by side over the prompt's shared prefix and returns a
``VariantRun``; the plan's ``choose`` then says which variant answers. The lm-eval
model, the trainer and the baselines build no edit closures of their own: a method
builds its plan (``Intervention.plan``), training builds one from an edit function
(``Plan.at_site``), and ``VANILLA`` is the untouched model.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mari_eval.injection import site

BASE = -1  # variant id of the untouched model

# Positions to edit in a batch: (rows [N], cols [N]), a column per row [R], or None (each row's last token).
Positions = tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None
# edit(hidden [R, d], variant_ids [R]) -> the edited hidden states, row i under variant variant_ids[i]
VariantEdit = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# apply(variant_ids [R] or None (variant 0 everywhere), positions) -> context whose forward passes carry the edits
ApplyEdits = Callable[[torch.Tensor | None, Positions], AbstractContextManager]


def no_edit(variant_ids, positions) -> AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class VariantRun:
    """Outcome of one prompt under each variant (rows follow ``variants``)."""

    variants: list[int]
    logprobs: torch.Tensor | None  # [V, M] sum of log p(option tokens) (multiple choice)
    greedy: torch.Tensor | None  # [V, M] whether each option is the greedy continuation
    site: dict[int, torch.Tensor]  # layer -> [V, d] hidden state at p* after that layer
    entropy: torch.Tensor | None = None  # [V] mean next-token entropy of the routing window (generation)
    # Variants whose outputs (log-likelihoods or routing-window entropies) were computed; the
    # others' rows are NaN placeholders (site-only variants, experts behind a closed gate).
    # None: every variant's.
    scored: frozenset[int] | None = None
    prompt: int | None = None  # generation: the prompt's row in the batch

    def row(self, variant: int) -> int:
        return self.variants.index(variant)

    def was_scored(self, variant: int) -> bool:
        return self.scored is None or variant in self.scored

    def nonfinite(self) -> list[tuple[int, str]]:
        """(variant, what) for every computed number of the run that is NaN or infinite."""
        bad = []
        for v in self.variants:
            r = self.row(v)
            if self.was_scored(v):
                if self.logprobs is not None and not bool(torch.isfinite(self.logprobs[r]).all()):
                    bad.append((v, "log-likelihood"))
                if self.entropy is not None and not bool(torch.isfinite(self.entropy[r]).all()):
                    bad.append((v, "routing entropy"))
            for layer, states in self.site.items():
                if not bool(states[r].isnan().all()) and not bool(torch.isfinite(states[r]).all()):
                    bad.append((v, f"hidden state at p* after layer {layer}"))
        return bad


Choose = Callable[[VariantRun], tuple[int, dict]]  # run -> (the variant that answers, a diagnostics record)
Screen = Callable[[VariantRun], bool]  # run of BASE and the site-only variants -> whether the others must run


def _no_prompt_sites(length: int) -> list[int]:
    return []


@dataclass(frozen=True)
class Plan:
    """Everything the runner needs to run one method on a prompt.

    ``variants`` are run for every prompt (``BASE`` among them when ``choose`` or ``screen``
    reads the untouched model); ``apply`` installs their edits; ``capture`` names the layers
    whose states at p* ``choose`` reads; ``site_only`` variants run at p* alone, for those
    states (MARI's probe); ``screen`` (given BASE and the site-only runs) says whether the
    other variants must run at all (MARI's gate); ``edit_layer``: every edit is at that
    layer's output or above, so edited rows may start from the untouched states there;
    ``window``: greedy steps before ``choose`` picks a variant in generation (eq:entropy_gen's
    T_ent); ``prompt_sites(length)``: positions before p* the edit also replaces (ReFT).
    """

    variants: tuple[int, ...] = (BASE,)
    apply: ApplyEdits = no_edit
    choose: Choose | None = None  # None: the first variant answers
    capture: tuple[int, ...] = ()
    site_only: tuple[int, ...] = ()
    screen: Screen | None = None
    edit_layer: int | None = None
    window: int = 1
    prompt_sites: Callable[[int], list[int]] = field(default=_no_prompt_sites)

    def __post_init__(self):
        if not self.variants:
            raise ValueError("a plan needs at least one variant")

    @classmethod
    def at_site(cls, model: torch.nn.Module, layer: int, edit: VariantEdit, variants: Sequence[int],
                capture: Sequence[int] = (), site_only: Sequence[int] = ()) -> "Plan":
        """The plan of ``edit(hidden, variant_ids)`` at the output of ``layer`` (training's edits)."""
        def apply(variant_ids, positions):
            return site.edit_site(model, layer, lambda h: edit(h, _ids_for(variant_ids, h)), positions)

        return cls(tuple(variants), apply, capture=tuple(capture), site_only=tuple(site_only))

    @property
    def answering(self) -> list[int]:
        """The variants that may answer: neither BASE nor site-only."""
        return [v for v in self.variants if v != BASE and v not in self.site_only]

    def pick(self, run: VariantRun) -> tuple[int, dict]:
        return self.choose(run) if self.choose is not None else (self.variants[0], {})


def _ids_for(variant_ids: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    if variant_ids is None:
        return torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    return variant_ids.to(hidden.device)


VANILLA = Plan()  # the untouched model alone
