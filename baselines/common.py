"""What the baselines share: the validation slice of D_train their hyperparameters are
chosen on, and the task loss they are scored by there."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from mari_eval import runner
from mari_eval.plan import VANILLA, Plan

if TYPE_CHECKING:
    from mari_eval.train import Example, Session

VALIDATION_FRACTION = 0.2


def validation_split(examples: list[Example], seed: int) -> tuple[list[Example], list[Example]]:
    """(fit, validation) examples: a seeded 20% of D_train is held out for model selection.

    The test split is never involved; every baseline gets the same slice for a seed.
    """
    order = list(range(len(examples)))
    random.Random(f"validation:{seed}").shuffle(order)
    n_val = max(1, int(len(examples) * VALIDATION_FRACTION))
    return [examples[i] for i in order[n_val:]], [examples[i] for i in order[:n_val]]


@torch.no_grad()
def validation_loss(session: Session, examples: list[Example], plan: Plan = VANILLA) -> float:
    """Mean task loss (option cross-entropy, or target NLL for generation) of ``examples``
    under ``plan``'s first variant (MARI's eq:per_adapter_ce_mc / eq:per_adapter_ce_gen)."""
    from mari_eval.objectives import task_losses

    losses = []
    for ex in examples:
        run = runner.score_variants(session.model, session.prefix(ex), ex.context[-1], ex.options, plan,
                                    max_tokens=session.max_tokens)
        losses.append(float(task_losses(run.logprobs, ex.gold)[0]))
    return sum(losses) / len(losses)
