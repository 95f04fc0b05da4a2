"""The one interface every method implements, and the bundle format that stores it.

A method (MARI or a baseline) is an ``Intervention``: fitted on a training split, it
edits the hidden state at the site (through ``mari_eval.site``), and it is saved as a
*bundle*: a directory with ``bundle.json`` (method, base model, site, hyperparameters,
splits, provenance) and ``weights.safetensors``. Loading never unpickles anything.

Methods register themselves with ``@register_method("name")``; ``load_bundle`` reads
``bundle.json`` and hands the directory to the registered class.

What a bundle must hold is declared, not coded: the fields every bundle.json has
(``COMMON_FIELDS``), each method's own (``Intervention.hyperparameter_fields`` and
``config_fields``: a JSON type and a range per key, see ``Field``) and the tensors it
expects, with their shapes in terms of its config (``Intervention.tensor_spec``). One
function checks them all (``check_bundle``), when a bundle is loaded and when an
intervention is made; what fails names the file, the key or tensor, and what was expected.
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mari_eval import site
from mari_eval.files import atomic_write, atomic_write_json, check_replaceable, recover_directory, replace_directory

BUNDLE_JSON = "bundle.json"
BUNDLE_WEIGHTS = "weights.safetensors"
# Files a new bundle may replace in its directory: its own, and the provenance repro/ writes beside them.
BUNDLE_FILES = (BUNDLE_JSON, BUNDLE_WEIGHTS, "repro_config.json")
_METHODS: dict[str, type["Intervention"]] = {}


class BundleError(ValueError):
    """A bundle is missing, damaged, or was trained for another model."""


# ----------------------------------------------------------------------------- what a bundle holds


@dataclass(frozen=True)
class Field:
    """One value of bundle.json: its JSON type ("int", "float", "str", "bool", "list",
    "object") and range. An int is never a bool (JSON true is not 1); a float may be written
    as an integer (4 for 4.0), is never NaN, and is finite unless ``finite=False``."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False
    finite: bool = True
    items: "Field | None" = None  # list: every item
    fields: "dict[str, Field] | None" = None  # object: its known keys (others are not checked)
    choices: tuple = ()

    def describe(self) -> str:
        what = {"int": "an integer", "float": "a finite number" if self.finite else "a number (not NaN)",
                "str": "a string", "bool": "true or false", "object": "an object"}.get(self.kind)
        if self.kind == "list":
            what = f"a list of {self.items.describe() if self.items else 'values'}"
        if self.choices:
            what += " among " + ", ".join(json.dumps(c) for c in self.choices)
        if self.lo is not None and self.hi is not None:
            what += f" in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            what += f" {'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            what += f" {'<' if self.hi_open else '<='} {self.hi:g}"
        return what


def Int(lo=None, hi=None, optional=False) -> Field:
    return Field("int", lo, hi, optional=optional)


def Float(lo=None, hi=None, lo_open=False, hi_open=False, optional=False, finite=True) -> Field:
    return Field("float", lo, hi, lo_open, hi_open, optional, finite)


def Str(optional=False, choices=()) -> Field:
    return Field("str", optional=optional, choices=tuple(choices))


def List(items: Field | None = None, optional=False) -> Field:
    return Field("list", optional=optional, items=items)


def Obj(fields: dict[str, Field] | None = None, optional=False) -> Field:
    return Field("object", optional=optional, fields=fields or {})


# Every bundle.json: what the runtime reads is required; the provenance `mari-eval train`
# records (seed, splits, data files...) is checked when present (bundles made by hand or by
# tests may leave it out).
COMMON_FIELDS: dict[str, Field] = {
    "base_model": Obj({"name": Str(), "hidden_size": Int(1), "num_layers": Int(1)}),
    "site": Obj({"layer": Int(0), "position": Str(optional=True)}),
    "attribute": Str(optional=True),
    "seed": Int(optional=True),
    "splits": Obj({name: List(Str(), optional=True) for name in ("pca", "train", "ctrl", "ctrl_arc", "test", "train_used",
                                                                 "ctrl_used")}
                  | {"dataset": Str(optional=True), "seed": Int(optional=True), "fingerprint": Str(optional=True),
                     "max_pca": Int(1, optional=True)}, optional=True),
    "data_files": Obj(optional=True),
    "versions": Obj(optional=True),
    "training_dtype": Str(optional=True),
    "created": Str(optional=True),
    "train_seconds": Float(0, optional=True),
    "diagnostics": Obj(optional=True),
}


class _Invalid(Exception):
    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "true/false"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "a list"), (dict, "an object"), (type(None), "null")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_value(value: Any, field: Field, path: str) -> None:
    kind = field.kind
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"int": isinstance(value, int) and not isinstance(value, bool), "float": is_number,
          "str": isinstance(value, str), "bool": isinstance(value, bool), "list": isinstance(value, list),
          "object": isinstance(value, dict)}[kind]
    if ok and kind == "float":
        ok = not math.isnan(value) and (not field.finite or not math.isinf(value))
    if ok and kind in ("int", "float"):
        ok = not ((field.lo is not None and (value < field.lo or (field.lo_open and value == field.lo)))
                  or (field.hi is not None and (value > field.hi or (field.hi_open and value == field.hi))))
    if ok and field.choices:
        ok = value in field.choices
    if not ok:
        raise _Invalid(path, f"{path} is {_shown(value)} ({_json_type(value)}); expected {field.describe()}")
    if kind == "list" and field.items is not None:
        for i, item in enumerate(value):
            _check_value(item, field.items, f"{path}[{i}]")
    if kind == "object":
        check_fields(value, field.fields or {}, path)


