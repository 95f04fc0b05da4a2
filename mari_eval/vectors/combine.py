"""``mari-eval combine A.gguf:1 B:-0.5 --out C``: several steering vectors summed, with weights, into one
control-vector bundle (issue 57.3).

A term is a GGUF control vector (``.gguf``: repeng, llama.cpp) or a bundle directory whose method adds
fixed directions after decoder layers (``added_directions``: CAA, a control vector), with an optional
weight after the last colon (default 1). The bundle adds, after each layer any term names,

    sum over terms of weight x that term's direction at the layer (at scale=1)

at every position, as llama.cpp applies a control vector (``positions=from_last`` at evaluation gives
CAA's own place; mari_eval/vectors/edit_positions.py). The terms must be made for one model: their widths
must agree with it, and GGUF model hints with each other (``control_vector.build`` checks the model).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from mari_eval.methods.bundle_spec import BundleError, check_bundle_directory
from mari_eval.storage.numbers import meant_as_number, read_number
from mari_eval.methods.bundles import load_bundle
from mari_eval.vectors.control_vector import COMBINED_FORMAT, _family, build, bundle_directions
from mari_eval.vectors.control_vector_files import read_gguf


def parse_term(text: str) -> tuple[str, float]:
    """"PATH:W" as (PATH, W); "PATH" (or a PATH whose last colon is not followed by a number, "C:/dir") as
    (PATH, 1). A weight is read by ``numbers.read_number``: "caa:1_0" or "caa:٢" is refused, never 10 or 2."""
    path, sep, weight = str(text).rpartition(":")
    if sep and meant_as_number(weight):
        return path, read_number(weight, f"combine {text!r}: the weight",
                                 example=f"{path}:0.5")
    return str(text), 1.0


def _term(path: str) -> tuple[dict[int, torch.Tensor], str | None, str | None]:
    """(directions at scale 1, the base model a bundle names or None, a GGUF's model hint or None)."""
    if Path(path).suffix.lower() == ".gguf":
        vector = read_gguf(path)
        return vector.directions, None, vector.model_hint
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: neither a .gguf control vector nor a bundle directory")
    bundle = load_bundle(path)
    return bundle_directions(bundle), str(bundle.config["base_model"]["name"]), None


def combine(terms: list[str], out: str | Path, model: str | None = None) -> Path:
    """The bundle adding the weighted sum of ``terms`` ("PATH[:W]"), saved to ``out``, for ``model``
    (default: the base model of the first bundle among the terms; GGUF files alone need it)."""
    if not terms:
        raise ValueError("give at least one term: PATH[:WEIGHT], a .gguf control vector or a bundle directory")
    check_bundle_directory(out)
    total: dict[int, torch.Tensor] = {}
    models, hints, described = [], set(), []
    parsed = [parse_term(text) for text in terms]  # every weight read before any file
    for path, weight in parsed:
        directions, base, hint = _term(path)
        models += [base] if base else []
        hints |= {_family(hint)} if hint else set()
        for layer, vector in directions.items():
            vector = vector.float().reshape(-1)
            if layer in total and total[layer].numel() != vector.numel():
                raise BundleError(f"{path}: its direction at layer {layer} has {vector.numel()} values, an earlier "
                                  f"term's {total[layer].numel()}: the terms were made for different models")
            if not bool(torch.isfinite(vector).all()):
                raise BundleError(f"{path}: its direction at layer {layer} holds non-finite values (NaN or infinite): "
                                  "the vector is damaged; make or export it again")
            total[layer] = total.get(layer, torch.zeros_like(vector)) + weight * vector
        described.append(f"{weight:g} x {Path(path).name}")
    for layer, vector in total.items():  # every term is finite (above): only the weighted sum can overflow
        if not bool(torch.isfinite(vector).all()):
            raise BundleError(f"combine: the weighted sum {' + '.join(described)} overflows float32 at layer {layer} "
                              f"(beyond {torch.finfo(torch.float32).max:.3g}); lower the weights, e.g. "
                              f"{' '.join(f'{path}:1' for path, _ in parsed)}")
    if len(hints) > 1:
        raise BundleError(f"the GGUF terms name models of different families ({', '.join(sorted(hints))}): combine "
                          "vectors made for one model")
    if model is None:
        if not models:
            raise ValueError("every term is a .gguf file: give the model the vectors steer with --model")
        model = models[0]
    digest = hashlib.sha256()
    for layer in sorted(total):
        digest.update(f"{layer}:".encode() + total[layer].numpy().tobytes())
    source = {"format": COMBINED_FORMAT, "file": " + ".join(described), "sha256": digest.hexdigest(),
              "model_hint": next(iter(hints)) if hints else None}
    return build(total, model, source, where="the combined vector").save(out)
