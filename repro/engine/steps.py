"""A repro script's work as a graph of steps, known before anything runs (issue 40).

A step is one unit the cache (repro/engine/cache.py) stores: training a bundle, or evaluating a group
of rows on a group of tasks in one shared pass (repro/engine/scoring.py: rows that share the frozen
model's work stay in one step). Each names the steps whose outputs it reads (an evaluation, the
bundles of its rows), whether its outputs are already stored, and what it costs
(repro/engine/costs.py). ``--plan`` prints the graph and exits (``render``): how many steps, which are
cached, the GPU-hours left, the critical path (the longest chain of dependent steps still to
run: no number of GPUs finishes sooner) and the wall time the steps left take on 1, 8 and 32
GPUs when scheduled as soon as their inputs exist (``makespan``: list scheduling, longest
remaining chain first).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

from repro.engine import costs, scoring
from repro.engine.cache import Store
from repro.engine.profiles import Profile

TRAIN, EVALUATE = "train", "evaluate"


@dataclass(frozen=True)
class Train:
    """What a training step runs: ``Store.bundle``'s arguments (``settings`` as JSON, so the
    action stays hashable and travels to a Ray worker as it is)."""

    method: str
    attribute: str
    model: str
    seed: int
    settings: str = "null"

    def compute(self, store: Store, profile: Profile) -> Path:
        """Train the bundle into ``store`` (or read it back when stored); its directory."""
        return store.bundle(self.method, self.attribute, self.model, self.seed, profile, json.loads(self.settings))


@dataclass(frozen=True)
class Evaluate:
    """What an evaluation step runs: its rows (a bundle directory name under ``bundles/``, or None
    for the base model, with the model_args it is evaluated with) on ``tasks`` in one shared pass."""

    model: str
    seed: int
    tasks: tuple[str, ...]
    limit: object  # lm-eval's --limit for these tasks (a count, or None)
    gen: object  # the generation length these tasks run with (None: the tasks' own)
    rows: tuple[tuple[str | None, str], ...]

    def _runs(self, store: Store) -> list[tuple]:
        """``Store.evaluations``' arguments for each row."""
        return [(self.model, list(self.tasks), self.limit, store.root / "bundles" / name if name else None, args,
                 self.gen, self.seed) for name, args in self.rows]

    def compute(self, store: Store, profile: Profile) -> None:
        """Evaluate every row into ``store``, the rows sharing one pass (``scoring.evaluate_group``)."""
        scoring.evaluate_group(store, self.model, self.tasks, {(run[3], run[4]): run for run in self._runs(store)})

    def stored(self, store: Store) -> bool:
        """Whether every row's evaluation is in ``store``."""
        return not any(store.missing(*run) for run in self._runs(store))

    def read(self, store: Store) -> None:
        """Read every row's stored evaluation back (``Store.step_seconds`` then holds its seconds)."""
        for run in self._runs(store):
            store.evaluations(*run)


@dataclass(frozen=True)
class Step:
    key: str  # unique: a bundle's directory name, or the evaluation group's description
    kind: str  # TRAIN or EVALUATE
    label: str  # one line for a person
    needs: tuple[str, ...] = ()  # keys of the steps whose outputs this one reads
    cached: bool = False  # its outputs are stored: nothing to run
    flops: float = 0.0
    seconds: float = 0.0  # on one GPU (repro/engine/costs.py: FLOPs at the measured ratio of its kind)
    gpus: int = 1  # GPUs it needs at once (a model too large for one)
    # What an executor runs (repro/engine/ray_executor.py); for an evaluation, the rows not stored.
    action: Train | Evaluate | None = None

    @property
    def cost(self) -> float:
        """GPU-seconds still to spend on it: none once cached."""
        return 0.0 if self.cached else self.seconds * self.gpus


