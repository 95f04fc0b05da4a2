"""The choices a method made while lm-eval scored or generated (its ``choose`` records: which
variant answered, and what it read to decide), kept in one order whatever the number of
data-parallel ranks, summarised by the method and written to ``diagnostics=``.

Every record names its task and ``doc_id`` (lm-eval's, as in ``--log_samples``), for
multiple-choice and generation requests alike. Under ``--use_cache`` a request answered from
the cache never reaches the model, so it has no record: the summary then says whether the
cache could have answered any (``diagnostics_incomplete``; ``use_cache``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mari_eval.storage.files import write_results_json

if TYPE_CHECKING:
    from mari_eval.methods.intervention import Intervention

log = logging.getLogger(__name__)

CACHED_NOTE = ("--use_cache: results read from the cache were not recomputed, so they have no record here and "
               "the summary covers only the requests computed in this run; for complete diagnostics use an "
               "empty cache path or run without --use_cache")


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
        # --use_cache: the cache file and the results it held when evaluation began, summed over ranks
        self.cache: dict | None = None

    def use_cache(self, path: str, cached: int, rank: int) -> None:
        """lm-eval's CachingLM answers the requests it holds (``cached`` results in ``path``) without
        the model: say so in the summary, and write the file now, since a run whose every
        request is cached never reaches ``gather``."""
        if self.intervention is None:
            return
        self._cached_here = int(cached)  # this rank's; the summary sums all ranks' (gather)
        self.cache = {"cache": path, "cached_results_at_start": int(cached)}
        if cached:
            log.warning("--use_cache: %s already holds %d results; the requests it answers do not reach the model "
                        "and have no diagnostics record (diagnostics_incomplete in the summary)", path, cached)
        self.write(rank)

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
            import torch.distributed as dist  # deferred: only several ranks need it

            everyone: list = [None] * world_size
            cached = None if self.cache is None else self._cached_here
            dist.all_gather_object(everyone, (mine, cached))
            mine = [pair for part, _ in everyone for pair in part]
            if self.cache is not None:  # every rank has its own cache file
                self.cache["cached_results_at_start"] = sum(n for _, n in everyone if n is not None)
        mine.sort(key=lambda pair: pair[0])
        self._keys[start:] = [key for key, _ in mine]
        self.records[start:] = [record for _, record in mine]
        self.write(rank)

    def write(self, rank: int) -> None:
        if rank == 0 and self.path:
            write_results_json(Path(self.path), {"summary": self.summary(), "records": self.records})  # NaN as null

    def summary(self) -> dict:
        if self.intervention is None:
            return {}
        out = self.intervention.summarize(self.records)
        if self.cache is not None:
            # Exact when the cache was empty at the start (nothing could be read from it); otherwise
            # requests it held were answered without the model (how many, CachingLM does not say).
            incomplete = self.cache["cached_results_at_start"] > 0
            out["use_cache"] = {**self.cache, "records": len(self.records)}
            out["diagnostics_incomplete"] = incomplete
            if incomplete:
                out["diagnostics_note"] = CACHED_NOTE
        return out
