"""What repro/gpu_bench.py measures, one step at a time, on one random-weight model (issue 41).

* ``train``: a method's bundle on TruthfulQA's D_train through the already built model (``train.train``
  with ``lm=``), wall time, and the peak GPU memory of training against the memory model's estimate
  (``mari_eval.training.memory``: the weights, N parameters x b bytes, plus the training state M that
  ``Session.prepare`` plans to keep for each prepared set, plus the largest training step's activations
  that MARI, ReFT and LoRA record, ``Session.record_step``; runs before issue 59 recorded no step term).
* ``evaluate``: one ``lm_eval.simple_evaluate`` call of an entry (lm-eval's ``hf`` or ``MariLM`` with a
  method's bundle) on a task group, with a fresh model object each time (as each lm-eval command
  has its own), wall time end to end and the time spent inside the model's request methods.
* ``shared``: the repro's evaluation path (repro/engine/scoring.py): one ``SharedPass`` over the model, a
  ``MariLM`` of each entry built on it before any evaluates, then each entry's ``simple_evaluate`` in
  turn; every question's rows of all entries are computed when the first asks (one question at a
  time), so the time inside the model is summed over the entries.
* ``generate``: SORRY-Bench prompts one at a time (``repro.benchmark.timing``), for the base model and for
  MARI with its gate forced closed or open (the gate's threshold tau_E set to +inf or -inf, so
  that each path's cost is timed whatever a random model's energies are).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mari_eval.training import memory
from mari_eval.benchmarks.tasks import task_manager
from mari_eval.training.epochs import EpochLoop
from mari_eval.training.session import Session
from mari_eval.evaluation.lm import MariLM
from mari_eval.methods import load_bundle
from mari_eval.training.train import train as train_bundle
from repro.benchmark import timing

# The methods whose bundles are trained, MARI first (its memory figure is the one the goals ask for).
METHODS = ("mari", "caa", "iti", "nl_iti", "reft")


@dataclass(frozen=True)
class Entry:
    """One row of the evaluation tables: lm-eval's ``hf``, or ``MariLM`` with a method's bundle."""

    name: str
    method: str | None = None  # whose bundle MariLM loads (None: no bundle)
    options: dict[str, Any] = field(default_factory=dict)  # MariLM model args beside the bundle
    tau: float | None = None  # MARI: its gate's threshold tau_E forced (-inf: opens on every prompt)

    @property
    def is_hf(self) -> bool:
        return self.name == "hf"


ENTRIES = {e.name: e for e in [Entry("hf"), Entry("vanilla"), Entry("mari", "mari"),
                                Entry("mari_gate_off", "mari", {"gate": False}), Entry("mari_open", "mari", tau=-math.inf),
                                *(Entry(m, m) for m in METHODS if m != "mari")]}


@dataclass(frozen=True)
class TaskGroup:
    """What one evaluation step runs: lm-eval task names and the documents of each (``limit``)."""

    name: str
    tasks: tuple[str, ...]
    limit: int
    metric: str = "acc,none"


@dataclass
class Bench:
    """The state the steps share: the model, its tokenizer, the trained bundles, one task manager."""

    model: Any
    tokenizer: Any
    model_name: str
    device: str
    dtype: str
    max_batch_size: int
    work: Path  # where bundles are written
    bundles: dict[str, Path] = field(default_factory=dict)
    _manager: Any = None

    @property
    def manager(self):
        """lm-eval's task index of this project's task folder alone (every task the benchmark runs is there)."""
        if self._manager is None:
            self._manager = task_manager(())
        return self._manager

    def lm(self, entry: Entry, batch_size: int | str):
        """A fresh lm-eval model object of ``entry`` around the shared model."""
        if entry.is_hf:
            from lm_eval.models.huggingface import HFLM  # deferred: lm-eval is heavy; only the hf entry needs it

            return HFLM(pretrained=self.model, tokenizer=self.tokenizer, batch_size=batch_size,
                        max_batch_size=self.max_batch_size, device=self.device, dtype=self.dtype)
        bundle = None
        if entry.method is not None:
            if entry.method not in self.bundles:
                raise LookupError(f"no {entry.method} bundle: its training step did not finish")
            bundle = self.bundles[entry.method]
        # no max_batch_size, as `lm_eval --model mari` without the flag: MariLM's batches are sized by tokens
        lm = MariLM(pretrained=self.model, tokenizer=self.tokenizer, batch_size=batch_size, device=self.device,
                    dtype=self.dtype, bundle=bundle, **entry.options)
        if entry.tau is not None:
            lm.intervention.tau = entry.tau  # read by the gate at every prompt (MARI.screen)
        return lm


# ----------------------------------------------------------------------------- GPU memory


def _cuda(bench: Bench) -> bool:
    return str(bench.device).startswith("cuda") and torch.cuda.is_available()


def _reset_peak(bench: Bench) -> int | None:
    """Start a peak-memory window; the bytes allocated now (None on the CPU)."""
    if not _cuda(bench):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(bench: Bench) -> int | None:
    if not _cuda(bench):
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def weights_bytes(model: torch.nn.Module) -> int:
    """N parameters x b bytes, and the buffers (the memory model's "weights on top")."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class PlannedMemory:
    """Records every ``memory.Plan`` that training's ``Session.prepare`` makes while active: the
    bytes each prepared set keeps, by the memory model's formula (``Session.prepare``'s sum)."""

    def __init__(self):
        self.plans: list = []
        self.largest_step = 0  # the largest training step's activations a method recorded (``Session.record_step``)
        self.marks: list[dict] = []  # on CUDA: memory allocated and the peak so far, at each stage's start and end

    def mark(self, what: str) -> None:
        if torch.cuda.is_available():
            self.marks.append({"at": what, "allocated_bytes": torch.cuda.memory_allocated(),
                               "peak_so_far_bytes": torch.cuda.max_memory_allocated()})

    def __enter__(self):
        self._original, self._run, self._step = memory.plan, EpochLoop.run, Session.record_step

        def step(session, made):
            self.largest_step = max(self.largest_step, made.total)
            return self._step(session, made)

        def recorded(estimate, budget):
            made = self._original(estimate, budget)
            self.plans.append(made)
            self.mark(f"prepare {estimate.examples} examples")
            return made

        def run(loop, *args, **kwargs):  # a training stage's epochs (experts, probe...)
            self.mark(f"{loop.stage} start")
            try:
                return self._run(loop, *args, **kwargs)
            finally:
                self.mark(f"{loop.stage} end")

        memory.plan, EpochLoop.run, Session.record_step = recorded, run, step
        return self

    def __exit__(self, *exc):
        self.mark("end")
        memory.plan, EpochLoop.run, Session.record_step = self._original, self._run, self._step

    @property
    def held_bytes(self) -> int:
        return sum(p.estimate.shared_bytes + (p.estimate.cache_bytes if p.keep_caches else 0)
                   + (p.estimate.lower_bytes if p.keep_lower else 0) for p in self.plans)

    def sets(self) -> list[dict]:
        return [{"examples": p.estimate.examples, "shared_tokens": p.estimate.shared_tokens,
                 "shared_bytes": p.estimate.shared_bytes, "cache_bytes": p.estimate.cache_bytes,
                 "lower_bytes": p.estimate.lower_bytes, "keep_caches": p.keep_caches, "keep_lower": p.keep_lower}
                for p in self.plans]


# ----------------------------------------------------------------------------- steps


def train(bench: Bench, method: str, hyperparameters: dict, seed: int, max_train: int | None, max_ctrl: int | None,
          max_pca: int | None) -> dict:
    """``method``'s bundle on TruthfulQA's D_train, trained through ``bench``'s model."""
    lm = bench.lm(ENTRIES["vanilla"], 1)
    out = bench.work / f"{method}-truthfulqa"
    before = _reset_peak(bench)
    started = time.perf_counter()
    with PlannedMemory() as planned:
        train_bundle(method, "truthfulqa", bench.model_name, seed, out, max_train=max_train, max_ctrl=max_ctrl,
                     max_pca=max_pca, hyperparameters=hyperparameters, checkpoints=bench.work / f"{method}.checkpoint",
                     lm=lm)
    wall = time.perf_counter() - started
    peak = _peak(bench)
    bench.bundles[method] = out
    config = load_bundle(out).config
    splits = config.get("splits", {})
    result = {"method": method, "wall_s": wall, "train_seconds_recorded": config.get("train_seconds"),
              "hyperparameters_given": hyperparameters, "hyperparameters": config.get("hyperparameters"),
              "train_examples": len(splits.get("train_used", [])), "ctrl_examples": len(splits.get("ctrl_used", [])),
              "layer": config.get("site", {}).get("layer")}
    weights = weights_bytes(bench.model)
    estimate = weights + planned.held_bytes + planned.largest_step
    result["memory"] = {"weights_bytes": weights, "held_estimate_bytes": planned.held_bytes,
                        "step_estimate_bytes": planned.largest_step, "estimate_bytes": estimate,
                        "allocated_before_bytes": before, "peak_allocated_bytes": peak,
                        "peak_over_estimate": None if peak is None else peak / estimate,
                        "above_before_over_held": None if peak is None or not planned.held_bytes
                        else (peak - before) / planned.held_bytes, "sets": planned.sets(), "marks": planned.marks}
    return result


def _timed(lm, names: tuple[str, ...]) -> dict[str, float]:
    """Wrap ``lm``'s methods ``names`` (those it has) so that the seconds spent in them are added up."""
    spent = {"model_s": 0.0}
    for name in names:
        method = getattr(lm, name, None)
        if method is None:
            continue

        def wrapper(*args, _method=method, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                spent["model_s"] += time.perf_counter() - started

        setattr(lm, name, wrapper)
    return spent


def _question_batches(lm) -> list[dict]:
    """Wrap MariLM's ``_question_batches`` so that how each log-likelihood call cut its questions into
    batches (``mari_eval.evaluation.batching``) is recorded: questions, batches, the largest batch in questions
    and in requests, and the row tokens each pass may hold."""
    calls: list[dict] = []
    original = getattr(lm, "_question_batches", None)
    if original is None:  # lm-eval's hf
        return calls

    def recorded(ordered):
        runs, batches = original(ordered)
        requests = [sum(len(ordered[q][3]) for q in batch) for batch in batches]
        calls.append({"questions": len(ordered), "batches": len(batches),
                      "largest_batch_questions": max(map(len, batches), default=0),
                      "largest_batch_requests": max(requests, default=0),
                      "max_tokens_per_pass": getattr(runs, "max_tokens", None)})
        return runs, batches

    lm._question_batches = recorded
    return calls


def _batch_used(lm, given, mari_calls: list[dict]) -> dict:
    """The batch size asked for, and what the model object used: HFLM's auto-detected size per
    schedule window (``batch_sizes``), MariLM's question batches (``_question_batches``)."""
    sizes = getattr(lm, "batch_sizes", None)
    return {"batch_size": given, "batch_size_per_gpu": getattr(lm, "batch_size_per_gpu", None),
            "batch_sizes_detected": {str(k): v for k, v in sizes.items()} if isinstance(sizes, dict) and sizes else None,
            "max_batch_size": getattr(lm, "max_batch_size", None), "mari_batches": mari_calls or None}


def evaluate(bench: Bench, entry: Entry, group: TaskGroup, batch_size: int | str) -> dict:
    """One ``simple_evaluate`` of ``entry`` on ``group``: wall time, time in the model, metrics."""
    from lm_eval import simple_evaluate  # deferred: lm-eval is heavy; only this path needs it

    lm = bench.lm(entry, batch_size)
    spent = _timed(lm, ("loglikelihood", "generate_until"))
    detect = _timed(lm, ("_detect_batch_size",))  # HFLM's batch_size=auto search (inside the model time)
    mari_calls = _question_batches(lm)
    _reset_peak(bench)
    started = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=list(group.tasks), limit=group.limit, task_manager=bench.manager,
                          bootstrap_iters=0, log_samples=False)
    wall = time.perf_counter() - started
    metrics = {task: out["results"][task].get(group.metric) for task in group.tasks}
    documents = {task: out["n-samples"][task]["effective"] for task in group.tasks}
    finite = [v for v in metrics.values() if isinstance(v, (int, float)) and math.isfinite(v)]
    return {"entry": entry.name, "task": group.name, "tasks": list(group.tasks), "wall_s": wall,
            "model_s": spent["model_s"], "batch_detect_s": detect["model_s"], "metric": group.metric, "metrics": metrics,
            "metric_mean": sum(finite) / len(finite) if finite else None, "documents": documents,
            "gate_rate": timing.gate_rate(lm), **_batch_used(lm, batch_size, mari_calls), "peak_allocated_bytes": _peak(bench)}


def shared(bench: Bench, entries: list[Entry], group: TaskGroup) -> dict:
    """``entries`` (MariLM's, without forced gates) on ``group`` through one ``SharedPass``, as the repro scores
    its rows (module docstring): wall time and time inside the model over all of them, each entry's metric."""
    from lm_eval import simple_evaluate  # deferred: lm-eval is heavy; only this path needs it

    from mari_eval.evaluation.shared_pass import SharedPass
    from repro.engine.profiles import GENERATION_BATCH

    missing = [e.method for e in entries if e.method is not None and e.method not in bench.bundles]
    if missing or any(e.is_hf or e.tau is not None or e.options for e in entries):
        raise LookupError(f"the shared pass runs MariLM entries with their bundles as trained: {[e.name for e in entries]}"
                          f" (no bundle: {missing})")
    joined = SharedPass(bench.model)
    lms = [MariLM(pretrained=bench.model, tokenizer=bench.tokenizer, batch_size=GENERATION_BATCH, device=bench.device,
                  dtype=bench.dtype, bundle=bench.bundles.get(e.method), shared_pass=joined) for e in entries]
    spent = [_timed(lm, ("loglikelihood",)) for lm in lms]
    _reset_peak(bench)
    metrics, documents = {}, {}
    started = time.perf_counter()
    for entry, lm in zip(entries, lms):
        out = simple_evaluate(model=lm, tasks=list(group.tasks), limit=group.limit, task_manager=bench.manager,
                              bootstrap_iters=0, log_samples=False)
        metrics[entry.name] = {task: out["results"][task].get(group.metric) for task in group.tasks}
        documents = {task: out["n-samples"][task]["effective"] for task in group.tasks}
    return {"task": group.name, "tasks": list(group.tasks), "entries": [e.name for e in entries],
            "methods": [e.method for e in entries], "wall_s": time.perf_counter() - started,
            "model_s": sum(s["model_s"] for s in spent), "metric": group.metric, "metrics": metrics,
            "documents": documents, "shared_stats": dict(joined.stats), "peak_allocated_bytes": _peak(bench)}


def warm(bench: Bench, group: TaskGroup) -> dict:
    """Build ``group``'s tasks once, untimed by the evaluations: the data read, BBQ's process_docs
    cached on disk, as an lm-eval user's second run finds them (the first entry would pay it alone)."""
    from lm_eval.tasks import get_task_dict  # deferred: lm-eval is heavy; only this path needs it

    started = time.perf_counter()
    get_task_dict(list(group.tasks), bench.manager)
    return {"task": group.name, "wall_s": time.perf_counter() - started}


def task_index(bench: Bench) -> dict:
    """lm-eval's task index with this project's tasks, built once for every evaluation."""
    started = time.perf_counter()
    bench.manager  # built on first use
    return {"wall_s": time.perf_counter() - started}


GATE_MODES = {"base": ENTRIES["vanilla"], "mari_gate_closed": Entry("mari_closed", "mari", tau=math.inf),
              "mari_gate_open": ENTRIES["mari_open"],  # tau_E forced: the cost of each path, whatever the energies
              # open, routed over one greedy step (eq:entropy_gen's T_ent = 1) instead of the bundle's 8
              "mari_gate_open_t1": Entry("mari_open_t1", "mari", {"T_ent": 1}, tau=-math.inf)}


def generate(bench: Bench, mode: str, prompts: int, tokens: int) -> dict:
    """``prompts`` SORRY-Bench generations of ``tokens`` tokens, one at a time, under ``mode``."""
    entry = GATE_MODES[mode]
    tau = entry.tau
    lm = bench.lm(entry, 1)
    _reset_peak(bench)
    started = time.perf_counter()
    result = timing.time_generation(lm, timing.sorry_prompt_ids(lm, prompts), tokens)
    window = getattr(lm.intervention, "routing_window", None) if lm.intervention is not None else None
    return {"mode": mode, "tau_E": None if tau is None else str(tau), "T_ent": window, **result,
            "wall_s": time.perf_counter() - started, "peak_allocated_bytes": _peak(bench)}
