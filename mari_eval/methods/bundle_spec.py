"""What a bundle must hold, declared rather than coded: the fields of ``bundle.json`` (a JSON
type and a range per key, ``Field``), and the tensors with their shapes in terms of the
config (``TensorSpec``). The fields every bundle has are ``COMMON_FIELDS``; each method adds
its own (``Intervention.hyperparameter_fields``, ``config_fields``, ``tensor_spec``).
``check_bundle`` checks them all; what fails names the file, the key or tensor, and what
was expected.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from mari_eval.storage.files import check_replaceable

BUNDLE_JSON = "bundle.json"
BUNDLE_WEIGHTS = "weights.safetensors"
# Files a new bundle may replace in its directory: its own, and the provenance repro/ writes beside them.
BUNDLE_FILES = (BUNDLE_JSON, BUNDLE_WEIGHTS, "repro_config.json")


class DeclaresBundle(Protocol):
    """What the checks read of a method's class (``mari_eval.methods.Intervention`` and its
    subclasses): its name and the fields and tensors its bundles hold."""

    method: ClassVar[str]
    hyperparameter_fields: ClassVar[dict[str, "Field"]]
    config_fields: ClassVar[dict[str, "Field"]]

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, "TensorSpec"]]: ...


class BundleError(ValueError):
    """A bundle is missing, damaged, or was trained for another model."""


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


def Bool(optional=False) -> Field:
    return Field("bool", optional=optional)


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
    "splits": Obj({name: List(Str(), optional=True) for name in ("pca", "train", "ctrl", "ctrl_arc", "ctrl_mmlu", "test",
                                                                 "train_used", "ctrl_used")}
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


def check_hyperparameters(cls: type[DeclaresBundle], hyperparameters: dict[str, Any], source: str,
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


def bundle_fields(cls: type[DeclaresBundle]) -> dict[str, Field]:
    required = any(not f.optional for f in cls.hyperparameter_fields.values())
    return {**COMMON_FIELDS, "hyperparameters": Obj(cls.hyperparameter_fields, optional=not required),
            **cls.config_fields}


def check_bundle(cls: type[DeclaresBundle], config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 meta: str = BUNDLE_JSON, weights: str = BUNDLE_WEIGHTS) -> None:
    """Refuse (``BundleError``) a config or tensors that ``cls`` cannot run correctly: a field of
    the wrong type or out of range, a tensor missing, of another shape or dtype family than the
    config implies, or holding NaN or infinite values. ``meta`` and ``weights`` name the files."""
    check_config(cls, config, meta)
    check_tensors(cls, config, tensors, meta, weights)


def check_config(cls: type[DeclaresBundle], config: dict[str, Any], meta: str = BUNDLE_JSON) -> None:
    try:
        check_fields(config, bundle_fields(cls))
    except _Invalid as e:
        raise BundleError(f"{meta}: {e}. The bundle is damaged or was edited by hand: correct {e.path} or retrain "
                          "it with `mari-eval train`") from None


def check_tensors(cls: type[DeclaresBundle], config: dict[str, Any], tensors: dict[str, torch.Tensor],
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


def is_bundle_file(name: str) -> bool:
    """Whether a file of this name may be replaced with a bundle's directory: a bundle's own, or
    what a killed ``atomic_write`` left of one."""
    return name in BUNDLE_FILES or (name.startswith(".") and name.endswith(".tmp"))


def check_bundle_directory(directory: str | Path) -> None:
    """Refuse now (``FileExistsError``), before any training, a directory ``Intervention.save``
    would refuse: a file, or a directory holding files that are not a bundle's."""
    check_replaceable(directory, is_bundle_file)


def check_bundle_out(directory: str | Path, force: bool, option: str = "--out ") -> None:
    """Refuse now (``FileExistsError``) an output directory that already holds a bundle, unless ``force``:
    writing there would replace a trained bundle without a word. Then what ``check_bundle_directory`` refuses."""
    check_bundle_directory(directory)
    directory = Path(directory)
    held = [name for name in BUNDLE_FILES if (directory / name).is_file()] if directory.is_dir() else []
    if held and not force:
        try:
            what = f"a {json.loads((directory / BUNDLE_JSON).read_text())['method']} bundle"
        except (OSError, ValueError, KeyError, TypeError):
            what = "a bundle"
        raise FileExistsError(f"{option}{directory} already holds {what} ({', '.join(held)}): pass --force to replace "
                              "it, or give another directory")
