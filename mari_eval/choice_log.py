"""The choices a method made while lm-eval scored or generated (its ``choose`` records: which
variant answered, and what it read to decide), kept in one order whatever the number of
data-parallel ranks, summarised by the method and written to ``diagnostics=``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mari_eval.files import write_results_json

if TYPE_CHECKING:
    from mari_eval.methods import Intervention


def prompt_order(task, doc_id, prompt: tuple[int, ...]) -> tuple:
    """The order prompts are scored in (by their tokens, so a shared preamble is read once) and
    their records kept in, whichever rank scored them."""
    return prompt, str(task), -1 if doc_id is None else doc_id


class ChoiceLog:
    """One record per prompt, each with its place in ``prompt_order``; none without an intervention."""

    def __init__(self, intervention: "Intervention | None", path: str | None = None):
        self.intervention, self.path = intervention, path
        self.records: list[dict] = []
        self._keys: list[tuple] = []

    def add(self, key: tuple, record: dict) -> None:
        self._keys.append(key)
        self.records.append(record)

    def gather(self, start: int, world_size: int, rank: int) -> None:
        """The records added since ``start``, from every rank, in one order.

        They are sorted by their prompts (``prompt_order``), so one process and several give
        the same list; every rank then holds all of them, and rank 0 writes the file.
        """
        if self.intervention is None:
            return
        mine = list(zip(self._keys[start:], self.records[start:]))
        if world_size > 1:
            import torch.distributed as dist

            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, mine)
            mine = [pair for part in everyone for pair in part]
        mine.sort(key=lambda pair: pair[0])
        self._keys[start:] = [key for key, _ in mine]
        self.records[start:] = [record for _, record in mine]
        if rank == 0 and self.path:
            write_results_json(Path(self.path), {"summary": self.summary(), "records": self.records})  # NaN as null

    def summary(self) -> dict:
        return {} if self.intervention is None else self.intervention.summarize(self.records)
