"""pyreft's saved interventions (``ReftModel.save(DIR)``) as ``reft`` bundles.

The source format (pyreft 0.1.0 over pyvene 0.1.8, ``IntervenableModel.save``) is a folder of

* ``config.json``: a transformers ``PretrainedConfig`` whose ``representations`` hold one entry
  per intervention, pyvene's ``RepresentationConfig`` written as a JSON list in its field order
  (``REPRESENTATION_FIELDS``) or as an object, and ``intervention_types`` the class of each
  (``"<class 'pyreft.interventions.LoreftIntervention'>"``);
* ``intkey_<key>.bin`` per intervention: ``torch.save`` of its state dict, where ``<key>`` is
  ``layer_<L>_comp_<component>_unit_<unit>_nunit_<n>#<k>``, ``k`` counting earlier entries with the
  same head (pyvene derives the keys from ``representations`` again when it loads, as ``_keys`` does).

The edit (Wu et al. 2024, "ReFT: Representation Finetuning for Language Models", eq. 2), on the
hidden state h at the chosen positions:

    LoReFT  Phi(h) = h + R^T (W h + b - R h)        state dict: weight = W [r, d], bias = b [r],
                                                   rotate_layer = R^T [d, r] (orthonormal columns)
    NoReFT  Phi(h) = h + P^T (W h + b - (P h + c))  learned_source.weight/bias = W, b;
                                                   proj_layer.weight = P, proj_layer.bias = c (if any)

Both are ``baselines.loreft.loreft(h, R, W, b)``, NoReFT with R = P and b - c for b, so the result
is a ``reft`` bundle of the published form (``hyperparameters.layers``, one R, W, b per layer;
ranks padded with zero rows, which add nothing; ``recipe: imported``: not trained here, edited
at pyreft's positions as the published recipe is) that the harness scores like a trained one, with its source recorded.

Where: ``block_output`` of layer L is the output of decoder layer L (pyvene hooks
``layers[L]``'s output), the state ``site.edit_site`` edits. Which positions is not saved (pyreft's
data module chooses them), so it is an argument, in pyreft's notation: ``fN+lM``, the first N and
last M prompt tokens, each count capped at half the prompt as ``get_intervention_locations`` does
with ``last_position`` = the prompt's length (so the last prompt token, p*, is edited), one
intervention per layer at all of them (pyreft's ``share_weights``); default ``DEFAULT_POSITIONS``,
the ReFT baseline's published recipe. Generated tokens are not edited (pyreft's
``intervene_on_prompt``).

Read as tensors only: ``torch.load(weights_only=True)`` (or safetensors), never pickled code.
Refused with the fix: other intervention classes, components other than ``block_output``, units
other than one position, two interventions at one layer (pyreft without ``share_weights`` edits
the first and the last positions with different ones), layers or a hidden size that ``--model``
lacks (the save names no model, so its sizes are what is checked), positions without a last
token, missing or unreadable files. Assumed, as pyvene's own ``load`` assumes: ``act_fn`` linear
(the save does not record it). Not applied: dropout (inference). Differs: a one-token prompt,
where pyreft's cap leaves no position, still has p* edited here.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from mari_eval.methods.bundle_spec import BundleError, check_bundle_directory
from mari_eval.storage.files import file_sha256
from mari_eval.vectors.control_vector import _model_description
from mari_eval.vectors.vector_kind import check_kind

FORMAT = "pyreft"
CONFIG = "config.json"
DEFAULT_POSITIONS = "f7+l7"  # baselines/reft_published.py PUBLISHED first, last (pyreft's commonsense runs)
REPRESENTATION_FIELDS = ("layer", "component", "unit", "max_number_of_units", "low_rank_dimension",
                         "intervention_type", "intervention", "subspace_partition", "group_key",
                         "intervention_link_key", "moe_key", "source_representation",
                         "hidden_source_representation", "latent_dim")
REPRESENTATION_DEFAULTS = {"layer": 0, "component": "block_output", "unit": "pos", "max_number_of_units": 1}
SUPPORTED = ("LoreftIntervention", "NoreftIntervention")
POSITIONS = re.compile(r"(?:f([0-9]+)\+)?l([0-9]+)|f([0-9]+)")
CLASS_NAME = re.compile(r"<class '([A-Za-z0-9_.]+)'>|([A-Za-z0-9_.]+)")


def parse_positions(text: str) -> tuple[int, int]:
    """(first, last) of pyreft's ``fN+lM`` (or ``lM``); the last count must be at least 1, since the
    harness always edits the last prompt token."""
    match = POSITIONS.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise BundleError(f"--positions {text!r}: give pyreft's notation fN+lM (the first N and last M prompt "
                          f"tokens, e.g. {DEFAULT_POSITIONS}) or lM")
    first, last = int(match.group(1) or match.group(3) or 0), int(match.group(2) or 0)
    if last < 1:
        raise BundleError(f"--positions {text!r}: a bundle always edits the last prompt token, so give lM with M at "
                          f"least 1 (e.g. f{first}+l1)")
    return first, last


def read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise BundleError(f"{folder}: no such folder (the directory pyreft's ReftModel.save wrote)")
    path = folder / CONFIG
    if not path.is_file():
        raise BundleError(f"{path} is missing: {folder} is not a pyreft save; save the model with "
                          "reft_model.save(DIR) and pass DIR")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path} is not JSON ({e}); save the model again with reft_model.save(DIR)") from None
    if not isinstance(config, dict) or not isinstance(config.get("representations"), list) \
            or not config["representations"]:
        raise BundleError(f"{path} has no representations list: it is not a pyreft/pyvene intervention config")
    return config


def _representation(path: Path, i: int, entry: Any) -> dict[str, Any]:
    if isinstance(entry, list) and len(entry) <= len(REPRESENTATION_FIELDS):
        entry = dict(zip(REPRESENTATION_FIELDS, entry))
    if not isinstance(entry, dict):
        raise BundleError(f"{path}: representations[{i}] is not pyvene's RepresentationConfig (a list of at most "
                          f"{len(REPRESENTATION_FIELDS)} fields, or an object); save it with pyvene 0.1.8")
    return {**REPRESENTATION_DEFAULTS, **{k: v for k, v in entry.items() if v is not None}}


def _keys(representations: list[dict[str, Any]]) -> list[str]:
    """The intervention keys pyvene names the files by (its ``_get_representation_key``)."""
    seen: dict[str, int] = {}
    keys = []
    for r in representations:
        unit = str(r["unit"]).replace(".", "_")
        component = str(r["component"])
        head = (f"comp_{component.replace('.', '_')}" if "." in component else f"layer_{r['layer']}_comp_{component}") \
            + f"_unit_{unit}_nunit_{r['max_number_of_units']}"
        seen[head] = seen.get(head, -1) + 1
        keys.append(f"{head}#{seen[head]}")
    return keys


def _class_name(path: Path, i: int, text: Any) -> str:
    match = CLASS_NAME.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise BundleError(f"{path}: intervention_types[{i}] is {text!r}, not a class name")
    return (match.group(1) or match.group(2)).rsplit(".", 1)[-1]


def read_tensors(folder: Path, key: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The state dict of intervention ``key``: ``intkey_<key>.bin`` read with weights_only=True, or a
    ``.safetensors`` file of the same name."""
    binary, safe = folder / f"intkey_{key}.bin", folder / f"intkey_{key}.safetensors"
    if safe.is_file() and not binary.is_file():
        from safetensors.torch import load_file  # deferred: only a converted save needs it

        try:
            return safe, load_file(safe)
        except Exception as e:  # noqa: BLE001 - safetensors' own error and OSError: named with the file
            raise BundleError(f"{safe} is not a readable safetensors file ({e}); convert the save again") from None
    if not binary.is_file():
        raise BundleError(f"{binary} is missing: the save is incomplete (pyreft writes one intkey_*.bin per "
                          "intervention); save the model again with reft_model.save(DIR)")
    try:
        state = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle and zip errors of every kind: named with the file
        first = str(e).splitlines()[0] if str(e) else ""
        raise BundleError(f"{binary} is not a state dict torch.load can read with weights_only=True (tensors only: "
                          f"{type(e).__name__}: {first}); it holds pickled objects or is damaged: save the "
                          "intervention again with reft_model.save(DIR)") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise BundleError(f"{binary} holds a {type(state).__name__}, not a state dict of tensors")
    return binary, state


