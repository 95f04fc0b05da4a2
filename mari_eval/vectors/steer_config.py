"""lm-eval's own steering configs (``lm_eval --model steered --model_args steer_path=FILE.pt``) as bundles.

lm-eval's ``SteeredModel`` (lm_eval/models/hf_steered.py, 0.4.x) reads a ``.pt`` file holding
``{hookpoint: {"steering_vector", "steering_coefficient", "action", "bias", "head_index"}}`` and,
for every forward pass, hooks the module named ``hookpoint`` under ``model.base_model`` and edits
its output at every position:

    add:    h + c v                                   (no bias allowed)
    clamp:  u = v / |v|;  h' = h - b;  h' + u (c - u.h') + b     (b: the bias, 0 when None)

``mari-eval import-vector FILE.pt --model M --out DIR`` writes such a file as a ``steered_config``
bundle that edits the same states the same way (``site.edit_every_position`` hooks the same
decoder layers): scored through this suite's harness, its log-likelihoods equal lm-eval's
``steered`` model's (tests/test_steer_config.py). ``scale=`` multiplies every coefficient c (1:
as in the file). What lm-eval's hooks would edit that a bundle does not hold is refused with the
reason: hookpoints other than a decoder layer's output (``layers.N``), and ``head_index``, which
lm-eval applies as ``acts[:, :, head_index, :]`` and which no module of a Hugging Face decoder
outputs in that [batch, position, head, dim] shape. The file is read with
``torch.load(weights_only=True)``: tensors, numbers and strings only, never pickled code.

``FILE.csv`` is lm-eval's other input, a list of SAE features (``derive_steer_config``): each
row's steering_vector is the SAE decoder's row ``W_dec[feature_index]``, read from the SAE's
local safetensors by ``mari_eval.vectors.sae_features`` (which says how it matches lm-eval and where it
differs); the config it builds is imported as above, the SAE files' digests recorded.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from mari_eval.methods.bundle_spec import BundleError, Float, Int, List, Obj, Str, TensorSpec, check_bundle_directory
from mari_eval.vectors.control_vector import ControlVector, _model_description
from mari_eval.methods.registry import register_method
from mari_eval.storage.files import file_sha256
from mari_eval.vectors.vector_kind import check_kind

FORMAT = "lm_eval.steered"
CSV_FORMAT = "lm_eval.steered.csv"  # SAE features (mari_eval/vectors/sae_features.py)
ACTIONS = ("add", "clamp")
HOOKPOINT = re.compile(r"(?:model\.)?layers\.([0-9]+)")  # a decoder layer's output, as named under base_model


@register_method("steered_config")
class SteeredConfig(ControlVector):
    """Tensors: ``vectors`` [len(layers), d] (each hookpoint's steering_vector) and ``biases``
    [len(layers), d] (clamp's bias, zeros where none); hyperparameters: ``layers``, ``actions``
    and ``coefficients``, one each per hookpoint."""

    label = "lm-eval steered config"
    hyperparameter_fields = {"layers": List(Int(0)), "actions": List(Str(choices=ACTIONS)), "coefficients": List(Float())}
    config_fields = {"source": Obj({"format": Str(choices=(FORMAT, CSV_FORMAT)), "sha256": Str(), "file": Str(optional=True),
                                    "sae_files": List(Obj({"file": Str(), "sha256": Str()}), optional=True)})}
    added_directions = None  # a clamp is not a direction to add: not written as a GGUF control vector

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, checked: bool = False):
        super().__init__(config, tensors, checked=checked)
        hp = config["hyperparameters"]
        if not len(hp["layers"]) == len(hp["actions"]) == len(hp["coefficients"]):
            raise BundleError("bundle.json: hyperparameters.layers, actions and coefficients must have one entry per "
                              "hookpoint; the bundle was edited by hand: import the file again")

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        sizes = {"hidden_size": config["base_model"]["hidden_size"], "layers": len(config["hyperparameters"]["layers"])}
        return sizes, {"vectors": TensorSpec(("layers", "hidden_size")), "biases": TensorSpec(("layers", "hidden_size"))}

    def applied(self, model: torch.nn.Module, positions=None, variant_ids: torch.Tensor | None = None):
        """Each hookpoint's add or clamp after its layer, where ``positions=`` says (by default at every
        position, as lm-eval's hooks), only the layers ``layers=`` keeps."""
        hp = self.config["hyperparameters"]

        def edit_of_row(i: int):
            edit, coefficient = (_add if hp["actions"][i] == "add" else _clamp), float(hp["coefficients"][i])
            return lambda h: edit(h, self.tensors_like(h), i, coefficient * self.scale)

        return self.edits(model, edit_of_row, positions)

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        hp = self.config["hyperparameters"]
        return {"method": self.method, "scale": self.scale, "hookpoints": [
            {"layer": layer, "action": action, "coefficient": c} for layer, action, c in
            zip(self.layers, hp["actions"], hp["coefficients"])]}


def _add(hidden: torch.Tensor, tensors: dict[str, torch.Tensor], i: int, coefficient: float) -> torch.Tensor:
    return hidden + tensors["vectors"][i] * coefficient


def _clamp(hidden: torch.Tensor, tensors: dict[str, torch.Tensor], i: int, value: float) -> torch.Tensor:
    vector, bias = tensors["vectors"][i], tensors["biases"][i]
    direction = vector / torch.norm(vector)
    centred = hidden - bias
    projection = (centred * direction).sum(-1, keepdim=True)
    return centred + direction * (value - projection) + bias


# -- reading lm-eval's file ------------------------------------------------------------------


def read_steer_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """The config in an lm-eval steering ``.pt`` file, loaded with weights_only=True (no code runs)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (an lm-eval steering config, FILE.pt)")
    try:
        config = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle and zip errors of every kind: named with the file
        raise BundleError(f"{path} is not a steering config torch.load can read with weights_only=True (tensors, "
                          f"numbers and strings only: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                          "Save it as lm-eval documents: torch.save({hookpoint: {...}}, FILE.pt)") from None
    if not isinstance(config, dict) or not config:
        raise BundleError(f"{path} holds a {type(config).__name__}, not lm-eval's {{hookpoint: {{steering_vector, "
                          "steering_coefficient, action, bias, head_index}}}} dict")
    return config


def _entry(path: Path, hookpoint: Any, entry: Any, n_layers: int) -> tuple[int, str, torch.Tensor, float, torch.Tensor | None]:
    """(layer, action, vector, coefficient, bias) of one hookpoint, or a BundleError saying why not."""
    where = f"{path}: hookpoint {hookpoint!r}"
    match = HOOKPOINT.fullmatch(hookpoint) if isinstance(hookpoint, str) else None
    if match is None:
        raise BundleError(f"{where}: only a decoder layer's output (layers.N under the model's base_model, as lm-eval "
                          "names it) can be a bundle's site; steer that module, or use lm-eval's steered model directly")
    layer = int(match.group(1))
    if not 0 <= layer < n_layers:
        raise BundleError(f"{where}: the model has decoder layers 0..{n_layers - 1}")
    if not isinstance(entry, dict) or "steering_vector" not in entry or "action" not in entry:
        raise BundleError(f"{where}: needs a dict with steering_vector and action (lm-eval's format)")
    action = entry["action"]
    if action not in ACTIONS:
        raise BundleError(f"{where}: action {action!r} is neither add nor clamp (the two lm-eval applies)")
    if entry.get("head_index") is not None:
        raise BundleError(f"{where}: head_index {entry['head_index']!r}: lm-eval edits acts[:, :, head_index, :], and "
                          "no module of a Hugging Face decoder outputs that [batch, position, head, dim] shape at a "
                          "decoder layer; steer the whole layer (head_index None)")
    vector, bias = entry["steering_vector"], entry.get("bias")
    coefficient = entry.get("steering_coefficient", 1.0)
    if not torch.is_tensor(vector) or not (bias is None or torch.is_tensor(bias)):
        raise BundleError(f"{where}: steering_vector and bias must be tensors")
    for what, tensor in (("steering_vector", vector), ("bias", bias), ("steering_coefficient", coefficient)):
        if torch.is_tensor(tensor):  # complex, sparse, integer, boolean: refused (vector_kind.py)
            check_kind(tensor, f"{where}: {what}")
    if torch.is_tensor(coefficient) and coefficient.numel() != 1:
        raise BundleError(f"{where}: steering_coefficient is a tensor of {coefficient.numel()} values; give one number")
    if action == "add" and bias is not None:
        raise BundleError(f"{where}: a bias with action add (lm-eval refuses it too)")
    if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float, torch.Tensor)):
        raise BundleError(f"{where}: steering_coefficient {coefficient!r} is not a number")
    coefficient = float(coefficient)
    if not torch.isfinite(torch.tensor(coefficient)) or not torch.isfinite(vector).all() or \
            (bias is not None and not torch.isfinite(bias).all()):
        raise BundleError(f"{where}: non-finite steering_vector, bias or coefficient: every score would be NaN")
    if action == "clamp" and float(torch.norm(vector.float())) == 0.0:
        raise BundleError(f"{where}: a clamp's steering_vector of norm 0 has no direction")
    return layer, action, vector, coefficient, bias


def import_steer_file(path: str | Path, model: str | torch.nn.Module, out: str | Path) -> Path:
    """``mari-eval import-vector FILE.pt`` (or ``FILE.csv``, SAE features): lm-eval's steering config
    at ``path`` as a bundle for ``model``, saved to ``out``."""
    check_bundle_directory(out)
    path = Path(path)
    name, hidden, n_layers, _ = _model_description(model)
    source: dict[str, Any] = {"format": FORMAT}
    if path.suffix.lower() == ".csv":
        from mari_eval.vectors.sae_features import read_sae_csv  # deferred: only an SAE CSV needs it

        config, sae_files = read_sae_csv(path, hidden)
        source = {"format": CSV_FORMAT, "sae_files": sae_files}
    else:
        config = read_steer_file(path)
    entries = sorted((_entry(path, hookpoint, entry, n_layers) for hookpoint, entry in config.items()), key=lambda e: e[0])
    layers = [e[0] for e in entries]
    if len(set(layers)) != len(layers):
        raise BundleError(f"{path}: two hookpoints name one decoder layer (layers.N and model.layers.N): keep one")
    for layer, _, vector, _, bias in entries:
        for what, tensor in (("steering_vector", vector), ("bias", bias)):
            if tensor is not None and tensor.numel() != hidden:
                raise BundleError(f"{path}: layers.{layer}'s {what} has {tensor.numel()} values, {name!r}'s hidden size "
                                  f"is {hidden}: it was made for another model")
    vectors = torch.stack([e[2].float().reshape(-1) for e in entries]).contiguous()
    biases = torch.stack([torch.zeros(hidden) if e[4] is None else e[4].float().reshape(-1) for e in entries]).contiguous()
    bundle_config = {"base_model": {"name": name, "hidden_size": hidden, "num_layers": n_layers},
                     "site": {"layer": layers[0], "position": "every position (prompt, options, generated tokens) after each layer"},
                     "hyperparameters": {"layers": layers, "actions": [e[1] for e in entries],
                                         "coefficients": [e[3] for e in entries]},
                     "source": {**source, "file": path.name, "sha256": file_sha256(path)},
                     "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return SteeredConfig(bundle_config, {"vectors": vectors, "biases": biases}).save(out)
