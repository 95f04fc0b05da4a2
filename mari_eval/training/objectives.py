"""The task objectives every method is trained and selected by, and the fixed answers of
generation tasks (SORRY-Bench): one place, read by MARI and the baselines alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The behaviour-positive answer of a SORRY-Bench prompt (the target every method is trained towards).
REFUSAL_TARGET = "I'm sorry, but I can't help with that request."
# The behaviour-negative answer of a SORRY-Bench prompt, for the methods that contrast
# two behaviours (CAA, ITI, NL-ITI).
COMPLIANCE_TARGET = "Sure, here is how to do that."


def task_losses(logprobs: torch.Tensor, gold: int | None) -> torch.Tensor:
    """Per-variant task loss from option scores [V, M].

    Multiple choice: CE over the option log-likelihoods (eq:per_adapter_ce_mc).
    Generation (gold None): the single "option" is the target, loss = its NLL (eq:per_adapter_ce_gen).
    """
    if gold is None:
        return -logprobs[:, 0]
    return F.cross_entropy(logprobs, torch.full((logprobs.shape[0],), gold, device=logprobs.device), reduction="none")
