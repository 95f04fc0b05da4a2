"""The optional sign check of imported steering vectors: ``mari-eval import-vector FILE --model M
--out DIR --sign-check POSITIVE NEGATIVE [--sign-check P2 N2 ...]``.

Why: a direction found by PCA has no inherent sign; which way it points is up to the solver.
repeng (``read_representations``, repeng/extract.py) fixes it after fitting by projecting each
training pair's hidden states on the direction and negating it when, in more pairs than not, the
positive example projects lower than the negative one; in llama.cpp's cvector-generator the same
fix was discussed in PR 8069 ("cvector: better prompt handling", project the data and flip so
that adding the vector moves the mean the wanted way) and left as a to-do (issue 8724), so its
PCA vectors may come out reversed. This check applies that idea to a vector already made, with a
few contrastive prompts the user gives.

What it computes, per imported layer N whose direction is added (a control vector's every
direction; an lm-eval steering config's ``add`` rows): for each pair, d = h_N(positive) -
h_N(negative), h_N the output of decoder layer N (where the direction is added) at the prompt's
last token, on the untouched model, each prompt encoded alone as plain text (the tokenizer's own
special tokens, no chat template); its projection on u, the unit vector of what the bundle adds
(the direction times the sign of its strength or coefficient, so a negative ``--scale`` or
steering_coefficient is taken into account). The rule (issue 83.3: one pair differing by a trailing
space once negated a direction on a projection of -0.18):

* at least ``MIN_PAIRS`` (3) pairs, no two the same and none whose prompts are the same text up to
  case, whitespace and punctuation (``normalised``: Unicode NFKC, casefolded, its words alone):
  refused before the model loads, naming the pair;
* each pair's cosine c_i = (d_i . u) / |d_i|, and their mean c. A unit vector unrelated to the
  pairs has a cosine with a fixed vector of mean 0 and standard deviation 1/sqrt(D) in D
  dimensions; the margin is ``MARGIN_SDS`` (3) of those: |c| >= 3 / sqrt(D) (0.125 at SmolLM2-135M's
  576, 0.047 at 4096);
* flipped: c <= -margin and at least ``AGREEMENT`` (three quarters) of the pairs have c_i < 0: the
  stored direction is negated, so that adding it moves states toward the positive prompts;
* kept: c >= margin and three quarters of the pairs have c_i > 0;
* inconclusive: anything else (a mean within the margin, pairs split): the direction is kept as
  imported and a warning gives the mean, the margin and the split, and says to add pairs or ones
  that contrast more.

Skipped with the reason: clamp rows (a clamp sets the component along v/|v| to its coefficient;
negating v is the same as negating the coefficient, which the file chose on purpose) and a strength
or coefficient of 0 (nothing is added). The verdicts and the pairs are recorded in bundle.json
(``source.sign_check``); the source's sha256 stays the file's. The hidden states are measured
before the bundle is written (``SignCheck``), so a model that fails to load leaves ``--out``
untouched; ``apply`` then flips the saved bundle's rows and writes it again.
"""

from __future__ import annotations

import logging
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mari_eval.methods.bundle_spec import BundleError
from mari_eval.methods.bundles import load_bundle
from mari_eval.injection.site import decoder_layers

log = logging.getLogger(__name__)

CHECKED_METHODS = {"control_vector": "directions", "steered_config": "vectors"}  # method: its tensor of directions
MIN_PAIRS = 3  # fewer are refused: one pair's sign is one draw
MARGIN_SDS = 3.0  # the mean cosine's margin, in standard deviations of a random direction's cosine (1/sqrt(D))
AGREEMENT = 0.75  # the share of pairs whose cosine has the verdict's sign


@dataclass(frozen=True)
class LayerSign:
    """One layer's outcome: its mean projection and mean cosine (None when skipped), how many pairs project
    above 0, the margin, and the verdict (flipped, kept, inconclusive, or ``skipped: why``)."""

    layer: int
    mean_projection: float | None
    positive_pairs: int
    pairs: int
    verdict: str
    mean_cosine: float | None = None
    margin: float | None = None

    def line(self) -> str:
        if self.mean_projection is None:
            return f"  layer {self.layer}: {self.verdict}"
        return (f"  layer {self.layer}: mean projection {self.mean_projection:+.4g}, mean cosine {self.mean_cosine:+.3f} "
                f"(margin {self.margin:.3f}; {self.positive_pairs} of {self.pairs} pairs positive): {self.verdict}")


