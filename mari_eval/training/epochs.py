"""The one training loop every trained method uses (MARI's experts and probe, ReFT): epochs of
batches, an optimizer step per batch that refuses a non-finite loss, a record per epoch, and
a checkpoint after every epoch from which a killed run resumes bit-identically
(``mari_eval.storage.checkpoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from mari_eval.storage.checkpoint import EpochCheckpoints

# loss(batch) -> (the loss to minimise, what the epoch record is built from for this batch)
BatchLoss = Callable[[Sequence[Any]], tuple[torch.Tensor, dict[str, Any]]]
# end_epoch(epoch index, [(batch size, what loss returned) per batch]) -> the epoch's record
EndEpoch = Callable[[int, list[tuple[int, dict[str, Any]]]], dict[str, Any]]


@dataclass
class EpochLoop:
    """A training stage: its parameters, optimizer and checkpoints (``stage`` names the checkpoint,
    ``label`` the progress bar and errors); ``generator`` is saved and restored with each checkpoint."""

    stage: str
    label: str
    epochs: int
    params: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    checkpoints: EpochCheckpoints
    generator: torch.Generator | None = None

    def run(
        self,
        batches: Callable[[int], Sequence[Sequence[Any]]],
        loss: BatchLoss,
        end_epoch: EndEpoch,
        state: Callable[[], dict[str, Any]] = dict,
        extra: Callable[[], dict[str, torch.Tensor] | None] = lambda: None,
        restored: Callable[[dict[str, Any], dict[str, torch.Tensor]], None] = lambda state, extra: None,
    ) -> list[dict[str, Any]]:
        """Train from the last checkpointed epoch to ``epochs``; returns every epoch's record.

        ``batches(epoch)`` gives the epoch's batches (of examples with an ``id``); ``state()`` and
        ``extra()`` add to each checkpoint what the caller must resume with (JSON and tensors),
        and ``restored(state, extra)`` gets them back when a run resumes.
        """
        done, saved, kept = self.checkpoints.restore(self.stage, self.params, self.optimizer, self.generator)
        history: list[dict[str, Any]] = saved.get("history", [])
        if done:
            restored(saved, kept)
        for epoch in range(done, self.epochs):
            parts = []
            for step, batch in enumerate(tqdm(batches(epoch), desc=f"{self.label} epoch {epoch + 1}/{self.epochs}",
                                              leave=False)):
                total, logged = loss(batch)
                check_finite(total, self.label, epoch, step, [ex.id for ex in batch])
                self.optimizer.zero_grad()
                total.backward()
                self.optimizer.step()
                parts.append((len(batch), logged))
            history.append({"epoch": epoch + 1, **end_epoch(epoch, parts)})
            self.checkpoints.save(self.stage, epoch + 1, self.params, self.optimizer, self.generator,
                                  {"history": history, **state()}, extra=extra())
        return history


def check_finite(loss: torch.Tensor, what: str, epoch: int, step: int, ids: list[str]) -> None:
    if not torch.isfinite(loss):
        raise FloatingPointError(
            f"{what}: loss is {float(loss.detach())} at epoch {epoch + 1}, step {step + 1} (examples {', '.join(ids[:4])}...); "
            "lower --lr or check the data"
        )


def weighted_means(parts: list[tuple[int, dict[str, Any]]], keys: Sequence[str], digits: int = 5) -> dict[str, float]:
    """The per-example means of ``keys`` over an epoch's batches (each batch's value weighted by its size)."""
    n = sum(size for size, _ in parts)
    return {k: round(sum(float(logged[k]) * size for size, logged in parts) / n, digits) for k in keys}
