"""A RepE reading vector as a mari-eval method (an example of a plugin; docs/plugins.md).

Representation Engineering (Zou et al., 2023, "Representation Engineering: A Top-Down
Approach to AI Transparency", arXiv 2310.01405) reads a concept from the hidden states of
contrasting stimuli: the first principal component of the differences between paired
activations, in random order, is the *reading vector*; adding it, scaled, to the hidden
state steers the model towards the concept.

Here the stimuli are each training question followed by its correct answer and by one
wrong answer (SORRY-Bench: the refusal and the compliance), read at the site mari-eval
trains every method at (layer l*, the last token); the vector is added at the last prompt
token p*, as the interface's default plan does, times ``coefficient`` (a training setting)
and the mean gap between the pairs along it, so that coefficient 1 moves a state by the
typical distance between an answer and its contrast. ``scale=`` in ``--model_args``
multiplies it at evaluation. Where it differs from RepE: one layer and one position
instead of a band of layers at every position, and the sign is fixed by which side the
correct answers fall on (RepE chooses it on labelled pairs too).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from mari_eval.methods import Float, Intervention, Option, TensorSpec


class ReadingVector(Intervention):
    """Tensors: ``reading_vector`` [d] (unit norm); hyperparameters: ``coefficient``, ``gap``."""

    label = "RepE"  # how tables and errors name the method
    # What bundle.json's "hyperparameters" must hold (checked on save and on load).
    hyperparameter_fields = {"coefficient": Float(), "gap": Float(lo=0)}
    # What `mari-eval train --set KEY=VALUE` may give, and the defaults that complete it.
    training_fields = {"coefficient": Float()}
    training_defaults = {"coefficient": 1.0}
    # What `--model_args` may give at evaluation (besides HFLM's own).
    option_fields = {"scale": Option(float, "scale=2 (0: no edit)", finite=True)}
    scale = 1.0

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        return {"hidden_size": config["base_model"]["hidden_size"]}, {"reading_vector": TensorSpec(("hidden_size",))}

    def configure(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def edit(self, hidden: torch.Tensor) -> torch.Tensor:
        """h + scale * coefficient * gap * v at (l*, p*) for every row of ``hidden`` [B, d]."""
        settings = self.config["hyperparameters"]
        strength = self.scale * settings["coefficient"] * settings["gap"]
        return hidden + strength * self.tensors_like(hidden)["reading_vector"]

    @classmethod
    def fit(cls, session, data, config: dict[str, Any], hyperparameters: dict[str, Any], seed: int) -> "ReadingVector":
        settings = cls.training_hyperparameters(hyperparameters)
        rng = random.Random(f"repe:{seed}")
        positive, negative = [], []
        for example in data.train:
            right, wrong = example.contrast()  # token lists: the correct answer(s), the others
            positive.append(example.context + right[0])
            negative.append(example.context + rng.choice(wrong))
        # h at l* after the last token of each stimulus (the frozen model's shared preamble once).
        states = session.hidden_of_prompts(positive + negative)
        pos, neg = states[: len(positive)], states[len(positive):]
        # Pairs in random order, as RepE forms them: the first component of their differences.
        signs = torch.tensor([rng.choice((1.0, -1.0)) for _ in positive], device=states.device)[:, None]
        differences = signs * (pos - neg)
        _, _, components = torch.linalg.svd(differences - differences.mean(0), full_matrices=False)
        vector = components[0]
        gaps = (pos - neg) @ vector
        if gaps.mean() < 0:  # the correct answers on the positive side
            vector, gaps = -vector, -gaps
        config = {**config, "hyperparameters": {"coefficient": settings["coefficient"], "gap": float(gaps.abs().mean())},
                  "diagnostics": {"pairs": len(positive), "gap_positive_share": float((gaps > 0).float().mean())}}
        return cls(config, {"reading_vector": vector.float().cpu().contiguous()})
