"""Scoring a table's rows: each row's evaluations asked of the store (``repro.engine.cache.Store``, which
runs ``repro.engine.lm_eval_run.evaluate`` for what it has not stored), their figures and per-document
scores per column, and the shared pass that lets the rows of a table share the frozen model's
work (``score_rows``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from repro.engine.cache import Store
from repro.engine.cache_keys import generation_task
from repro.engine.completions import cell_completions
from repro.engine.judged import judged_column
from repro.engine.lm_eval_run import mari_lm, shared_pass_over
from repro.engine.profiles import PERCENT_COLUMNS, Profile

log = logging.getLogger("repro")


def task_groups(profile: Profile, columns: list[tuple]) -> dict[tuple, list[str]]:
    """{(attribute, document limit, generation length, own step): the profile's tasks of ``columns``}: the
    tasks evaluated together, under one bundle, in one lm-eval run; a task of ``profile.own_step`` alone
    (its name the key's last part, else None)."""
    groups: dict[tuple, list[str]] = {}
    for column, task, metric, attribute in columns:
        key = (attribute, profile.limits.get(task), profile.gen_tokens.get(task), task if task in profile.own_step else None)
        if profile.task(task) not in groups.setdefault(key, []):
            groups[key].append(profile.task(task))
    return groups


def score(store: Store, profile: Profile, model: str, seed: int, columns: list[tuple], bundles: dict[str, Path | None],
          model_args: str = "") -> dict[str, dict]:
    """{column: {"value", "n", "diagnostics"}} for ``columns`` (BENCHMARKS-like tuples), each task
    evaluated under the bundle of its attribute (none: the base model); tasks that share a bundle,
    a document limit and a generation length run together."""
    # Keyed by attribute and task: the same task (MMLU, ARC) runs under several attributes' bundles.
    evaluated: dict[tuple[str | None, str], dict] = {}
    for (attribute, limit, gen_tokens, _), tasks in task_groups(profile, columns).items():
        found = store.evaluations(model, tasks, limit, bundles.get(attribute), model_args, gen_tokens, seed)
        evaluated.update({(attribute, task): result for task, result in found.items()})
    out = {}
    for column, task, metric, attribute in columns:
        result = evaluated[attribute, profile.task(task)]
        scale = 100 if column in PERCENT_COLUMNS else 1
        value = result["metrics"].get(metric)
        value = float("nan") if value is None else float(value) * scale
        stderr = result["metrics"].get(metric.replace(",", "_stderr,", 1))
        documents = {doc: None if v is None else v * scale for doc, v in result["documents"].get(metric, {}).items()}
        out[column] = {"value": value, "n": result["n"], "diagnostics": result.get("diagnostics"), "documents": documents,
                       "stderr": float(stderr) * scale if isinstance(stderr, (int, float)) else None}
        if generation_task(profile.task(task)):  # what it wrote, or documents None (repro/engine/completions.py)
            out[column]["completions"] = cell_completions(result, profile.task(task), metric, bundles.get(attribute),
                                                           model_args)
        if judged_column(profile.task(task), metric):  # repro/engine/judged.py: its judge and unparseable verdicts
            out[column].update(judged=True, judge=result.get("judge"))
    return out


# A table row to score: the bundle of each attribute (none: the base model) and the lm-eval model_args.
Row = tuple[dict[str, Path | None], str]


def evaluation_runs(store: Store, profile: Profile, model: str, seed: int, columns: list[tuple],
                    rows: dict[str, Row]) -> dict[tuple, dict[tuple, tuple[tuple, bool]]]:
    """{(tasks, document limit, generation length): {(bundle, model_args): (the arguments of its
    ``Store.evaluations``, whether some of it is not stored)}}: the lm-eval runs a table's rows
    need, grouped as ``score_rows`` shares them (one group, one shared pass; a step of the plan,
    repro/engine/steps.py). The same tasks under several attributes' bundles form one group, and rows
    that evaluate the same thing (same bundle and model_args) join it once. A bundle not trained
    yet has nothing stored."""
    runs: dict[tuple, dict[tuple, tuple[tuple, bool]]] = {}
    for (attribute, limit, gen_tokens, _), tasks in task_groups(profile, columns).items():
        members = runs.setdefault((tuple(tasks), limit, gen_tokens), {})
        for bundles, model_args in rows.values():
            bundle = bundles.get(attribute)
            args = (model, tasks, limit, bundle, model_args, gen_tokens, seed)
            if (bundle, model_args) not in members:
                members[bundle, model_args] = (args, bool(store.missing(*args)))
    return runs


def evaluate_group(store: Store, model: str, tasks: tuple[str, ...], todo: dict[tuple, tuple]) -> None:
    """Compute and store the evaluations of one group (``evaluation_runs``: {(bundle, model_args):
    arguments}, the rows not stored): several rows over one shared pass, all joined before the
    first evaluates; one row alone as ``Store.evaluations`` runs it."""
    if len(todo) == 1:
        store.evaluations(*next(iter(todo.values())))
    elif todo:
        shared = shared_pass_over(model, store.placement)
        lms = {key: mari_lm(model, key[0], key[1], store.placement, shared) for key in todo}  # all joined first
        for key, args in todo.items():
            store.evaluations(*args, lm=lms.pop(key))
        log.info("shared pass over %d runs of %s: %s", len(todo), ", ".join(tasks), dict(shared.stats))


def score_rows(store: Store, profile: Profile, model: str, seed: int, columns: list[tuple],
               rows: dict[str, Row]) -> dict[str, dict[str, dict]]:
    """``score`` for every row of a table on the same documents: {row label: {column: result}}.

    The rows whose evaluations are not stored are evaluated one after the other over one
    ``SharedPass`` per list of tasks (mari_eval/evaluation/shared_pass.py): the frozen model's prefix and
    untouched option rows are computed once for all of them, each row's lm-eval run still
    scoring its own metrics. The same tasks under several attributes' bundles (MMLU and ARC
    under the TruthfulQA, BBQ and SORRY-Bench ones) share one pass too. Rows that evaluate the
    same thing (same bundle and model_args: Vanilla under every attribute) join once."""
    for (tasks, _, _), members in evaluation_runs(store, profile, model, seed, columns, rows).items():
        evaluate_group(store, model, tasks, {row: args for row, (args, missing) in members.items() if missing})
    return {label: score(store, profile, model, seed, columns, bundles, model_args)
            for label, (bundles, model_args) in rows.items()}
