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

Deviations of the adapted recipe (the default): the original sweeps layers and
multipliers by hand on Llama 2; here the layer (among ~L/3, L/2, 2L/3) and the multiplier (0.5, 1, 2, 4, 8) are chosen on a
validation slice (20%) of D_train by the task loss, and the vector is then recomputed
on all of D_train. The A/B letters are balanced by alternating which letter holds the
positive answer.

Published recipe (``--recipe published``): what Rimsky et al. fix, taken from the paper
(arXiv 2312.06681) and the final ``script.sh`` of github.com/nrimsky/CAA. The vector is
the one above (their ``generate_vectors.py``: the chat-format A/B prompt, the residual
stream after the layer at the answer letter, positive minus negative, averaged). The
layer is fixed: 13 of Llama-2-7B-Chat's 32 decoder layers (14 of 13B-Chat's 40), picked
from their layer sweep. Here it is carried over by relative depth, round(13 L / 32) with
halves rounded up (12 of SmolLM2-135M's 30). The multiplier is fixed at +1, the strength
their A/B evaluations steer with (``script.sh``: the layer sweeps at multipliers -1 and
1, then -1..1 at layer 13; their TruthfulQA and MMLU runs sweep -2..2 with a behaviour's
vector to measure side effects, not to tune). Their ``normalize_vectors.py`` rescales
each behaviour's vector at a layer to the mean norm of the seven behaviours' vectors
there, so that one multiplier means one strength for all of them; with one behaviour it
is the identity, so the raw mean difference is kept. The vector is added at every
position after the end of the user's instruction (``utils/helpers.py``,
``add_vector_after_position``), which in their A/B scoring is the "(" whose logits give
A or B: here the last prompt token p* and every later token, as in the adapted recipe.
No grid: the vector of the 80% fit slice at that layer is scored on the validation slice
(``diagnostics.validation_loss_selected``), then recomputed on all of D_train for the
bundle.