def _tensor(path: Path, state: dict[str, torch.Tensor], name: str, shape: tuple[int | None, ...], hidden: int,
            model: str, optional: bool = False) -> torch.Tensor | None:
    if name not in state:
        if optional:
            return None
        raise BundleError(f"{path} lacks {name!r} (it holds {sorted(state)}): not the state dict this intervention "
                          "class saves; save it again with reft_model.save(DIR)")
    tensor = check_kind(state[name], f"{path}: {name}").detach().float()
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        if hidden in shape and hidden not in tuple(tensor.shape):
            raise BundleError(f"{path}: {name} has shape {tuple(tensor.shape)}, but {model!r}'s hidden size is "
                              f"{hidden}: the intervention was trained for another model; pass that model as --model")
        raise BundleError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {shape} (None: any)")
    if not torch.isfinite(tensor).all():
        raise BundleError(f"{path}: {name} holds NaN or infinite values: every edit would be NaN; retrain it")
    return tensor


def edit_tensors(path: Path, kind: str, state: dict[str, torch.Tensor], hidden: int, rank: int | None,
                 model: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R [r, d], W [r, d], b [r]) with Phi(h) = h + R^T (W h + b - R h) equal to the intervention."""
    if kind == "LoreftIntervention":
        rotate = _tensor(path, state, "rotate_layer", (hidden, rank), hidden, model)
        r = rotate.shape[1]
        W = _tensor(path, state, "weight", (r, hidden), hidden, model)
        b = _tensor(path, state, "bias", (r,), hidden, model)
        return rotate.T.contiguous(), W, b
    P = _tensor(path, state, "proj_layer.weight", (rank, hidden), hidden, model)
    r = P.shape[0]
    c = _tensor(path, state, "proj_layer.bias", (r,), hidden, model, optional=True)
    W = _tensor(path, state, "learned_source.weight", (r, hidden), hidden, model)
    b = _tensor(path, state, "learned_source.bias", (r,), hidden, model)
    return P, W, b if c is None else b - c


def _padded(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rank`` rows: rows of R, W and b that are all zero add nothing."""
    return torch.cat([tensor, tensor.new_zeros(rank - tensor.shape[0], *tensor.shape[1:])])