def normalised(prompt: str) -> str:
    """A prompt's words alone (Unicode NFKC, casefolded; whitespace and punctuation dropped): two prompts
    equal here differ only in what the check should not rest on."""
    return " ".join(re.findall(r"\w+", unicodedata.normalize("NFKC", prompt).casefold()))


def check_pairs(pairs: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """The pairs as (positive, negative) tuples, or a ValueError naming the bad one and the fix."""
    checked, seen = [], {}
    for i, pair in enumerate(pairs or [], start=1):
        if len(pair) != 2 or not all(isinstance(p, str) and p.strip() for p in pair):
            raise ValueError(f"--sign-check pair {i}: give two non-empty prompts, POSITIVE then NEGATIVE")
        key = (normalised(pair[0]), normalised(pair[1]))
        if key[0] == key[1]:
            raise ValueError(f"--sign-check pair {i}: {pair[0]!r} and {pair[1]!r} are the same words (up to case, "
                             "whitespace and punctuation): their difference says nothing about the direction; give a "
                             "prompt showing the behaviour and one showing its opposite")
        if key in seen:
            raise ValueError(f"--sign-check pair {i} repeats pair {seen[key]} ({pair[0]!r} / {pair[1]!r}): a repeated "
                             "pair is no further evidence; give different pairs")
        seen[key] = i
        checked.append((pair[0], pair[1]))
    if len(checked) < MIN_PAIRS:
        raise ValueError(f"--sign-check needs at least {MIN_PAIRS} POSITIVE NEGATIVE pairs (given {len(checked)}): "
                         "one pair's sign is one draw; repeat --sign-check with further pairs (docs/methods.md)")
    return checked


def verdict(cosines: torch.Tensor, margin: float) -> str:
    """flipped, kept or inconclusive from the pairs' cosines with the added direction (module docstring)."""
    mean, need = float(cosines.mean()), math.ceil(AGREEMENT * len(cosines))
    if mean <= -margin and int((cosines < 0).sum()) >= need:
        return "flipped"
    if mean >= margin and int((cosines > 0).sum()) >= need:
        return "kept"
    return "inconclusive"


def last_token_states(model: torch.nn.Module, tokenizer, prompts: Sequence[str]) -> torch.Tensor:
    """[len(prompts), layers, d], float32 on the CPU: each decoder layer's output at each prompt's last
    token, every prompt encoded alone (no padding) and run through the untouched model."""
    layers = decoder_layers(model)
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        seen.append(hidden[0, -1].detach().float().cpu())

    handles = [layer.register_forward_hook(hook) for layer in layers]
    device = next(model.parameters()).device
    states = []
    try:
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            if ids.shape[1] == 0:
                raise ValueError(f"--sign-check prompt {prompt!r} encodes to no token; give a longer prompt")
            seen.clear()
            with torch.no_grad():
                model(input_ids=ids)
            states.append(torch.stack(seen))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(states)


class SignCheck:
    """The pairs' hidden states, measured when built (``model``: a name, loaded here, or a loaded model
    with its ``tokenizer``); ``apply(bundle_dir)`` then orients that bundle's directions."""

    def __init__(self, model: str | torch.nn.Module, pairs: Sequence[Sequence[str]], tokenizer=None):
        self.pairs = check_pairs(pairs)
        if isinstance(model, str):
            from mari_eval.storage.models import load_model  # deferred: loads transformers

            model, tokenizer = load_model(model, device="cuda" if torch.cuda.is_available() else None)
        prompts = [p for pair in self.pairs for p in pair]
        states = last_token_states(model, tokenizer, prompts)
        self.differences = states[0::2] - states[1::2]  # [pairs, layers, d]: positive - negative

    def verdicts(self, directions: dict[int, torch.Tensor]) -> list[LayerSign]:
        """{layer: what is added there, up to a positive factor}: each layer's verdict (module docstring)."""
        out = []
        margin = MARGIN_SDS / math.sqrt(self.differences.shape[-1])
        for layer, direction in sorted(directions.items()):
            unit = direction.float() / direction.float().norm()
            differences = self.differences[:, layer]
            projections = differences @ unit
            cosines = projections / differences.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
            out.append(LayerSign(layer, float(projections.mean()), int((projections > 0).sum()), len(self.pairs),
                                 verdict(cosines, margin), float(cosines.mean()), margin))
        return out

    def apply(self, bundle_dir: str | Path) -> str:
        """Orient the directions of the bundle in ``bundle_dir`` (saved again when one is flipped or a
        verdict is recorded) and return the report to print."""
        bundle = load_bundle(bundle_dir)
        name = CHECKED_METHODS.get(bundle.method)
        if name is None:
            raise BundleError(f"--sign-check orients directions that a bundle adds (control vectors, lm-eval add rows); "
                              f"a {bundle.method} bundle has none: {bundle_dir} was written unchecked")
        if self.differences.shape[-1] != bundle.config["base_model"]["hidden_size"]:
            raise BundleError(f"--sign-check: the model's hidden size is {self.differences.shape[-1]}, the bundle's "
                              f"{bundle.config['base_model']['hidden_size']}: measure with the model it was imported for")
        hp = bundle.config["hyperparameters"]
        rows, skipped = {}, []
        for i, layer in enumerate(int(x) for x in hp["layers"]):
            multiplier = float(hp["strength"]) if bundle.method == "control_vector" else float(hp["coefficients"][i])
            if bundle.method == "steered_config" and hp["actions"][i] != "add":
                skipped.append(LayerSign(layer, None, 0, len(self.pairs), "skipped: a clamp sets the component along "
                                         "its unit vector to its coefficient; the coefficient's sign, not the vector's, "
                                         "says where (negating one is negating the other)"))
            elif multiplier == 0 or float(bundle.tensors[name][i].norm()) == 0:
                skipped.append(LayerSign(layer, None, 0, len(self.pairs), "skipped: it adds nothing (0)"))
            else:
                rows[layer] = (i, -1.0 if multiplier < 0 else 1.0)
        results = self.verdicts({layer: sign * bundle.tensors[name][i] for layer, (i, sign) in rows.items()})
        tensor = bundle.tensors[name].clone()
        for result in results:
            if result.verdict == "flipped":
                tensor[rows[result.layer][0]] *= -1
            elif result.verdict == "inconclusive":
                log.warning("--sign-check is inconclusive at layer %d (mean cosine %+.3f, margin %.3f; %d of %d pairs "
                            "positive; a verdict needs the margin and %d%% of the pairs on its side): its direction is "
                            "kept as imported; add pairs, or ones that contrast more", result.layer, result.mean_cosine,
                            result.margin, result.positive_pairs, result.pairs, round(100 * AGREEMENT))
        everything = sorted(results + skipped, key=lambda r: r.layer)
        bundle.tensors[name] = tensor
        bundle.config["source"]["sign_check"] = _record(self.pairs, everything)
        bundle.save(bundle_dir)
        flipped = [r.layer for r in results if r.verdict == "flipped"]
        head = (f"sign check ({len(self.pairs)} pair(s), each layer's output at the last token): "
                f"{'flipped layers ' + ', '.join(map(str, flipped)) if flipped else 'nothing flipped'}")
        return "\n".join([head] + [r.line() for r in everything])


def _record(pairs: list[tuple[str, str]], results: list[LayerSign]) -> dict[str, Any]:
    return {"pairs": [list(p) for p in pairs],
            "rule": {"min_pairs": MIN_PAIRS, "margin_sds": MARGIN_SDS, "agreement": AGREEMENT},
            "layers": [{"layer": r.layer, "verdict": r.verdict, "mean_projection": r.mean_projection,
                        "mean_cosine": r.mean_cosine, "margin": r.margin, "positive_pairs": r.positive_pairs}
                       for r in results]}
