"""Control vectors: steering vectors made elsewhere (repeng, llama.cpp, steering-vectors), scored as bundles.

A ``control_vector`` bundle holds one direction per layer and adds it, times a strength, to the
residual stream at the output of each of its layers, at every position of every forward pass:
the prompt's tokens, the options' and the generated ones, as llama.cpp applies a control vector.
``scale=`` in lm-eval's ``--model_args`` multiplies the strength at evaluation (1: as imported,
0: the untouched model, -1: the vector reversed). It is not trained: ``mari-eval import-vector
FILE.gguf --model M --out DIR [--scale S]`` (``import_gguf``) or, from Python,
``from_steering_vector(vector, model, out)`` writes one. ``mari-eval export-vector BUNDLE FILE.gguf``
(``export_gguf``) goes the other way: a bundle whose method adds fixed directions to decoder layers'
outputs (``added_directions``: ``control_vector`` itself, CAA) written as a GGUF control vector.

How layers are numbered, read from the sources:

* llama.cpp: ``direction.N`` (N >= 1) is added to the output of decoder layer N, counted from 0,
  i.e. ``model.model.layers[N]`` of Hugging Face, ``output_hidden_states[N + 1]``.
  ``common_control_vector_load_one`` (common/common.cpp) stores ``direction.N`` at row N - 1 of
  its buffer and refuses N = 0; ``llama_adapter_cvec::apply`` (src/llama-adapter.cpp) fills the
  tensor of layer ``il`` from row ``il - 1``, for il = 1 .. n_layer - 1 (layer 0 never has one, a
  row beyond the model's layers is dropped); ``llama_adapter_cvec::apply_to`` adds that tensor
  where each model's graph calls ``build_cvec(cur, il)`` (src/models/*.cpp): after the
  feed-forward residual add, on the tensor named ``l_out``, the layer's output, for every token
  of every batch. Here N = 0 is refused as llama.cpp does, and a layer the model lacks is refused
  rather than dropped.
* repeng: ``ControlVector.directions[i]`` is read from ``hidden_states[i + 1]``
  (``batched_get_hiddens``, repeng/extract.py) and added by the ``ControlModule`` wrapping
  ``model_layer_list(model)[i]`` (repeng/control.py), i.e. the output of ``model.model.layers[i]``;
  ``export_gguf`` writes it as ``direction.i`` unchanged, so repeng's and llama.cpp's numbers
  agree (repeng's default layers are 1 .. L - 1, never 0). repeng leaves left padding unedited,
  which changes no score. For the last layer, transformers' ``hidden_states[L]`` is taken after the
  final norm, so repeng reads that direction after the norm and adds it before; the numbering holds.
* llama-cvector-generator (tools/cvector-generator) names the direction it reads at ``l_out`` of
  layer il ``direction.(il + 1)`` (mean.hpp, pca.hpp), so llama.cpp adds its vectors one layer
  above where they were read; they are imported as llama.cpp applies them.
* steering-vectors (``SteeringVector``, layer_type "decoder_block"): ``layer_activations[i]`` is
  added by a forward hook on the i-th decoder block, ``model.model.layers[i]`` (a negative i counts
  from the end); ``apply``/``patch_activations`` default to every position (``min_token_index``
  0, generated tokens included) and to plain addition (no ``operator``), as llama.cpp. What differs:
  ``min_token_index``, ``token_indices`` and ``operator`` are arguments of ``apply``, not part of
  the vector, so a bundle always adds at every position; layer 0 is allowed (it is a layer there).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mari_eval.injection import site
from mari_eval.methods.bundle_spec import BundleError, Float, Int, List, Obj, Str, TensorSpec, check_bundle_directory
from mari_eval.methods.bundles import load_bundle
from mari_eval.vectors.control_vector_files import GGUF_FORMAT, read_gguf, write_gguf
from mari_eval.vectors.edit_positions import POSITIONS_OPTION, EditPositions, parse_layers
from mari_eval.vectors.vector_kind import check_kind
from mari_eval.storage.numbers import NumberError, read_number
from mari_eval.methods.intervention import Intervention
from mari_eval.methods.options import Option
from mari_eval.injection.plan import Plan
from mari_eval.methods.registry import register_method

log = logging.getLogger(__name__)

STEERING_VECTOR_FORMAT = "steering_vectors.SteeringVector"
COMBINED_FORMAT = "combined"  # `mari-eval combine`: a weighted sum of vectors (mari_eval/vectors/combine.py)
EVERY_POSITION = "every position"  # llama.cpp's: the prompt's tokens, the options' and the generated ones
# The built-in methods whose class defines ``added_directions`` (a test checks the list): what
# ``export_gguf`` can write. A plugin's method is exportable when its class defines it too.
EXPORTABLE_METHODS = ("caa", "control_vector")
IMPORT_HINT = ("control vectors are imported, not trained: `mari-eval import-vector FILE.gguf --model M --out DIR`, "
               "or mari_eval.vectors.control_vector.from_steering_vector(vector, model, out) from Python")


@register_method("control_vector")
class ControlVector(Intervention):
    """Tensors: ``directions`` [len(layers), d], row i added after layer ``hyperparameters.layers[i]``
    times ``hyperparameters.strength`` (the import's ``--scale``) times ``scale=``."""

    label = "Control vector"
    hyperparameter_fields = {"layers": List(Int(0)), "strength": Float()}
    config_fields = {"source": Obj({"format": Str(choices=(GGUF_FORMAT, STEERING_VECTOR_FORMAT, COMBINED_FORMAT)),
                                    "sha256": Str(),
                                    "file": Str(optional=True), "model_hint": Str(optional=True)})}
    option_fields: ClassVar[dict[str, Option]] = {
        "scale": Option(float, "scale=2 (0: no edit, -1: the vector reversed)", finite=True),
        "positions": POSITIONS_OPTION,
        "layers": Option(str, "layers=10-14 (only its directions there)")}
    scale: float = 1.0
    where: EditPositions = EditPositions("all")  # llama.cpp's; positions= at evaluation
    kept_layers: tuple[int, ...] | None = None  # layers= at evaluation: the layers whose directions are applied
    added_positions: ClassVar[str] = EVERY_POSITION  # where ``added_directions`` are added (``export_gguf``)

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, checked: bool = False):
        super().__init__(config, tensors, checked=checked)
        layers, n = self.layers, config["base_model"]["num_layers"]
        if not layers or layers != sorted(set(layers)) or layers[-1] >= n or self.layer != layers[0]:
            raise BundleError(f"bundle.json: hyperparameters.layers {layers} must be increasing layers of the model's "
                              f"0..{n - 1}, the lowest one site.layer ({self.layer}); the bundle was edited by hand: "
                              "import the vector again with `mari-eval import-vector`")

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        sizes = {"hidden_size": config["base_model"]["hidden_size"], "layers": len(config["hyperparameters"]["layers"])}
        return sizes, {"directions": TensorSpec(("layers", "hidden_size"))}

    @property
    def layers(self) -> list[int]:
        return [int(layer) for layer in self.config["hyperparameters"]["layers"]]

    def configure(self, scale: float = 1.0, positions: str | None = None, layers: str | None = None) -> None:
        self.scale = float(scale)
        self.where = EditPositions.parse(positions) if positions is not None else EditPositions("all")
        self.kept_layers = None
        if layers is not None:
            wanted = set(parse_layers(layers, int(self.config["base_model"]["num_layers"])))
            self.kept_layers = tuple(layer for layer in self.layers if layer in wanted)
            if not self.kept_layers:
                raise ValueError(f"layers={layers} in --model_args: this bundle has directions at layers {self.layers} "
                                 "only; give a range that holds some of them")

    def applied_layers(self) -> list[tuple[int, int]]:
        """(row of the tensors, layer) of every direction applied (``layers=`` keeps a range of them)."""
        return [(i, layer) for i, layer in enumerate(self.layers) if self.kept_layers is None or layer in self.kept_layers]

    def strength(self) -> float:
        """What the directions are multiplied by: the imported strength times ``scale=``."""
        return float(self.config["hyperparameters"]["strength"]) * self.scale

    def added_directions(self) -> dict[int, torch.Tensor]:
        """{layer: what is added to its output at ``scale=1``}: each direction times the strength, as ``applied``
        adds it (float32)."""
        strength = float(self.config["hyperparameters"]["strength"])
        return {layer: strength * self.tensors["directions"][i].float() for i, layer in enumerate(self.layers)}

    def applied(self, model: torch.nn.Module, positions=None, variant_ids: torch.Tensor | None = None):
        """Every direction added after its layer where ``positions=`` says (by default at every position;
        ``variant_ids`` is not read: the plan's one variant edits every row)."""
        return self.edits(model, lambda i: (lambda h: h + self.strength() * self.tensors_like(h)["directions"][i]),
                          positions)

    def edits(self, model: torch.nn.Module, edit_of_row, positions=None) -> contextlib.AbstractContextManager:
        """``edit_of_row(i)`` after the layer of each applied row i: at every position of every pass
        (llama.cpp's way) unless ``positions=`` chose another rule (mari_eval/vectors/edit_positions.py)."""
        rows = dict((layer, i) for i, layer in self.applied_layers())
        return self.where.applied(model, list(rows), lambda layer: edit_of_row(rows[layer]), positions)

    def plan(self, model: torch.nn.Module) -> Plan:
        """One edit that also replaces the prompt positions before p* its rule covers (``prompt_sites``;
        by default all of them): the runner encodes each prompt under it instead of sharing the frozen prefix."""
        return Plan((0,), lambda variant_ids, positions: self.applied(model, positions, variant_ids), self.choose,
                    prompt_sites=self.prompt_sites)

    def prompt_sites(self, length: int) -> list[int]:
        return self.where.prompt_sites(length)

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {**super().summarize(records), "scale": self.scale,
                "strength": float(self.config["hyperparameters"]["strength"]), "applied_strength": self.strength()}

    @classmethod
    def training_hyperparameters(cls, given: dict[str, Any], max_pca: int | None = None) -> dict[str, Any]:
        raise ValueError(f"{cls.label}: {IMPORT_HINT}")

    @classmethod
    def fit(cls, session, data, config: dict[str, Any], hyperparameters: dict[str, Any], seed: int) -> Intervention:
        raise ValueError(f"{cls.label}: {IMPORT_HINT}")


