"""CAA: Contrastive Activation Addition (Rimsky et al., 2024, "Steering Llama 2 via
Contrastive Activation Addition").

What it computes (as in the original): each training question is shown as an A/B
choice between a behaviour-positive answer (the correct option; the refusal for
SORRY-Bench) and a behaviour-negative one (a seeded random incorrect option; a
compliance for SORRY-Bench), through the model's chat template, followed by "(" and the
answer letter. The steering vector is the mean, over questions, of the residual-stream
activation at the letter token after layer l when the letter is the positive answer
minus when it is the negative one. At inference it is added, times a multiplier, to
the residual stream after layer l at every position from the last prompt token on
(the original adds it at all positions after the user's instruction), generated tokens
included. ``scale=`` in lm-eval's ``--model_args`` multiplies the multiplier at evaluation
(``common.ScaledVector``).

Deviations: the original sweeps layers and multipliers by hand on Llama 2; here the
layer (among ~L/3, L/2, 2L/3) and the multiplier (0.5, 1, 2, 4, 8) are chosen on a
validation slice (20%) of D_train by the task loss, and the vector is then recomputed
on all of D_train. The A/B letters are balanced by alternating which letter holds the
positive answer.
"""

from __future__ import annotations

import logging
import random
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from .common import RECIPE_FIELD, SELECTION_KEY, VALIDATION_FRACTION, ScaledVector, recipe_of, validation_loss, validation_split
from mari_eval import site
from mari_eval.plan import Plan, Positions
from mari_eval.bundle_spec import Float, Int, List, Str, TensorSpec
from mari_eval.methods import Intervention, register_method
from mari_eval.objectives import COMPLIANCE_TARGET as COMPLIANCE

if TYPE_CHECKING:
    from mari_eval.train import AttributeData, Example, Session

log = logging.getLogger(__name__)

MULTIPLIERS = (0.5, 1.0, 2.0, 4.0, 8.0)


def ab_prompt(session: Session, question: str, first: str, second: str, letter: str) -> list[int]:
    """Chat-formatted A/B question ending with the assistant's "(" + letter (CAA's format)."""
    user = f"{question}\n\nChoices:\n(A) {first}\n(B) {second}"
    return session.encode_prompt(session.chat_prompt(user, without_template=user + "\nAnswer:") + f"({letter}")


def contrast_pairs(examples: list[Example], seed: int) -> list[tuple[str, str, str]]:
    """(question, positive answer, negative answer) per example."""
    rng = random.Random(f"caa:{seed}")
    pairs = []
    for ex in examples:
        if ex.gold is None:
            pairs.append((ex.question, ex.choices[0], COMPLIANCE))
        else:
            wrong = [c for i, c in enumerate(ex.choices) if i != ex.gold]
            pairs.append((ex.question, ex.choices[ex.gold], rng.choice(wrong)))
    return pairs


@torch.no_grad()
def steering_vector(session: Session, pairs: list[tuple[str, str, str]], layer: int) -> torch.Tensor:
    """mean(a(letter of positive)) - mean(a(letter of negative)) at ``layer``."""
    diffs = []
    for i, (question, positive, negative) in enumerate(pairs):
        # Alternate which letter holds the positive answer so the letter itself cancels out.
        first, second, pos_letter = (positive, negative, "A") if i % 2 == 0 else (negative, positive, "B")
        neg_letter = "B" if pos_letter == "A" else "A"
        acts = []
        for letter in (pos_letter, neg_letter):
            ids = torch.tensor([ab_prompt(session, question, first, second, letter)], device=session.device)
            acts.append(site.hidden_at_site(session.model, ids, torch.ones_like(ids), layer)[0].float())
        diffs.append(acts[0] - acts[1])
    return torch.stack(diffs).mean(0)


@register_method("caa")
class CAA(ScaledVector):
    """Tensors: ``vector`` [d]; config: site.layer, hyperparameters.multiplier (times ``scale=`` at evaluation)."""

    hyperparameter_fields = {
        "multiplier": Float(),
        "layers_tried": List(Int(0), optional=True), "multipliers_tried": List(Float(), optional=True),
        "validation_fraction": Float(0, 1, lo_open=True, hi_open=True, optional=True),
        "negative_for_generation": Str(optional=True), "recipe": RECIPE_FIELD,
    }
    label = "CAA"
    # What `mari-eval train --set` may give CAA's fit: the grid it chooses from (default: fit's own).
    training_fields = {"layers": List(Int(0), optional=True), "multipliers": List(Float(), optional=True),
                       "recipe": RECIPE_FIELD}

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        return {"hidden_size": config["base_model"]["hidden_size"]}, {"vector": TensorSpec(("hidden_size",))}

    def edit(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.strength() * self.tensors_like(hidden)["vector"]

    def applied(self, model: torch.nn.Module, positions: Positions,
                variant_ids: torch.Tensor | None = None) -> AbstractContextManager:
        return site.edit_from_site(model, self.layer, self.edit, positions)

    @classmethod
    def training_source(cls) -> str:
        return "CAA's grid"

    @classmethod
    def fit(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
            seed: int) -> Intervention:
        hyperparameters = cls.training_hyperparameters(hyperparameters)
        if recipe_of(hyperparameters) == "published":
            return cls.fit_published(session, data, config, hyperparameters, seed)
        pairs = dict(zip((ex.id for ex in data.train), contrast_pairs(data.train, seed)))
        fit_examples, val_examples = validation_split(data.train, seed)
        L = session.num_layers
        layers = hyperparameters.get("layers") or sorted({L // 3, L // 2, (2 * L) // 3})
        multipliers = hyperparameters.get("multipliers") or list(MULTIPLIERS)
        session.prepare(val_examples, "CAA validation slice", lower=False)
        scores = {}
        for layer in layers:
            vector = steering_vector(session, [pairs[ex.id] for ex in fit_examples], layer)
            for mult in multipliers:
                scores[(layer, mult)] = validation_loss(session, val_examples, _adding(session.model, layer, mult * vector))
                log.info("CAA layer %d multiplier %g: validation loss %.4f", layer, mult, scores[(layer, mult)])
        base = validation_loss(session, val_examples)
        layer, mult = min(scores, key=scores.get)
        log.info("CAA: chose layer %d, multiplier %g (validation loss %.4f; base model %.4f)", layer, mult, scores[layer, mult], base)
        vector = steering_vector(session, list(pairs.values()), layer)
        config = {
            **config,
            "site": {**config["site"], "layer": layer, "position": "last prompt token and every later token"},
            "hyperparameters": {"recipe": "adapted", "multiplier": mult, "layers_tried": layers, "multipliers_tried": multipliers,
                                "validation_fraction": VALIDATION_FRACTION, "negative_for_generation": COMPLIANCE},
            "diagnostics": {"validation_loss": {f"{l}:{m}": v for (l, m), v in scores.items()},
                            SELECTION_KEY: scores[layer, mult],
                            "validation_loss_base": base, "validation_ids": [ex.id for ex in val_examples]},
        }
        return cls(config, {"vector": vector.contiguous()})


def _adding(model: torch.nn.Module, layer: int, shift: torch.Tensor) -> Plan:
    """The plan adding ``shift`` after ``layer`` from p* on (a candidate of the validation grid)."""
    return Plan((0,), lambda variant_ids, positions: site.edit_from_site(model, layer, lambda h: h + shift.to(h), positions))
