"""Per-epoch training checkpoints, so that a killed ``mari-eval train`` resumes where it stopped.

A training run has stages (MARI: the K experts, the single adapter, the probe; ReFT: one)
and each stage loops over epochs. After every epoch the stage's whole state is written to
one safetensors file, ``<directory>/<stage>.safetensors``, atomically (``files.atomic_write``):

* ``param.<name>``: the trained tensors;
* ``optim.<i>.<name>``: the optimiser's per-parameter state (Adam's moments and step);
* ``generator``: the state of the torch.Generator that orders batches (and, shared by the
  stages, initialises the next one), so a resumed run draws what an uninterrupted one draws;
* ``extra.<name>``: any other tensor the stage keeps (ReFT: its best epoch's parameters);
* metadata: the run's key, the epoch count and a JSON ``state`` (history, Python RNG...).

A resumed run is bit-identical to an uninterrupted one (tested). The key is a hash of
everything that defines the run (method, hyperparameters, model, data, seed): a checkpoint
written by another configuration is ignored, never loaded. ``train.train`` deletes the
directory once the bundle is saved.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from mari_eval.storage.files import atomic_write

log = logging.getLogger(__name__)


class EpochCheckpoints:
    """Save and restore per-epoch training state; ``directory=None`` turns both into no-ops."""

    def __init__(self, directory: str | Path | None, key: str = ""):
        self.directory = None if directory is None else Path(directory)
        self.key = key

    def path(self, stage: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{stage}.safetensors"

    def save(self, stage: str, epochs_done: int, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
             generator: torch.Generator | None = None, state: dict[str, Any] | None = None,
             extra: dict[str, torch.Tensor] | None = None) -> None:
        if self.directory is None:
            return
        from safetensors.torch import save  # deferred: safetensors is heavy; only this path needs it

        tensors = {f"param.{k}": v.detach() for k, v in params.items()}
        for i, slot in optimizer.state_dict()["state"].items():
            tensors.update({f"optim.{i}.{k}": torch.as_tensor(v) for k, v in slot.items()})
        if generator is not None:
            tensors["generator"] = generator.get_state()
        tensors.update({f"extra.{k}": v.detach() for k, v in (extra or {}).items()})
        metadata = {"key": self.key, "stage": stage, "epochs_done": str(epochs_done), "state": json.dumps(state or {})}
        blob = save({k: v.cpu().contiguous().clone() for k, v in tensors.items()}, metadata=metadata)
        atomic_write(self.path(stage), blob)

    def restore(self, stage: str, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                generator: torch.Generator | None = None) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
        """Load ``stage``'s last epoch into ``params`` (in place), ``optimizer`` and ``generator``.

        Returns (epochs already done, the saved ``state``, the saved ``extra`` tensors);
        (0, {}, {}) when there is nothing of this run to resume.
        """
        if self.directory is None or not self.path(stage).is_file():
            return 0, {}, {}
        from safetensors import safe_open  # deferred: safetensors is heavy; only this path needs it

        path = self.path(stage)
        try:
            with safe_open(str(path), framework="pt") as fh:
                metadata = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint is skipped, never trusted
            log.warning("ignoring the unreadable checkpoint %s (%s); training %s from the start", path, e, stage)
            return 0, {}, {}
        if metadata.get("key") != self.key:
            log.warning("ignoring %s: it was written by another training configuration", path)
            return 0, {}, {}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[f"param.{name}"])
        saved = optimizer.state_dict()
        for i in range(len(params)):
            slot = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"optim.{i}.")}
            if slot:
                saved["state"][i] = slot
        optimizer.load_state_dict(saved)
        if generator is not None:
            generator.set_state(tensors["generator"])
        done = int(metadata["epochs_done"])
        log.warning("resuming %s from its checkpoint after epoch %d (%s)", stage, done, path)
        extra = {k[len("extra."):]: v for k, v in tensors.items() if k.startswith("extra.")}
        return done, json.loads(metadata.get("state", "{}")), extra

    def clear(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


NO_CHECKPOINTS = EpochCheckpoints(None)


def checkpoint_dir(out: str | Path) -> Path:
    """Where ``train`` keeps the per-epoch checkpoints of the bundle it writes to ``out``."""
    out = Path(out)
    return out.with_name(out.name + ".checkpoint")
