"""Which control examples MARI's energy gate should let through, and how well energy tells.

The gate's threshold tau_E is the rho-quantile of the energies of the *non-applicable*
examples of D_ctrl (equations.energy_threshold). The paper says an example's label comes
from "its computable intervention outcome", with both sources (held-out attribute examples
and general-capability ones) holding applicable and non-applicable examples; its Table 3
(the TruthfulQA gain kept at rho = 1.0) is only reachable if the non-applicable set is in
effect the general-capability one. Three readings, all stored in a bundle so that an
evaluation can switch between them without retraining (``labels=`` in --model_args):

* ``loss``: the routed expert's task loss is below the base model's (the paper's text; the
  default, and the only labels of bundles trained before the option).
* ``flip``: the intervention changes the answer from wrong to right. Multiple choice: the base
  model's argmax option is wrong and the routed expert's is the gold one. Generation (one
  target continuation): the target's log-likelihood rises by more than ``FLIP_MARGIN`` =
  log 2 nats, i.e. the target becomes at least twice as likely.
* ``source``: every held-out attribute example is applicable, every general-capability
  (ARC-Easy, MMLU) example is not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

LABELINGS = ("loss", "flip", "source")
FLIP_MARGIN = math.log(2)
ATTRIBUTE_SOURCE = "attribute"  # examples.AttributeData.ctrl_source: "attribute", "arc_easy" or "mmlu"


def loss_label(losses: torch.Tensor, edited_row: int, base_row: int) -> bool:
    """``loss``: the edited variant's task loss is below the base model's."""
    return bool(losses[edited_row] < losses[base_row])


def flip_label(logprobs: torch.Tensor, gold: int | None, edited_row: int, base_row: int) -> bool:
    """``flip`` from option log-likelihoods [V, M] (generation: M = 1, the target)."""
    if gold is None:
        return bool(logprobs[edited_row, 0] - logprobs[base_row, 0] > FLIP_MARGIN)
    return int(logprobs[base_row].argmax()) != gold and int(logprobs[edited_row].argmax()) == gold


def source_labels(sources: list[str]) -> torch.Tensor:
    """``source``: applicable iff the control example is a held-out attribute example."""
    return torch.tensor([s == ATTRIBUTE_SOURCE for s in sources], dtype=torch.bool)


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float | None:
    """P(score of a positive > score of a negative), ties counting one half (Mann-Whitney U
    over all pairs); None when either class is empty. 1.0: energy alone puts every applicable
    example above every non-applicable one (the gate opens for high energy)."""
    positive = positive.bool()
    pos, neg = scores[positive].double(), scores[~positive].double()
    if pos.numel() == 0 or neg.numel() == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return float(greater + 0.5 * ties)


def separation(energies: torch.Tensor, applicable: torch.Tensor, sources: list[str] | None) -> dict[str, Any]:
    """How well energy separates applicable from non-applicable control examples: counts, AUROC
    over all of them, and within each source (where both classes occur there)."""
    applicable = applicable.bool()
    out: dict[str, Any] = {"n_applicable": int(applicable.sum()), "n_non_applicable": int((~applicable).sum()),
                           "auroc": auroc(energies, applicable)}
    if sources is not None:
        within = {}
        for source in dict.fromkeys(sources):
            mask = torch.tensor([s == source for s in sources], dtype=torch.bool)
            within[source] = {"n_applicable": int(applicable[mask].sum()), "n": int(mask.sum()),
                              "auroc": auroc(energies[mask], applicable[mask])}
        out["within_source"] = within
    return out


def control_labels(tensors: dict[str, torch.Tensor], sources: list[str] | None, labels: str,
                   single: bool = False) -> torch.Tensor:
    """The applicability of every D_ctrl example of a MARI bundle under ``labels`` (for the
    routed experts, or the one-adapter ablation when ``single``), as a bool tensor [N]."""
    if labels == "loss":
        return tensors["ctrl_applicable_single" if single else "ctrl_applicable"].bool()
    if labels == "flip":
        name = "ctrl_flip_single" if single else "ctrl_flip"
        if name not in tensors:
            raise ValueError("labels=flip: this bundle holds no flip labels (it was trained before they were "
                             "recorded); retrain it with `mari-eval train`, or use labels=loss or labels=source")
        return tensors[name].bool()
    if labels == "source":
        if sources is None:
            raise ValueError("labels=source: this bundle does not record the sources of its control examples "
                             "(gate.ctrl_sources in bundle.json); retrain it, or use labels=loss")
        return source_labels(sources)
    raise ValueError(f"labels={labels!r}: use one of {', '.join(LABELINGS)}")
