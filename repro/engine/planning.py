"""The steps of a repro script's table, named before anything runs (issue 40), and how a script
runs them: ``--plan`` prints the graph, ``--executor ray`` computes its steps on a Ray cluster.

A table is rows (a method's bundles per attribute, and the lm-eval model_args they are
evaluated with) scored on columns, per model and seed. ``train_step`` adds the step that
trains one bundle; ``evaluation_steps`` the steps that evaluate the rows, one per group of
rows and tasks that share a pass (``scoring.evaluation_runs``, the grouping ``score_rows``
uses). Every step carries its cost (repro/engine/costs.py) and the action an executor runs
(repro/engine/steps.py, repro/engine/ray_executor.py). The main table, the ablation table and the
sensitivity sweep build their graphs from these two.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from mari_eval.methods import registry
from repro.engine import costs, scoring, steps
from repro.engine.cache import Store
from repro.engine.profiles import Profile

log = logging.getLogger("repro")

_collected: list | None = None  # graph_of: the plans built, not printed


def graph_of(main: Callable[[list[str]], int], argv: list[str]) -> tuple[steps.Graph, Store, Profile]:
    """The steps a script's command line (its ``main`` and ``argv``) would take, built as ``--plan``
    builds them, with the store and profile it reads them from; nothing printed, nothing run."""
    global _collected
    _collected = []
    try:
        main([*argv, "--plan"])
        if not _collected:
            raise ValueError(f"{argv}: this command line builds no plan")
        return _collected[0]
    finally:
        _collected = None


def train_step(graph: steps.Graph, store: Store, profile: Profile, method: str, attribute: str, model: str, seed: int,
               settings: dict[str, Any] | None = None) -> Path:
    """Add the step that trains ``method``'s bundle on ``attribute`` (``Store.bundle``'s arguments);
    returns the bundle's directory (a row's bundle in ``evaluation_steps``)."""
    final, config = store.bundle_target(method, attribute, model, seed, profile, settings)
    epochs = registry.method_class(method).planned_epochs(config["hyperparameters"], costs.train_examples(attribute, profile))
    flops = costs.training_flops(model, method, attribute, profile, epochs)
    seconds = costs.training_seconds(model, method, attribute, profile, epochs)
    label = f"train {method} on {attribute}, {model}, seed {seed}" + (f" ({json.dumps(settings)})" if settings else "")
    graph.add(steps.Step(final.name, steps.TRAIN, label, cached=store.is_stored(final, config), flops=flops,
                         seconds=seconds, gpus=costs.gpus_needed(model, training=True),
                         action=steps.Train(method, attribute, model, seed, json.dumps(settings))))
    return final


def evaluation_steps(graph: steps.Graph, store: Store, profile: Profile, model: str, seed: int, columns: list[tuple],
                     rows: dict[str, scoring.Row], method_of: dict[Path | None, str | None], part: str = "") -> None:
    """Add the steps that evaluate ``rows`` on ``columns`` (one per shared pass); ``method_of``: the
    method of each row's bundle (None: the base model), for the cost of reading the prompts;
    ``part``: a name for these rows, where one graph evaluates other rows on the same tasks apart."""
    method_of = {None: None, **method_of}
    for (tasks, limit, gen), members in scoring.evaluation_runs(store, profile, model, seed, columns, rows).items():
        todo = [row for row, (_, missing) in members.items() if missing] or list(members)
        row_methods = [method_of[bundle] for bundle, _ in todo]
        per_row = costs.row_variants([(method_of[bundle], bundle, args) for bundle, args in todo])
        sizes = [costs.TaskSize.of(task, limit) for task in tasks]
        flops = sum(costs.evaluation_flops(model, size, row_methods, gen, per_row=per_row) for size in sizes)
        seconds = sum(costs.evaluation_seconds(model, size, row_methods, gen, per_row=per_row) for size in sizes)
        key = f"evaluate {model} s{seed} {'+'.join(tasks)} limit {limit} gen {gen}" + (f" ({part})" if part else "")
        graph.add(steps.Step(key, steps.EVALUATE,
                             f"evaluate {len(members)} rows on {', '.join(tasks)}, {model}, seed {seed}",
                             needs=tuple(sorted({b.name for b, _ in members if b is not None})),
                             cached=not any(missing for _, missing in members.values()), flops=flops,
                             seconds=seconds, gpus=costs.gpus_needed(model, training=False),
                             action=steps.Evaluate(model, seed, tuple(tasks), limit, gen,
                                                           tuple((b.name if b else None, a) for b, a in todo))))


def add_arguments(parser) -> None:
    """``--plan``, ``--executor`` and ``--ray-address``, for a script that builds its steps."""
    parser.add_argument("--plan", action="store_true",
                        help="print the steps this run would take (which are cached, their estimated GPU-hours, "
                             "the critical path, the ideal wall time on 1, 8 and 32 GPUs) and exit")
    parser.add_argument("--executor", default="local", choices=["local", "ray"],
                        help="local (default): every step in this process, rows sharing passes; ray: each step a "
                             "Ray task (pip install 'mari-eval[ray]'), on a local cluster or --ray-address")
    parser.add_argument("--ray-address", help="with --executor ray: auto (the cluster this machine belongs to) or "
                                              "HOST:PORT; default: start a local cluster")


def before_the_table(args, graph: Callable[[], steps.Graph], title: str, store: Store, profile: Profile) -> bool:
    """What ``add_arguments``' flags ask before a script computes its table: with ``--plan``, print
    the graph and return True (the script stops there); with ``--executor ray``, compute every
    step on Ray and store it under --runs, so that the table is then read back."""
    if args.plan:
        if _collected is not None:
            _collected.append((graph(), store, profile))
        else:
            print(steps.render(graph(), title, on_cpu=not profile.cuda_placement))  # the paper's grid is a GPU one
        return True
    if args.ray_address and args.executor != "ray":
        raise SystemExit("--ray-address is read by --executor ray only: add --executor ray, or drop --ray-address")
    if args.executor == "ray":
        from repro.engine import ray_executor  # deferred: Ray is optional

        log.info("ray executor: %s", ray_executor.run(graph(), store, profile, args.ray_address))
    return False