def check_fields(obj: dict[str, Any], fields: dict[str, Field], path: str = "") -> None:
    """Check the keys of ``obj`` declared in ``fields`` (type, range, presence); raises
    ``_Invalid`` naming the key path (``site.layer``, ``hyperparameters.rho``)."""
    for key, field in fields.items():
        where = f"{path}.{key}" if path else key
        if key not in obj:
            if not field.optional:
                raise _Invalid(where, f"{where} is missing; expected {field.describe()}")
            continue
        _check_value(obj[key], field, where)


def check_hyperparameters(cls: type["Intervention"], hyperparameters: dict[str, Any], source: str,
                          fields: dict[str, Field] | None = None) -> None:
    """``mari-eval train``'s hyperparameters checked before training against ``fields`` (default: what
    ``cls``'s bundle records), so that a value the bundle would be refused for fails now, not after training."""
    try:
        check_fields(hyperparameters, cls.hyperparameter_fields if fields is None else fields, "hyperparameters")
    except _Invalid as e:
        raise ValueError(f"{source}: {e} ({cls.method}; `mari-eval train --set KEY=VALUE`)") from None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a method expects: its shape, each dimension a number, a size named in the
    method's config (``Intervention.tensor_spec``'s sizes), or a name bound by the first
    tensor that has it (so that other tensors must agree with it); its dtype family."""

    shape: tuple
    kind: str = "float"  # "float": any floating dtype; "int": an integer or bool dtype
    optional: bool = False


def bundle_fields(cls: type["Intervention"]) -> dict[str, Field]:
    required = any(not f.optional for f in cls.hyperparameter_fields.values())
    return {**COMMON_FIELDS, "hyperparameters": Obj(cls.hyperparameter_fields, optional=not required),
            **cls.config_fields}


def check_bundle(cls: type["Intervention"], config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 meta: str = BUNDLE_JSON, weights: str = BUNDLE_WEIGHTS) -> None:
    """Refuse (``BundleError``) a config or tensors that ``cls`` cannot run correctly: a field of
    the wrong type or out of range, a tensor missing, of another shape or dtype family than the
    config implies, or holding NaN or infinite values. ``meta`` and ``weights`` name the files."""
    check_config(cls, config, meta)
    check_tensors(cls, config, tensors, meta, weights)


def check_config(cls: type["Intervention"], config: dict[str, Any], meta: str = BUNDLE_JSON) -> None:
    try:
        check_fields(config, bundle_fields(cls))
    except _Invalid as e:
        raise BundleError(f"{meta}: {e}. The bundle is damaged or was edited by hand: correct {e.path} or retrain "
                          "it with `mari-eval train`") from None


def check_tensors(cls: type["Intervention"], config: dict[str, Any], tensors: dict[str, torch.Tensor],
                  meta: str = BUNDLE_JSON, weights: str = BUNDLE_WEIGHTS) -> None:
    """The tensors against ``cls.tensor_spec(config)`` (``config`` already checked), then finiteness."""
    sizes, specs = cls.tensor_spec(config, set(tensors))
    bound: dict[str, tuple[int, str]] = {}  # size name -> (value, tensor it was read from)
    for name, spec in specs.items():
        if name not in tensors:
            if spec.optional:
                continue
            raise BundleError(f"{weights} lacks tensor {name} (a {cls.method} bundle holds it); the bundle is "
                              "incomplete, retrain it with `mari-eval train`")
        tensor = tensors[name]
        floating = tensor.is_floating_point()
        if floating != (spec.kind == "float") or tensor.is_complex():
            raise BundleError(f"{weights}: tensor {name} has dtype {str(tensor.dtype).removeprefix('torch.')}, expected "
                              f"{'a floating' if spec.kind == 'float' else 'an integer'} dtype; the bundle is damaged, "
                              "retrain it")
        got = tuple(tensor.shape)
        expected, explain = [], dict(sizes)
        for i, dim in enumerate(spec.shape):
            if isinstance(dim, str) and dim not in sizes:
                if dim not in bound and i < len(got):
                    bound[dim] = (got[i], name)
                if dim in bound:
                    explain[dim] = f"{bound[dim][0]} from tensor {bound[dim][1]}"
                    dim = bound[dim][0]
            expected.append(sizes[dim] if isinstance(dim, str) and dim in sizes else dim)
        if got != tuple(expected):
            shown = "(" + ", ".join(str(e) if isinstance(e, int) else f"{e}?" for e in expected) \
                    + ("," if len(expected) == 1 else "") + ")"
            raise BundleError(
                f"{weights}: tensor {name} has shape {got}, expected {shown} from {Path(meta).name} "
                f"({', '.join(f'{k}={v}' for k, v in explain.items())}); this {cls.method} bundle is inconsistent, "
                "retrain it")
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                bad, nan = int((~finite).sum()), int(tensor.isnan().sum())
                raise BundleError(
                    f"{weights}: tensor {name} holds {bad} non-finite value(s) of {tensor.numel()} ({nan} NaN, "
                    f"{bad - nan} infinite). Every edit with it would be NaN; its training diverged or the file was "
                    "damaged: retrain the bundle (with a lower --lr if its training loss diverged)")


def register_method(name: str):
    def decorate(cls: type[Intervention]) -> type[Intervention]:
        cls.method = name
        _METHODS[name] = cls
        return cls

    return decorate


def method_class(name: str) -> type["Intervention"]:
    _import_builtin_methods()
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def method_names() -> list[str]:
    _import_builtin_methods()
    return sorted(_METHODS)


def _import_builtin_methods() -> None:
    # Methods live in their own modules and register on import; none is loaded at start-up.
    import importlib

    for module in ("mari_eval.mari", "baselines"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


class Intervention(ABC):
    """Base class: what the lm-eval model, the trainer and the diagnostics may rely on."""

    method: ClassVar[str] = "abstract"
    # What bundle.json holds beyond COMMON_FIELDS: the method's hyperparameters (the keys it
    # reads are required, the training record's are checked when present), and other keys.
    hyperparameter_fields: ClassVar[dict[str, Field]] = {}
    config_fields: ClassVar[dict[str, Field]] = {}

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]):
        check_bundle(type(self), config, tensors)
        self.config = config  # everything bundle.json records (model, site, hyperparameters, splits...)
        self.tensors = tensors  # as stored: float32 for trained parameters, on the CPU until used
        self._cast: dict[tuple[torch.device, torch.dtype], dict[str, torch.Tensor]] = {}

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        """(sizes named in ``config``, {tensor: its spec}) for a bundle holding the tensors ``names``
        (``config`` has passed ``bundle_fields``). Tensors not named here are only checked to be finite."""
        return {"hidden_size": config["base_model"]["hidden_size"]}, {}

    def tensors_like(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """The floating tensors on ``hidden``'s device and in its dtype (other tensors as stored),
        cast once per (device, dtype): edits are applied in the model's dtype, on the device of
        the layer they edit, while the bundle keeps float32."""
        key = (hidden.device, hidden.dtype)
        if key not in self._cast:
            self._cast[key] = {name: t.to(device=hidden.device, dtype=hidden.dtype) if t.is_floating_point() else t
                               for name, t in self.tensors.items()}
        return self._cast[key]

    @property
    def layer(self) -> int:
        return int(self.config["site"]["layer"])

    # -- applying ----------------------------------------------------------------
    #
    # A method proposes one or more *variants* (alternative edits) for a prompt; the
    # runner (mari_eval.runner) runs them side by side over the shared prompt prefix
    # and ``choose`` picks which one answers. Single-edit methods keep the defaults:
    # one variant, always chosen. MARI proposes its K experts and its gate probe.

    uses_base: ClassVar[bool] = False  # whether ``choose`` reads the untouched model's run

    def variants(self) -> list[int]:
        """Ids of the edits run for every prompt (``runner.BASE`` = -1 is the untouched model)."""
        return [0]

    def site_only_variants(self) -> list[int]:
        """Variants whose outputs are not needed, only their hidden states at p*."""
        return []

    def screen(self, run) -> bool:
        """Whether the other variants are needed, given a run holding only BASE and the
        site-only variants. False (MARI: a closed gate) answers with BASE without running them."""
        return True

    def prompt_sites(self, length: int) -> list[int]:
        """Positions before p* that the edit also replaces, in a prompt of ``length`` tokens.

        None by default: every method edits p* (and, for some, later tokens) only, so the
        prompt before p* is the frozen model's and is shared. ReFT also edits the first and
        last few prompt tokens; the runner then computes each prompt under the edit.
        """
        return []

    def captured_layers(self) -> list[int]:
        """Layers whose hidden state at p* ``choose`` reads (``run.site``)."""
        return []

    def edit(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map hidden states at p* ([B, d]) to their replacements (single-edit methods)."""
        raise NotImplementedError(f"{type(self).__name__} must implement edit() or edit_variants()")

    def edit_variants(self, hidden: torch.Tensor, variant_ids: torch.Tensor) -> torch.Tensor:
        """Edit row i of ``hidden`` ([B, d]) with variant ``variant_ids[i]``; BASE rows pass through."""
        edited = self.edit(hidden)
        return torch.where((variant_ids >= 0)[:, None], edited, hidden)

    def applied(
        self, model: torch.nn.Module, positions: torch.Tensor | None, variant_ids: torch.Tensor | None = None
    ) -> AbstractContextManager:
        """Context in which ``model``'s forward passes carry this intervention at ``positions``.

        Without ``variant_ids`` every row gets variant 0.
        """
        if variant_ids is None:
            return site.edit_site(model, self.layer, self.edit_variants_default, positions)
        return site.edit_site(model, self.layer, lambda h: self.edit_variants(h, variant_ids.to(h.device)), positions)

    def edit_variants_default(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.edit_variants(hidden, torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device))

    def choose(self, run) -> tuple[int, dict[str, Any]]:
        """Which variant of ``run`` (a ``runner.VariantRun``) answers, and a diagnostics record."""
        return self.variants()[0], {}

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Aggregate the ``choose`` records of an evaluation (expert usage, gate rate...)."""
        return {"prompts": len(records)}

    # -- training ----------------------------------------------------------------

    @classmethod
    def training_hyperparameters(cls, given: dict[str, Any], max_pca: int | None = None) -> dict[str, Any]:
        """``given`` (``mari-eval train`` flags and ``--set``) checked and completed: unknown names,
        types and ranges are refused here, before any model or data is loaded (``train.check_arguments``)
        and again at the start of ``fit``. ``max_pca``: the D_pca subset size, for methods that fit a
        subspace on it."""
        if given:
            raise ValueError(f"{cls.method} takes no hyperparameters; got {sorted(given)}")
        return {}

    @classmethod
    def fit(cls, session, data, config: dict[str, Any], hyperparameters: dict[str, Any], seed: int) -> "Intervention":
        """Train on ``data`` (a ``train.AttributeData``) through ``session`` (a ``train.Session``).

        ``config`` holds the provenance (base model, site, splits...); the returned
        intervention's config adds the method's hyperparameters and results.
        """
        raise NotImplementedError(f"{cls.__name__} cannot be trained with `mari-eval train`")

    # -- identity and compatibility -------------------------------------------

    def check_compatible(self, model: torch.nn.Module, model_name: str, allow_other_model: bool = False) -> None:
        """Refuse, naming the problem and the fix, a bundle that does not fit ``model``.

        Shapes (hidden size, layer count, site layer) must always match. The base model's
        name must match too (``models.same_model``: an alias and the directory it was
        materialised into are the same model), unless ``allow_other_model``: a bundle
        trained on another checkpoint of the same shape runs but edits the wrong states.
        """
        from mari_eval.models import same_model

        base = self.config["base_model"]
        hidden, layers = int(model.config.get_text_config().hidden_size), site.num_layers(model)
        problems = []
        if base["hidden_size"] != hidden:
            problems.append(f"hidden size {base['hidden_size']} (this model: {hidden})")
        if base["num_layers"] != layers:
            problems.append(f"{base['num_layers']} layers (this model: {layers})")
        if problems:
            raise BundleError(
                f"This {self.method} bundle was trained for '{base['name']}' with " + " and ".join(problems)
                + f"; it cannot be applied to '{model_name}'. Load it with pretrained={base['name']} or retrain."
            )
        if not allow_other_model and not same_model(base["name"], model_name):
            raise BundleError(
                f"This {self.method} bundle was trained for '{base['name']}', not '{model_name}' (same shapes, other "
                f"weights). Load it with pretrained={base['name']}, retrain it on '{model_name}', or, if both names "
                "hold the same checkpoint, pass allow_other_model=true in --model_args."
            )
        try:
            site.check_layer(model, self.layer)
        except site.SiteError as e:
            raise BundleError(f"This {self.method} bundle's site is invalid: {e} The bundle is damaged; retrain it.") from None

    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        for name in sorted(self.tensors):
            digest.update(name.encode())
            digest.update(self.tensors[name].detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "fingerprint": self.fingerprint(), "site": self.config.get("site")}

    # -- persistence ------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the bundle as a whole (``files.replace_directory``): both files into a temporary
        sibling directory, which then takes the place of ``directory``. A failure or a crash leaves
        the previous bundle there, complete, or the new one, never new weights beside an old
        bundle.json. An existing directory is replaced only if it holds bundle files alone."""
        from safetensors.torch import save

        directory = Path(directory)
        stored = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in self.tensors.items()}

        def write(tmp: Path) -> None:
            atomic_write(tmp / BUNDLE_WEIGHTS, save(stored))
            atomic_write_json(tmp / BUNDLE_JSON, {"method": self.method, **self.config}, sort_keys=True)

        replace_directory(directory, write, _bundle_file)
        return directory