Where it still differs: the prompts scored are lm-eval's, not CAA's A/B prompts; the
vector comes from the attribute's own D_train (their TruthfulQA runs used the sycophancy
vector, extracted from Anthropic's A/B datasets); the model is not Llama 2, so the layer
is a transfer by depth of a layer chosen for another model (their 13B choice, 14 of 40,
is shallower than this rule's 16), and the chat template is the model's own (SmolLM2's
adds its default system prompt; their Llama 2 prompts had none).
"""

from __future__ import annotations

import logging
import random
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .common import (RECIPE_FIELD, SELECTION_KEY, VALIDATION_FIELD, VALIDATION_FIELDS, ScaledVector, validation_loss,
                     validation_record, validation_split)
from mari_eval.injection import layer_spans, site
from mari_eval.vectors.edit_positions import POSITIONS_OPTION, EditPositions, parse_layers
from mari_eval.methods.options import Option
from mari_eval.injection.plan import Plan, Positions
from mari_eval.methods.bundle_spec import Float, Int, List, Str, TensorSpec
from mari_eval.methods.intervention import Intervention
from mari_eval.methods.registry import register_method
from mari_eval.training.objectives import COMPLIANCE_TARGET as COMPLIANCE

if TYPE_CHECKING:
    from mari_eval.training.examples import AttributeData, Example
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

MULTIPLIERS = (0.5, 1.0, 2.0, 4.0, 8.0)
# The published recipe's fixed settings (the module docstring gives their sources).
PUBLISHED_LAYER, PUBLISHED_NUM_LAYERS = 13, 32  # Llama-2-7B-Chat
PUBLISHED_MULTIPLIER = 1.0


def published_layer(num_layers: int) -> int:
    """CAA's layer 13 of 32 carried over to a model of ``num_layers`` layers by relative depth
    (nearest layer, halves up)."""
    return min(num_layers - 1, (2 * PUBLISHED_LAYER * num_layers + PUBLISHED_NUM_LAYERS) // (2 * PUBLISHED_NUM_LAYERS))


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
            acts.append(layer_spans.hidden_at_site(session.model, ids, torch.ones_like(ids), layer)[0].float())
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
        # published: the layer of the original it is carried over from (reference_layer of reference_num_layers).
        "reference_layer": Int(0, optional=True), "reference_num_layers": Int(1, optional=True),
        "vector_normalization": Str(optional=True, choices=("none",)), **VALIDATION_FIELDS,
    }
    label = "CAA"
    command_line_recipe = "published"  # what the tables score (repro/engine/recipes.py MAIN_TABLE_RECIPE)
    # What `mari-eval train --set` may give CAA's fit: the grid it chooses from (default: fit's own).
    training_fields = {"layers": List(Int(0), optional=True), "multipliers": List(Float(), optional=True),
                       "recipe": RECIPE_FIELD, "validation": VALIDATION_FIELD}

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        return {"hidden_size": config["base_model"]["hidden_size"]}, {"vector": TensorSpec(("hidden_size",))}

    # Where ``added_directions`` is added (``mari-eval export-vector`` reports it: llama.cpp adds at every position).
    added_positions: ClassVar[str] = "the last prompt token and every later token"

    def edit(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.strength() * self.tensors_like(hidden)["vector"]

    def added_directions(self) -> dict[int, torch.Tensor]:
        """{site layer: what ``edit`` adds to its output at ``scale=1``}: the vector times the multiplier
        (float32), what ``mari-eval export-vector`` writes as llama.cpp's direction.N (N: the layer)."""
        return {self.layer: float(self.config["hyperparameters"]["multiplier"]) * self.tensors["vector"].float()}

    # Where it edits, chosen at evaluation (mari_eval/vectors/edit_positions.py): by default its published place,
    # p* and every later token after its own layer.
    option_fields: ClassVar[dict[str, Option]] = {
        **ScaledVector.option_fields, "positions": POSITIONS_OPTION,
        "layers": Option(str, "layers=10-14 (its vector added after each)")}
    where: EditPositions = EditPositions("from_last")
    edit_layers: tuple[int, ...] | None = None  # layers= at evaluation (None: its own layer)

    def configure(self, scale: float = 1.0, positions: str | None = None, layers: str | None = None) -> None:
        super().configure(scale)
        self.where = EditPositions.parse(positions) if positions is not None else EditPositions("from_last")
        n = int(self.config["base_model"]["num_layers"])
        self.edit_layers = tuple(parse_layers(layers, n)) if layers is not None else None

    def applied(self, model: torch.nn.Module, positions: Positions,
                variant_ids: torch.Tensor | None = None) -> AbstractContextManager:
        return self.where.applied(model, self.steered_layers(), lambda layer: self.edit, positions)

    def steered_layers(self) -> list[int]:
        """The layers its vector is added after: ``layers=``'s range, else its own."""
        return list(self.edit_layers or (self.layer,))

    def plan(self, model: torch.nn.Module) -> Plan:
        """One edit; the prompt positions before p* the chosen ``positions=`` covers are encoded under it."""
        return Plan((0,), lambda variant_ids, positions: self.applied(model, positions, variant_ids), self.choose,
                    prompt_sites=self.where.prompt_sites)

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {**super().summarize(records), "positions": str(self.where),
                "layers": self.steered_layers()}

    @classmethod
    def training_source(cls) -> str:
        return "CAA's grid"

    @classmethod
    def fit_adapted(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
                    seed: int) -> Intervention:
        pairs = dict(zip((ex.id for ex in data.train), contrast_pairs(data.train, seed)))
        source = hyperparameters.get("validation")  # None: the seeded 20% of D_train (common.VALIDATION_SOURCES)
        fit_examples, val_examples = validation_split(data, seed, source)
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
                                **validation_record(source, val_examples), "negative_for_generation": COMPLIANCE},
            "diagnostics": {"validation_loss": {f"{l}:{m}": v for (l, m), v in scores.items()},
                            SELECTION_KEY: scores[layer, mult],
                            "validation_loss_base": base, "validation_ids": [ex.id for ex in val_examples]},
        }
        return cls(config, {"vector": vector.contiguous()})

    @classmethod
    def fit_published(cls, session: Session, data: AttributeData, config: dict[str, Any],
                      hyperparameters: dict[str, Any], seed: int) -> Intervention:
        """The authors' fixed layer (by relative depth) and multiplier, no grid (module docstring)."""
        grid = sorted(k for k in ("layers", "multipliers") if k in hyperparameters)
        if grid:
            raise ValueError(f"CAA's published recipe fixes the layer and the multiplier; drop --set {', '.join(grid)} "
                             "or train with --recipe adapted to choose them on the validation slice")
        pairs = dict(zip((ex.id for ex in data.train), contrast_pairs(data.train, seed)))
        source = hyperparameters.get("validation")  # None: the seeded 20% of D_train (common.VALIDATION_SOURCES)
        fit_examples, val_examples = validation_split(data, seed, source)
        layer, mult = published_layer(session.num_layers), PUBLISHED_MULTIPLIER
        session.prepare(val_examples, "CAA validation slice", lower=False)
        # The selection loss is that of the vector of the fit slice alone, like every recipe's.
        vector = steering_vector(session, [pairs[ex.id] for ex in fit_examples], layer)
        selected = validation_loss(session, val_examples, _adding(session.model, layer, mult * vector))
        base = validation_loss(session, val_examples)
        log.info("CAA (published): layer %d of %d, multiplier %g: validation loss %.4f (base model %.4f)",
                 layer, session.num_layers, mult, selected, base)
        vector = steering_vector(session, list(pairs.values()), layer)
        config = {
            **config,
            "site": {**config["site"], "layer": layer, "position": "last prompt token and every later token"},
            "hyperparameters": {"recipe": "published", "multiplier": mult, "reference_layer": PUBLISHED_LAYER,
                                "reference_num_layers": PUBLISHED_NUM_LAYERS, "vector_normalization": "none",
                                **validation_record(source, val_examples), "negative_for_generation": COMPLIANCE},
            "diagnostics": {SELECTION_KEY: selected, "validation_loss_base": base,
                            "validation_ids": [ex.id for ex in val_examples]},
        }
        return cls(config, {"vector": vector.contiguous()})


def _adding(model: torch.nn.Module, layer: int, shift: torch.Tensor) -> Plan:
    """The plan adding ``shift`` after ``layer`` from p* on (a candidate of the validation grid)."""
    return Plan((0,), lambda variant_ids, positions: site.edit_from_site(model, layer, lambda h: h + shift.to(h), positions))
