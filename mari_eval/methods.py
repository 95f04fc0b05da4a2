"""The one interface every method implements, and the bundle format that stores it.

A method (MARI or a baseline) is an ``Intervention``: fitted on a training split, it
edits the hidden state at the site (through ``mari_eval.site``), and it is saved as a
*bundle*: a directory with ``bundle.json`` (method, base model, site, hyperparameters,
splits, provenance) and ``weights.safetensors``. Loading never unpickles anything.

Methods register themselves with ``@register_method("name")``; ``load_bundle`` reads
``bundle.json`` and hands the directory to the registered class.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch

from mari_eval import site
from mari_eval.files import atomic_write, atomic_write_json

BUNDLE_JSON = "bundle.json"
BUNDLE_WEIGHTS = "weights.safetensors"
_METHODS: dict[str, type["Intervention"]] = {}


class BundleError(ValueError):
    """A bundle is missing, damaged, or was trained for another model."""


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

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]):
        self.config = config  # everything bundle.json records (model, site, hyperparameters, splits...)
        self.tensors = tensors  # as stored: float32 for trained parameters, on the CPU until used
        self._cast: dict[tuple[torch.device, torch.dtype], dict[str, torch.Tensor]] = {}

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
        """Write the bundle; each file atomically, bundle.json last (a bundle without it is incomplete)."""
        from safetensors.torch import save

        directory = Path(directory)
        stored = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in self.tensors.items()}
        atomic_write(directory / BUNDLE_WEIGHTS, save(stored))
        atomic_write_json(directory / BUNDLE_JSON, {"method": self.method, **self.config}, sort_keys=True)
        return directory


def load_bundle(directory: str | Path) -> Intervention:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    meta_path, weights_path = directory / BUNDLE_JSON, directory / BUNDLE_WEIGHTS
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise BundleError(f"{path} is missing: '{directory}' is not a complete bundle (train one with `mari-eval train`)")
    try:
        config = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{meta_path} is not valid JSON ({e.msg}); the bundle is damaged, retrain it") from None
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"{weights_path} is not a readable safetensors file: {_why_unreadable(weights_path, e)}") from None
    name = config.pop("method", None)
    _import_builtin_methods()
    if name not in _METHODS:
        raise BundleError(f"{meta_path} names method {name!r}; known methods: {sorted(_METHODS) or 'none'}")
    return _METHODS[name](config, tensors)


def _why_unreadable(path: Path, error: Exception) -> str:
    head = path.read_bytes()[:2]
    # torch.save writes a zip archive ("PK"); a bare pickle starts with the PROTO opcode 0x80.
    if head == b"PK" or head[:1] == b"\x80":
        return ("it is a pickle (torch.save) file. Bundles are never unpickled, since unpickling runs code; "
                "save the tensors with safetensors.torch.save_file, or retrain with `mari-eval train`.")
    return f"it is truncated or damaged ({error}). Copy the bundle again or retrain it."