# -- building a bundle ------------------------------------------------------------------------


def _model_description(model: str | torch.nn.Module) -> tuple[str, int, int, str]:
    """(name, hidden size, decoder layers, Hugging Face model_type) of a model or a model name
    (an embedded alias, Hub id or directory: its config alone is read)."""
    if isinstance(model, str):
        from transformers import AutoConfig  # deferred: heavy, and only importing a vector needs it

        from mari_eval.storage.models import resolve_model  # deferred: loads the embedded models' table

        config = AutoConfig.from_pretrained(resolve_model(model))
        return model, int(config.get_text_config().hidden_size), int(config.get_text_config().num_hidden_layers), \
            str(config.model_type)
    name = getattr(model, "name_or_path", "") or type(model).__name__
    return name, int(model.config.get_text_config().hidden_size), site.num_layers(model), str(model.config.model_type)


def _family(architecture: str) -> str:
    """An architecture name as llama.cpp and Hugging Face both spell it: llama.cpp's GGUF converts
    Mistral as "llama"; Hugging Face's text-only Gemma 3 is "gemma3_text", llama.cpp's "gemma3"."""
    name = architecture.strip().lower().removesuffix("_text")
    return {"mistral": "llama"}.get(name, name)


def build(directions: dict[int, torch.Tensor], model: str | torch.nn.Module, source: dict[str, Any],
          strength: float = 1.0, allow_other_model: bool = False, where: str = "the vector") -> ControlVector:
    """The bundle adding ``directions`` ({layer: [d]}) to ``model``, checked against it (refusals
    name the problem and the fix); ``source``: its provenance (format, sha256, file, model_hint)."""
    name, hidden, n_layers, model_type = _model_description(model)
    if not isinstance(strength, (int, float)) or not torch.isfinite(torch.tensor(float(strength))):
        raise ValueError(f"--scale {strength!r} is not a finite number: give e.g. --scale 2 (or leave it out for 1)")
    hint = source.get("model_hint")
    if hint and _family(hint) != _family(model_type):
        message = (f"{where} was made for a {hint!r} model (its model hint), not for {name!r} ({model_type!r}): its "
                   f"directions would steer other weights' states")
        if not allow_other_model:
            raise BundleError(f"{message}. Import it with --model naming a {hint} model, or pass --allow-other-model "
                              "if the architectures do match")
        log.warning("%s; imported anyway (--allow-other-model)", message)
    if not directions:
        raise BundleError(f"{where} holds no direction at any layer: there is nothing to add. Make it again with at "
                          "least one layer (a SteeringVector: train_steering_vector(..., layers=[...]))")
    layers = sorted(directions)
    for layer in layers:
        vector = directions[layer]
        if not 0 <= layer < n_layers:
            raise BundleError(f"{where}: layer {layer} is beyond {name!r}'s {n_layers} decoder layers (0..{n_layers - 1}): "
                              "it was made for a deeper model; import it with --model naming that model")
        if vector.ndim != 1 or vector.numel() != hidden:
            raise BundleError(f"{where}: the direction of layer {layer} has {vector.numel()} values, but {name!r}'s "
                              f"hidden size is {hidden}: it was made for another model; import it with --model naming "
                              "the model it was made for")
        bad = int((~torch.isfinite(vector)).sum())
        if bad:
            raise BundleError(f"{where}: the direction of layer {layer} holds {bad} non-finite value(s) (NaN or "
                              "infinite); every score would be NaN. The vector is damaged: make or export it again")
    stacked = torch.stack([directions[layer].float().reshape(-1) for layer in layers]).contiguous()
    config = {"base_model": {"name": name, "hidden_size": hidden, "num_layers": n_layers},
              "site": {"layer": layers[0], "position": "every position (prompt, options, generated tokens) after each layer"},
              "hyperparameters": {"layers": layers, "strength": float(strength)},
              "source": {k: v for k, v in source.items() if v is not None},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return ControlVector(config, {"directions": stacked})


def import_gguf(path: str | Path, model: str | torch.nn.Module, out: str | Path, scale: float = 1.0,
                allow_other_model: bool = False) -> Path:
    """``mari-eval import-vector``: the GGUF control vector at ``path`` as a bundle for ``model``,
    saved to ``out`` (a directory holding other files is refused before anything is read)."""
    check_bundle_directory(out)
    vector = read_gguf(path)
    source = {"format": GGUF_FORMAT, "file": vector.file, "sha256": vector.sha256, "model_hint": vector.model_hint}
    return build(vector.directions, model, source, scale, allow_other_model, where=str(path)).save(out)


def _layer_key(key: Any, n_layers: int) -> int | None:
    """A SteeringVector's layer key, an int (as steering-vectors indexes layers: not a float, which int() would
    truncate, nor a string or a bool) read by ``numbers.read_number`` in -n_layers .. n_layers - 1; else None."""
    try:
        return read_number(key, integer=True, lo=-n_layers, hi=n_layers - 1) if isinstance(key, int) else None
    except NumberError:  # a bool, or out of range
        return None


def from_steering_vector(vector, model_name_or_model: str | torch.nn.Module, out: str | Path, scale: float = 1.0) -> Path:
    """A ``steering_vectors.SteeringVector`` (layer_type "decoder_block") as a bundle for the model,
    saved to ``out``: its ``layer_activations[i]`` is added after ``model.model.layers[i]``, at
    every position, times ``scale`` (its ``multiplier``)."""
    check_bundle_directory(out)
    layer_type = getattr(vector, "layer_type", None)
    activations = getattr(vector, "layer_activations", None)
    if not isinstance(activations, dict):
        raise TypeError(f"{type(vector).__name__} is not a steering_vectors.SteeringVector (no layer_activations dict)")
    if layer_type != "decoder_block":
        raise BundleError(f"this SteeringVector steers {layer_type!r} layers; a control vector bundle adds to the "
                          "decoder blocks' outputs only: train it with layer_type='decoder_block'")
    n_layers = _model_description(model_name_or_model)[2]
    layers = {key: _layer_key(key, n_layers) for key in activations}
    bad = [key for key, layer in layers.items() if layer is None]
    if bad:
        raise BundleError(f"this SteeringVector's layer_activations has key(s) {bad!r}: a layer is an integer from "
                          f"{-n_layers} to {n_layers - 1} for this model of {n_layers} decoder layers")
    directions = {(layers[i] + n_layers if layers[i] < 0 else layers[i]):
                  check_kind(t, f"this SteeringVector's layer_activations[{i!r}]").detach().float().cpu().reshape(-1)
                  for i, t in activations.items()}
    if len(directions) != len(activations):
        raise BundleError("this SteeringVector names one layer twice (once counted from the end): keep one of them")
    digest = hashlib.sha256()
    for layer in sorted(directions):
        digest.update(f"{layer}:".encode() + directions[layer].numpy().tobytes())
    source = {"format": STEERING_VECTOR_FORMAT, "sha256": digest.hexdigest()}
    return build(directions, model_name_or_model, source, scale, where="the SteeringVector").save(out)


# -- exporting a bundle ----------------------------------------------------------------------


@dataclass(frozen=True)
class ExportedVector:
    """What ``export_gguf`` wrote: the file, its layers (llama.cpp's N of ``direction.N``), the model
    hint, the bundle's method and where that method adds the directions (``added_positions``)."""

    path: Path
    layers: list[int]
    model_hint: str
    method: str
    positions: str


def bundle_directions(bundle: Intervention) -> dict[int, torch.Tensor]:
    """{layer: the direction ``bundle`` adds to that decoder layer's output at ``scale=1``}, for a method
    that adds fixed directions there (its class defines ``added_directions``); any other is refused."""
    added = getattr(bundle, "added_directions", None)
    if not callable(added):
        raise BundleError(f"method {bundle.method!r} ({bundle.label}) cannot be exported as a control vector: it "
                          "does not add fixed directions to decoder layers' outputs (a control vector is one direction "
                          f"per layer, added to every token). Methods that can be: {', '.join(EXPORTABLE_METHODS)} "
                          "(and a plugin method whose class defines added_directions())")
    directions = {int(layer): vector.detach().float().cpu() for layer, vector in added().items()}
    if 0 in directions:
        raise BundleError(f"this {bundle.label} bundle adds its direction to the output of decoder layer 0, which "
                          "would be direction.0: llama.cpp cannot load it (its control vectors start at direction.1, "
                          "common_control_vector_load_one refuses layer 0). Train the bundle at a layer of 1 or more "
                          "(CAA: mari-eval train --method caa --set 'layers=[...]' with layers >= 1)")
    return directions


def _bundle_model_hint(bundle: Intervention) -> str:
    """The model hint to write: an imported vector's own, else the Hugging Face model_type of the
    bundle's base model, read from its config (``_model_description``)."""
    hint = bundle.config.get("source", {}).get("model_hint") if bundle.method == "control_vector" else None
    if hint:
        return str(hint)
    name = str(bundle.config["base_model"]["name"])
    try:
        return _model_description(name)[3]
    except (OSError, ValueError, KeyError) as e:
        raise BundleError(f"the model hint (the Hugging Face model_type of the bundle's base model {name!r}) cannot "
                          f"be read: its config does not load here ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}). "
                          "Give it with --model-hint, e.g. --model-hint llama") from None


def export_gguf(bundle_dir: str | Path, path: str | Path, model_hint: str | None = None,
                force: bool = False) -> ExportedVector:
    """``mari-eval export-vector``: the bundle in ``bundle_dir`` written as the GGUF control vector
    ``path``, ``direction.N`` being what the bundle adds to the output of decoder layer N (llama.cpp's
    numbering, module docstring) at ``scale=1``. ``model_hint``: default, the base model's model_type.
    llama.cpp adds it at every position; a CAA bundle adds it from the last prompt token on."""
    bundle = load_bundle(bundle_dir)
    directions = bundle_directions(bundle)
    hint = model_hint if model_hint is not None else _bundle_model_hint(bundle)
    written = write_gguf(path, directions, hint, force=force)
    positions = getattr(bundle, "added_positions", None) or f"the positions {bundle.label} edits"
    return ExportedVector(written, sorted(directions), hint.strip(), bundle.method, positions)