@dataclass
class Graph:
    steps: dict[str, Step] = field(default_factory=dict)

    def add(self, step: Step) -> Step:
        """Add ``step``; a step already there under its key (a bundle two rows read) is kept once."""
        known = self.steps.setdefault(step.key, step)
        if known != step:
            raise ValueError(f"two different steps under one key {step.key!r}: {known.label} / {step.label}")
        return known

    def order(self) -> list[Step]:
        """Every step after the steps it needs (ties in the order they were added)."""
        missing = {n for s in self.steps.values() for n in s.needs if n not in self.steps}
        if missing:
            raise ValueError(f"steps need steps the graph does not hold: {sorted(missing)[:3]}")
        done: set[str] = set()
        ordered: list[Step] = []

        def visit(key: str, path: tuple[str, ...]) -> None:
            if key in done:
                return
            if key in path:
                raise ValueError(f"the steps form a cycle through {key!r}")
            for need in self.steps[key].needs:
                visit(need, path + (key,))
            done.add(key)
            ordered.append(self.steps[key])

        for key in self.steps:
            visit(key, ())
        return ordered

    def tail(self) -> dict[str, float]:
        """{key: the seconds of the longest chain of steps to run from this one's start to the end}."""
        after: dict[str, list[str]] = {k: [] for k in self.steps}
        for step in self.steps.values():
            for need in step.needs:
                after[need].append(step.key)
        tail: dict[str, float] = {}
        for step in reversed(self.order()):
            own = 0.0 if step.cached else step.seconds
            tail[step.key] = own + max((tail[k] for k in after[step.key]), default=0.0)
        return tail

    def critical_path(self) -> float:
        """Seconds of the longest chain of dependent steps still to run: a bound on any wall time."""
        return max(self.tail().values(), default=0.0)

    def makespan(self, gpus: int) -> float:
        """Wall seconds to run the uncached steps on ``gpus`` GPUs: a step starts once its inputs
        exist and enough GPUs are free, the one with the longest remaining chain first."""
        if gpus < 1:
            raise ValueError("a schedule needs at least one GPU")
        tail, order = self.tail(), self.order()
        left = {s.key: sum(not self.steps[n].cached for n in s.needs) for s in order if not s.cached}
        ready = [(-tail[k], k) for k, n in left.items() if n == 0]
        heapq.heapify(ready)
        running: list[tuple[float, str]] = []  # (finish time, key)
        free, now, finished = gpus, 0.0, 0.0
        waiting: list[tuple[float, str]] = []  # ready but too wide for the free GPUs right now
        while ready or running or waiting:
            while ready:
                priority, key = heapq.heappop(ready)
                step = self.steps[key]
                width = min(step.gpus, gpus)  # a step wider than the cluster runs on all of it
                if width <= free:
                    free -= width
                    heapq.heappush(running, (now + step.seconds * step.gpus / width, key))
                else:
                    waiting.append((priority, key))
            for item in waiting:
                heapq.heappush(ready, item)
            waiting = []
            if not running:
                break
            now, key = heapq.heappop(running)
            finished = now
            free += min(self.steps[key].gpus, gpus)
            for step in order:
                if key in step.needs and step.key in left:
                    left[step.key] -= 1
                    if left[step.key] == 0:
                        heapq.heappush(ready, (-tail[step.key], step.key))
        return finished

    def summary(self, gpu_counts: tuple[int, ...] = (1, 8, 32)) -> dict:
        steps = list(self.steps.values())
        return {
            "steps": len(steps), "cached": sum(s.cached for s in steps),
            "by_kind": {kind: {"steps": sum(s.kind == kind for s in steps),
                               "cached": sum(s.kind == kind and s.cached for s in steps),
                               "gpu_hours": sum(s.cost for s in steps if s.kind == kind) / 3600} for kind in (TRAIN, EVALUATE)},
            "gpu_hours": sum(s.cost for s in steps) / 3600, "critical_path_hours": self.critical_path() / 3600,
            "cpu_hours": sum(costs.cpu_seconds(s.flops) for s in steps if not s.cached) / 3600,
            "wall_hours": {str(n): self.makespan(n) / 3600 for n in gpu_counts},
        }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render(graph: Graph, title: str, gpu_counts: tuple[int, ...] = (1, 8, 32), listed: int = 12,
           on_cpu: bool = True) -> str:
    """The plan as text: the totals, then the costliest steps left (repro/engine/costs.py's estimates);
    ``on_cpu``: with the time on 2 CPU cores too (not for a profile made for GPUs)."""
    s = graph.summary(gpu_counts)
    lines = [f"{title}: {s['steps']} steps, {s['cached']} cached"]
    for kind, part in s["by_kind"].items():
        lines.append(f"  {kind:8} {part['steps']:5} steps, {part['cached']:5} cached, {part['gpu_hours']:.2f} GPU-hours left")
    lines.append(f"  left: {s['gpu_hours']:.2f} GPU-hours; critical path {_duration(s['critical_path_hours'] * 3600)}")
    lines.append("  ideal wall time: " + ", ".join(f"{n} GPU{'s' if int(n) > 1 else ''} {_duration(h * 3600)}"
                                                for n, h in s["wall_hours"].items())
                 + (f"; on 2 CPU cores about {_duration(s['cpu_hours'] * 3600)} "
                    "(repro/engine/costs.py CPU_SLOWDOWN, from two measured tables)" if on_cpu else ""))
    todo = sorted((x for x in graph.steps.values() if not x.cached), key=lambda x: -x.cost)
    if todo:
        lines.append(f"  costliest steps left ({min(listed, len(todo))} of {len(todo)}):")
        lines += [f"    {_duration(x.cost):>7}  {x.gpus} GPU  {x.label}" for x in todo[:listed]]
    lines.append("  (estimates: repro/engine/costs.py; 1 GPU = one H100-80GB at the rate --model mari reached in results/gpu_bench.json)")
    return "\n".join(lines)
