"""``mari-eval train``: build a method's training data from the paper's splits and fit it.

The same for every method:

1. the splits of ``mari_eval.benchmarks.data_splits.make_splits`` (D_pca, D_train, D_ctrl = attribute
   control examples + general-capability controls; the test split is never read here);
2. every example is rendered by the lm-eval task that evaluates it and tokenised by the
   same ``MariLM`` that evaluates it, so training and evaluation see identical tokens
   (``mari_eval.training.examples``, which also says how each attribute and control is rendered);
3. the frozen model's work that no edit can change is done once per example: the key/
   value cache of the prompt before p* (sharing the longest common prefix of the set,
   e.g. TruthfulQA's 6-shot preamble) and the hidden state at (l*, p*);
4. the method's ``fit`` gets a ``Session`` (model + site + runner; ``mari_eval.training.session``) and
   the examples and returns an ``Intervention``, saved as a bundle with its provenance.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from mari_eval import methods
from mari_eval.benchmarks import data_splits
from mari_eval.injection import devices
from mari_eval.training import memory
from mari_eval.storage.checkpoint import EpochCheckpoints, checkpoint_dir
from mari_eval.injection.devices import Placement
# The examples live in mari_eval.training.examples and the Session in mari_eval.training.session; these names are read as train.X
# too (and tests replace train.Session, which ``train`` looks up here).
from mari_eval.training.examples import ATTRIBUTE_TASKS, AttributeData, Example, attribute_data  # noqa: F401
from mari_eval.storage.files import check_replaceable_place, writing_alone
from mari_eval.storage.outputs import OutputError, unsaved_place
from mari_eval.training.session import Session

log = logging.getLogger(__name__)


def provenance(session: Session, attribute: str, seed: int, splits: data_splits.Splits, train_ids: Sequence[str]) -> dict:
    versions = {}
    for pkg in ("torch", "transformers", "lm_eval", "mari-eval", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {
        "base_model": {"name": session.model_name, "hidden_size": session.hidden_size, "num_layers": session.num_layers},
        "site": {"layer": session.layer, "position": "last prompt token"},
        "training_dtype": str(session.model.dtype).removeprefix("torch."),
        "attribute": attribute,
        "seed": seed,
        "splits": {**splits.to_json(), "fingerprint": splits.fingerprint(), "train_used": list(train_ids)},
        "data_files": data_splits.data_fingerprint(attribute),
        "versions": {**versions, "python": platform.python_version()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def check_arguments(cls, hyperparameters: dict[str, Any], **limits: int | None) -> None:
    """Refuse inconsistent training arguments before the model is loaded: the subset sizes
    (``--max-train``, ``--max-ctrl``, ``--max-pca``) are positive integers, and the method
    checks its hyperparameters (``Intervention.training_hyperparameters``: names, types,
    ranges, and for MARI a D_pca subset no smaller than the PCA rank)."""
    for name, value in limits.items():
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: give a positive number of examples, or leave it out")
    cls.training_hyperparameters(hyperparameters, max_pca=limits.get("max_pca"))


def train(method: str, attribute: str, model: str, seed: int, out: str | Path, layer: int | None = None,
          max_train: int | None = None, max_ctrl: int | None = None, max_pca: int | None = None,
          hyperparameters: dict[str, Any] | None = None, checkpoints: str | Path | None = None,
          placement: Placement | None = None, max_memory: str | int | None = None, lm=None) -> Path:
    """Fit ``method`` for ``attribute`` on ``model`` and save the bundle to ``out``.

    Training state is checkpointed after every epoch into ``checkpoints`` (default
    ``checkpoint_dir(out)``); a run killed before the bundle was saved resumes from the
    last epoch when started again with the same arguments. ``lm``: an already loaded
    ``MariLM`` to train through (``Session``'s; ``model`` then only names the model in
    the bundle, and ``placement`` is not used)."""
    cls = methods.method_class(method)
    check_arguments(cls, hyperparameters or {}, max_train=max_train, max_ctrl=max_ctrl, max_pca=max_pca)
    methods.check_bundle_directory(out)  # an --out holding other files is refused now, not after training
    check_replaceable_place(Path(out), "--out ")  # and one that could not be saved at the end (a read-only place)
    with writing_alone(Path(out), "--out "):  # a second training into the same --out meanwhile is refused
        torch.manual_seed(seed)
        t0 = time.time()
        with devices.subnormals_flushed():  # speed only (see there)
            session = Session(model, layer=layer, placement=placement, max_memory=max_memory, lm=lm)
            # MARI's gate_requests (issue 81.2): seed tasks added to D_ctrl; no other method takes it
            requests = int((hyperparameters or {}).get("gate_requests") or 0)
            attr = attribute_data(session, attribute, seed, max_train=max_train, max_ctrl=max_ctrl, max_pca=max_pca,
                                  requests=requests)
            log.info("data ready in %.0fs: %d train, %d ctrl, %d pca", time.time() - t0, len(attr.train), len(attr.ctrl), len(attr.pca_prompts))
            config = provenance(session, attribute, seed, attr.splits, [ex.id for ex in attr.train])
            config["splits"]["ctrl_used"] = attr.ctrl_ids
            if max_pca is not None:
                config["splits"]["max_pca"] = max_pca
            run_key = {"method": method, "hyperparameters": hyperparameters or {}, **{k: v for k, v in config.items() if k != "created"}}
            session.checkpoints = EpochCheckpoints(checkpoints or checkpoint_dir(out),
                                                   hashlib.sha256(json.dumps(run_key, sort_keys=True).encode()).hexdigest())
            intervention = cls.fit(session, attr, config, dict(hyperparameters or {}), seed)
            if session.largest_step:
                log.info("%s: a training step kept up to %s of activations for its backward (estimate: memory.step_estimate)",
                         method, memory.format_size(session.largest_step))
        intervention.config["train_seconds"] = round(time.time() - t0, 1)
        path = save_or_keep(intervention, Path(out))
        session.checkpoints.clear()
        log.info("saved %s bundle to %s (%.0fs)", method, path, time.time() - t0)
        return path


def save_or_keep(intervention: methods.Intervention, out: Path) -> Path:
    """Save the trained bundle to ``out``. When that fails (the disk filled up, the place became
    read-only during training), the training is not thrown away: the bundle is saved to an
    ``outputs.unsaved_place`` instead, and the error names ``out``, the reason and where it is kept.
    (The per-epoch checkpoints are kept too: the same command resumes from them.)"""
    try:
        return intervention.save(out)
    except OSError as e:
        kept = unsaved_place(out.name)
        try:
            intervention.save(kept)
            where = f"the trained bundle is kept in {kept}: move it to {out} once there is room"
        except OSError as again:
            where = (f"it could not be kept in {kept} either ({again}); the same command resumes from the last "
                     "training checkpoint, if the method keeps any")
        raise OutputError(e.errno, f"{e}; {where}") from None