def import_pyreft_save(folder: str | Path, model: str | torch.nn.Module, out: str | Path,
                       positions: str | None = None) -> Path:
    """``mari-eval import-vector DIR``: the pyreft save in ``folder`` as a ``reft`` bundle for ``model``
    applied at ``positions`` (pyreft's notation, default ``DEFAULT_POSITIONS``), saved to ``out``."""
    from mari_eval.methods.registry import method_class  # deferred: the reft class lives in baselines/

    check_bundle_directory(out)
    folder = Path(folder)
    positions = DEFAULT_POSITIONS if positions is None else positions
    first, last = parse_positions(positions)
    config = read_config(folder)
    path = folder / CONFIG
    name, hidden, n_layers, _ = _model_description(model)  # the save names no model: its sizes are checked
    representations = [_representation(path, i, r) for i, r in enumerate(config["representations"])]
    types = config.get("intervention_types")
    if not isinstance(types, list) or len(types) != len(representations):
        raise BundleError(f"{path}: intervention_types must name one class per representation (pyvene's save writes it)")
    dimensions = config.get("intervention_dimensions")
    dimensions = dimensions if isinstance(dimensions, list) and len(dimensions) == len(representations) \
        else [None] * len(representations)
    edits: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    files, kinds = {}, []
    for i, (rep, key) in enumerate(zip(representations, _keys(representations))):
        where = f"{path}: representations[{i}]"
        kind = _class_name(path, i, types[i])
        if kind not in SUPPORTED:
            raise BundleError(f"{where} is a {kind}: only {' and '.join(SUPPORTED)} import as a ReFT bundle (the edit "
                              "h + R^T (W h + b - R h)); evaluate other interventions with pyreft itself")
        if rep["component"] != "block_output" or rep["unit"] != "pos" or rep["max_number_of_units"] != 1:
            raise BundleError(f"{where} edits component {rep['component']!r}, unit {rep['unit']!r} x "
                              f"{rep['max_number_of_units']}: a bundle edits a decoder layer's output one position at "
                              "a time (component block_output, unit pos, max_number_of_units 1); retrain it there")
        layer = rep["layer"]
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise BundleError(f"{where}: layer {layer!r}, but {name!r} has decoder layers 0..{n_layers - 1}: pass the "
                              "model it was trained on as --model")
        if layer in edits:
            raise BundleError(f"{where}: a second intervention at layer {layer}: pyreft without share_weights edits the "
                              "first and the last positions with different ones, which a bundle cannot hold; train "
                              "with share_weights (one intervention per layer)")
        if isinstance(dimensions[i], int) and dimensions[i] != hidden:
            raise BundleError(f"{where} has dimension {dimensions[i]}, but {name!r}'s hidden size is {hidden}: the "
                              "intervention was trained for another model; pass that model as --model")
        rank = rep.get("low_rank_dimension")
        source, state = read_tensors(folder, key)
        edits[layer] = edit_tensors(source, kind, state, hidden, rank if isinstance(rank, int) else None, name)
        files[source.name] = file_sha256(source)
        kinds.append(kind)
    layers = sorted(edits)
    rank = max(edits[layer][0].shape[0] for layer in layers)
    tensors = {key: torch.stack([_padded(edits[layer][j], rank) for layer in layers]).contiguous()
               for j, key in enumerate(("R", "W", "b"))}
    spans = f"{layers[0]}..{layers[-1]}" if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))
    bundle_config = {
        "base_model": {"name": name, "hidden_size": hidden, "num_layers": n_layers},
        "site": {"layer": layers[0], "position": f"first {first} and last {last} prompt tokens (the last is p*), each "
                                                 f"at most half the prompt, as pyreft's data module; at layers {spans}"},
        "hyperparameters": {"first": first, "last": last, "rank": rank, "layers": layers, "recipe": "imported",
                            "positions": positions.strip()},
        "source": {"format": FORMAT, "folder": folder.resolve().name, "interventions": kinds, "files": files,
                   "config_sha256": file_sha256(path),
                   "transformers_version": str(config.get("transformers_version", ""))},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return method_class("reft")(bundle_config, tensors).save(out)


def is_pyreft_save(path: str) -> bool:
    """Whether ``mari-eval import-vector`` was given a folder (pyreft's save), not a file."""
    return Path(path).is_dir()


def run_import(args: argparse.Namespace) -> int:
    """``mari-eval import-vector DIR --model M --out OUT [--positions fN+lM]`` (``--out`` already checked)."""
    if not is_pyreft_save(args.file):
        raise ValueError(f"--positions applies to a pyreft save (a folder holding {CONFIG} and intkey_*.bin); "
                         f"{args.file} is not a folder: leave --positions out")
    if args.scale != 1.0 or args.allow_other_model or getattr(args, "sign_check", None):
        raise ValueError("--scale, --allow-other-model and --sign-check apply to vectors: a ReFT edit has no strength "
                         "to scale or direction to flip, and a pyreft save names no model (its hidden size and layers "
                         "are checked against --model); leave them out")
    path = import_pyreft_save(args.file, args.model, args.out, args.positions)
    print(f"bundle: {path} (reft, at {args.positions or DEFAULT_POSITIONS} of every prompt)")
    print(f"evaluate it with --model mari --model_args pretrained={args.model},bundle={path}")
    return 0