def _bundle_file(name: str) -> bool:
    """Whether a file of this name may be replaced with a bundle's directory: a bundle's own, or
    what a killed ``atomic_write`` left of one."""
    return name in BUNDLE_FILES or (name.startswith(".") and name.endswith(".tmp"))


def check_bundle_directory(directory: str | Path) -> None:
    """Refuse now (``FileExistsError``), before any training, a directory ``Intervention.save``
    would refuse: a file, or a directory holding files that are not a bundle's."""
    check_replaceable(directory, _bundle_file)


def load_bundle(directory: str | Path) -> Intervention:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    meta_path, weights_path = directory / BUNDLE_JSON, directory / BUNDLE_WEIGHTS
    if not meta_path.is_file():
        recover_directory(directory)  # a save that died between its renames: the previous bundle goes back
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise BundleError(f"{path} is missing: '{directory}' is not a complete bundle (train one with `mari-eval train`)")
    config = _read_config(meta_path)
    name = config.pop("method", None)
    _import_builtin_methods()
    if not isinstance(name, str) or name not in _METHODS:
        raise BundleError(f"{meta_path} names method {_shown(name)}; known methods: {sorted(_METHODS) or 'none'}")
    cls = _METHODS[name]
    check_config(cls, config, str(meta_path))  # before the weights: a bad config is named as such
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"{weights_path} is not a readable safetensors file: {_why_unreadable(weights_path, e)}") from None
    check_tensors(cls, config, tensors, str(meta_path), str(weights_path))
    return cls(config, tensors)


def _read_config(path: Path) -> dict[str, Any]:
    """bundle.json as a dict, or a BundleError naming the file and what is wrong with it."""
    damaged = "the bundle is damaged: copy it again or retrain it"
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BundleError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); {damaged}") from None
    except OSError as e:
        raise BundleError(f"{path} cannot be read ({e.strerror or e}); check its permissions") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {damaged}") from None
    except RecursionError:
        raise BundleError(f"{path} is not a bundle's JSON: it is nested too deeply to read; {damaged}") from None
    if not isinstance(config, dict):
        raise BundleError(f"{path} holds {_json_type(config)}, not a JSON object; {damaged}")
    return config


def _why_unreadable(path: Path, error: Exception) -> str:
    head = path.read_bytes()[:2]
    # torch.save writes a zip archive ("PK"); a bare pickle starts with the PROTO opcode 0x80.
    if head == b"PK" or head[:1] == b"\x80":
        return ("it is a pickle (torch.save) file. Bundles are never unpickled, since unpickling runs code; "
                "save the tensors with safetensors.torch.save_file, or retrain with `mari-eval train`.")
    return f"it is truncated or damaged ({error}). Copy the bundle again or retrain it."
