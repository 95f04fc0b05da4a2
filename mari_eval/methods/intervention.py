"""The one interface every method implements (``Intervention``), and how a method is saved.

A method (MARI or a baseline) is an ``Intervention``: fitted on a training split, it edits the
hidden state at the site (through ``mari_eval.injection.site``) under the ``Plan`` it builds for the runner
(``mari_eval.injection.plan``), and it is saved as a *bundle*: a directory with ``bundle.json`` (method,
base model, site, hyperparameters, splits, provenance) and ``weights.safetensors``
(``Intervention.save``). What a bundle must hold is declared in ``mari_eval.methods.bundle_spec``;
``mari_eval.methods.bundles.load_bundle`` reads one back; ``mari_eval.methods.registry`` names the methods.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch

from mari_eval.injection import site
from mari_eval.methods.bundle_spec import (BUNDLE_JSON, BUNDLE_WEIGHTS, BundleError, Field, TensorSpec, check_bundle,
                                           check_hyperparameters, is_bundle_file)
from mari_eval.storage.files import atomic_write, atomic_write_json, replace_directory
from mari_eval.storage.models import same_model
from mari_eval.methods.options import Option, parse_options
from mari_eval.injection.plan import BASE, Plan
from mari_eval.methods.registry import option_methods


class Intervention(ABC):
    """Base class: what the lm-eval model, the trainer and the diagnostics may rely on."""

    method: ClassVar[str] = "abstract"
    # What bundle.json holds beyond COMMON_FIELDS: the method's hyperparameters (the keys it
    # reads are required, the training record's are checked when present), and other keys.
    hyperparameter_fields: ClassVar[dict[str, Field]] = {}
    config_fields: ClassVar[dict[str, Field]] = {}

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, checked: bool = False):
        """``checked``: ``config`` and ``tensors`` were checked by the caller (``load_bundle``, naming
        the bundle's files); otherwise (a method's ``fit``) they are checked here."""
        if not checked:
            check_bundle(type(self), config, tensors)
        self.config = config  # everything bundle.json records (model, site, hyperparameters, splits...)
        self.tensors = tensors  # as stored: float32 for trained parameters, on the CPU until used
        self._cast: dict[tuple[torch.device, torch.dtype], dict[str, torch.Tensor]] = {}
        self.options: dict[str, Any] = {}  # the evaluation options given (``configure_from``), typed

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
    # A method hands the runner one ``Plan`` (mari_eval/injection/plan.py): the variants (alternative
    # edits) it runs side by side for a prompt over the shared prefix, how their edits are
    # applied, and how ``choose`` picks the one that answers. The default is one edit at the
    # site, always chosen; a method with several variants (MARI: its experts and its gate's
    # probe) or other sites (ReFT: prompt positions before p*) builds its own ``plan``.

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
            ids = lambda h: torch.zeros(h.shape[0], dtype=torch.long, device=h.device)  # noqa: E731
        else:
            ids = lambda h: variant_ids.to(h.device)  # noqa: E731
        return site.edit_site(model, self.layer, lambda h: self.edit_variants(h, ids(h)), positions)

    def choose(self, run) -> tuple[int, dict[str, Any]]:
        """Which variant of ``run`` (a ``plan.VariantRun``) answers, and a diagnostics record."""
        return 0, {}

    def plan(self, model: torch.nn.Module) -> Plan:
        """What the runner runs for every prompt of ``model`` under this intervention: by default
        variant 0, this method's edit at the site, always chosen."""
        return Plan((0,), lambda variant_ids, positions: self.applied(model, positions, variant_ids), self.choose)

    @property
    def instruction(self) -> str | None:
        """Text the lm-eval model puts into every prompt under this method (Prompting's instruction):
        in the chat template's system turn, else as the context's first paragraph
        (``mari_eval.evaluation.lm.MariLM.instructed``). None, the default: the prompts are left as lm-eval
        renders them (every method that edits hidden states)."""
        return None

    def variant_name(self, variant: int) -> str:
        """How errors and diagnostics name a variant."""
        return "the untouched model" if variant == BASE else f"variant {variant}"

    def record_outcome(self, record: dict[str, Any], run, gold: set[int]) -> None:
        """Add to ``choose``'s record what the correct options (``gold``) say about the choice
        (MARI: routing agreement, Appendix C.2). Nothing by default."""

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Aggregate the ``choose`` records of an evaluation (expert usage, gate rate...)."""
        return {"prompts": len(records)}

    # -- evaluation options (lm-eval --model_args) --------------------------------

    option_fields: ClassVar[dict[str, Option]] = {}  # the options this method takes at evaluation

    def configure_from(self, values: dict[str, Any]) -> None:
        """Apply evaluation options as lm-eval gives them: typed by ``option_fields``, unknown names refused
        (naming the methods that take them, e.g. ``scale=`` for a MARI bundle)."""
        taken_by = option_methods() if set(values) - set(self.option_fields) else None
        options = parse_options(self.method, self.option_fields, values, taken_by)
        if options:
            self.configure(**options)
        self.options = options

    def cache_fingerprint(self) -> str:
        """What a ``--use_cache`` path must hold: the bundle's fingerprint, or, with evaluation
        options given (``scale=2``, ``rho=0.8``...), a digest of both, since the options change the
        results a cache would serve."""
        if not self.options:
            return self.fingerprint()
        given = json.dumps(sorted(self.options.items()), default=str)
        return hashlib.sha256(f"{self.fingerprint()}:{given}".encode()).hexdigest()[:16]

    def edit_fingerprint(self) -> str:
        """What fixes each variant's edit: runs with the same one compute the same rows for a variant
        (``shared_pass`` computes them once). The bundle and every option, unless a method says less."""
        return self.cache_fingerprint()

    def configure(self, **options: Any) -> None:
        """Apply typed evaluation options (methods with ``option_fields`` override this)."""

    # -- training ----------------------------------------------------------------

    # What `mari-eval train` may set (its flags and --set KEY=VALUE): each key's type and range
    # (``bundle_spec.Field``), and the defaults that complete what was given. Every method's
    # training settings are checked by ``training_hyperparameters`` alone.
    label: ClassVar[str] = "abstract"  # how tables and errors name the method
    training_fields: ClassVar[dict[str, Field]] = {}
    training_defaults: ClassVar[dict[str, Any]] = {}
    # The recipe `mari-eval train` trains when --recipe is not given (a baseline with two): the one the
    # repro tables score, so that a first bundle is the tables' bundle. None: the method has no recipes.
    command_line_recipe: ClassVar[str | None] = None

    @classmethod
    def training_source(cls) -> str:
        """How errors name the training settings."""
        return f"{cls.label} hyperparameters"

    @classmethod
    def training_hyperparameters(cls, given: dict[str, Any], max_pca: int | None = None) -> dict[str, Any]:
        """``given`` (``mari-eval train`` flags and ``--set``) checked and completed: unknown names,
        types and ranges are refused here, before any model or data is loaded (``train.check_arguments``)
        and again at the start of ``fit``. ``max_pca``: the D_pca subset size, for methods that fit a
        subspace on it."""
        if "recipe" in given and "recipe" not in cls.training_fields:
            raise ValueError(f"{cls.label} has one training recipe; --recipe adapted|published chooses between the "
                             "baselines' own settings and their authors' (caa, iti, nl_iti, reft): drop it")
        unknown = sorted(set(given) - set(cls.training_fields))
        if unknown:
            known = ", ".join(sorted(cls.training_fields)) or "none"
            raise ValueError(f"unknown {cls.label} hyperparameters {unknown}; known: {known} "
                             "(`mari-eval train --set KEY=VALUE`)")
        hyperparameters = {**cls.training_defaults, **{k: v for k, v in given.items() if v is not None}}
        check_hyperparameters(cls, hyperparameters, cls.training_source(), cls.training_fields)
        return hyperparameters

    @classmethod
    def planned_epochs(cls, hyperparameters: dict[str, Any], n_train: int) -> int | None:
        """The epochs training under ``hyperparameters`` (completed as the cache keys them) will run on
        ``n_train`` D_train examples, for a plan's cost before any data is read; None for a fit without epochs."""
        return hyperparameters.get("epochs") or cls.training_defaults.get("epochs")

    @classmethod
    def fit(cls, session, data, config: dict[str, Any], hyperparameters: dict[str, Any], seed: int) -> "Intervention":
        """Train on ``data`` (a ``examples.AttributeData``) through ``session`` (a ``session.Session``).

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

    source: dict[str, Any] | None = None  # where a Hub bundle was read from (``hub.Resolved.source``)

    def describe(self) -> dict[str, Any]:
        described = {"method": self.method, "fingerprint": self.fingerprint(), "site": self.config.get("site")}
        return described if self.source is None else {**described, "source": self.source}

    # -- persistence ------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the bundle as a whole (``files.replace_directory``): both files into a temporary
        sibling directory, which then takes the place of ``directory``. A failure or a crash leaves
        the previous bundle there, complete, or the new one, never new weights beside an old
        bundle.json. An existing directory is replaced only if it holds bundle files alone."""
        from safetensors.torch import save  # deferred: safetensors is heavy; only this path needs it

        directory = Path(directory)
        stored = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in self.tensors.items()}

        def write(tmp: Path) -> None:
            atomic_write(tmp / BUNDLE_WEIGHTS, save(stored))
            atomic_write_json(tmp / BUNDLE_JSON, {"method": self.method, **self.config}, sort_keys=True)

        replace_directory(directory, write, is_bundle_file)
        return directory
