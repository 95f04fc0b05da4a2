"""Scoring a table's rows: lm-eval runs of the frozen model under each row's bundle, their
figures and per-document scores per column, and the shared pass that lets the rows of a
table share the frozen model's work (``score_rows``). The results are cached by
``repro.cache.Store``; this module computes them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import time
from pathlib import Path

from repro.cache import LM_EVAL_BOOTSTRAP, Store
from repro.documents import check_against, document_scores
from repro.profiles import PERCENT_COLUMNS, REPO, Profile

log = logging.getLogger("repro")


_BASE_MODELS: dict[tuple, tuple] = {}  # (model name, placement) -> (frozen model, tokenizer), loaded once per process
# Prompts generated together (SORRY-Bench, GSM8K): lm-eval's batch_size, which MariLM uses for
# generation only (log-likelihood requests go by question). Left-padded batches give each prompt
# the answer it gets alone up to float rounding; 16 prompts cost about 3x less than one at a time
# on 2 CPU cores. A row's model_args may still set batch_size.
GENERATION_BATCH = 16


def _mari_lm(model: str, bundle: Path | None, model_args: str, placement=None, shared_pass=None):
    from lm_eval.utils import simple_parse_args_string

    from mari_eval.lm import MariLM
    from mari_eval.devices import Placement

    placement = placement or Placement()
    if (model, placement) not in _BASE_MODELS:  # loaded in the placement; the later MariLMs share the loaded model
        first = MariLM(pretrained=model, **placement.model_args())
        _BASE_MODELS[(model, placement)] = (first.model, first.tokenizer)
    frozen, tokenizer = _BASE_MODELS[(model, placement)]
    kwargs = {"batch_size": GENERATION_BATCH, **(simple_parse_args_string(model_args) if model_args else {})}
    return MariLM(pretrained=frozen, tokenizer=tokenizer, bundle=str(bundle) if bundle else None,
                  shared_pass=shared_pass, **kwargs)


def _shared_pass(model: str, placement=None):
    """A shared pass over ``model`` as loaded for this placement (``_mari_lm``'s base model)."""
    from mari_eval.devices import Placement
    from mari_eval.shared_pass import SharedPass

    placement = placement or Placement()
    if (model, placement) not in _BASE_MODELS:
        _mari_lm(model, None, "", placement)  # loads it
    return SharedPass(_BASE_MODELS[(model, placement)][0])


def _task_names(out: dict, name: str) -> set[str]:
    """A task's name and, for a group (MMLU), the names of all its subtasks, at any depth."""
    return {name}.union(*(_task_names(out, sub) for sub in out.get("group_subtasks", {}).get(name, [])))


def _documents(out: dict, name: str) -> int:
    """Documents evaluated for a task or, for a group, summed over its subtasks."""
    return sum(out["n-samples"][t]["effective"] for t in _task_names(out, name) if t in out["n-samples"])


def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement=None, lm=None) -> dict[str, dict]:
    from lm_eval import simple_evaluate

    if any(t.startswith("sorry") for t in tasks):
        _ensure_judge()
    lm = lm or _mari_lm(model, bundle, model_args, placement)
    started = time.time()
    # Samples are logged for the per-document scores (repro/documents.py); the bootstrap iterations
    # only give lm-eval's own standard errors (closed form for means), kept beside our intervals.
    out = simple_evaluate(
        model=lm, tasks=list(tasks), limit=limit, bootstrap_iters=LM_EVAL_BOOTSTRAP, log_samples=True,
        gen_kwargs=f"max_gen_toks={gen_tokens}" if gen_tokens else None,
        task_manager=_task_manager(split_seed or 0),
    )
    seconds = round(time.time() - started, 1)
    results = {}
    for task in tasks:
        metrics = {k: v for k, v in out["results"][task].items() if isinstance(v, (int, float)) or v is None}
        diagnostics = None
        if lm.intervention is not None:  # a group's records name its subtasks
            names = _task_names(out, task)
            diagnostics = lm.intervention.summarize([r for r in lm.records if r.get("task") in names])
        names = sorted(_task_names(out, task))
        scores = document_scores(out["samples"], names, task)
        check_against(scores, metrics, task)
        results[task] = {"metrics": metrics, "n": _documents(out, task), "seconds": seconds, "tasks_run_together": list(tasks),
                         "documents": scores,
                         "model_dtype": str(lm.model.dtype).removeprefix("torch."),  # what it computed in
                         "diagnostics": diagnostics}
    return results


@functools.lru_cache(maxsize=None)
def _task_manager(split_seed: int):
    """lm-eval's index of the tasks (ours and its built-ins), built once per split seed: it reads
    every task YAML (about 4 s), and a table evaluates several rows per task group."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(REPO / "harness_tasks"), metadata={"split_seed": split_seed})


_JUDGE = contextlib.ExitStack()


def _ensure_judge() -> None:
    """SORRY-Bench tasks need a judge: the configured one (MARI_JUDGE_*), else the embedded one,
    started once for this process and stopped at its exit (mari_eval.judge.judge_environment)."""
    from mari_eval.judge import ENV_BASE_URL, ENV_MODEL, judge_environment

    if os.environ.get(ENV_BASE_URL) and os.environ.get(ENV_MODEL):
        return
    os.environ.update(_JUDGE.enter_context(judge_environment()))
    atexit.register(_JUDGE.close)


def task_groups(profile: Profile, columns: list[tuple]) -> dict[tuple, list[str]]:
    """{(attribute, document limit, generation length): the profile's tasks of ``columns``}: the
    tasks evaluated together, under one bundle, in one lm-eval run."""
    groups: dict[tuple, list[str]] = {}
    for column, task, metric, attribute in columns:
        key = (attribute, profile.limits.get(task), profile.gen_tokens.get(task))
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
    for (attribute, limit, gen_tokens), tasks in task_groups(profile, columns).items():
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
    return out


# A table row to score: the bundle of each attribute (none: the base model) and the lm-eval model_args.
Row = tuple[dict[str, Path | None], str]


def score_rows(store: Store, profile: Profile, model: str, seed: int, columns: list[tuple],
               rows: dict[str, Row]) -> dict[str, dict[str, dict]]:
    """``score`` for every row of a table on the same documents: {row label: {column: result}}.

    The rows whose evaluations are not stored are evaluated one after the other over one
    ``SharedPass`` per list of tasks (mari_eval/shared_pass.py): the frozen model's prefix and
    untouched option rows are computed once for all of them, each row's lm-eval run still
    scoring its own metrics. The same tasks under several attributes' bundles (MMLU and ARC
    under the TruthfulQA, BBQ and SORRY-Bench ones) share one pass too. Rows that evaluate the
    same thing (same bundle and model_args: Vanilla under every attribute) join once."""
    runs: dict[tuple, dict[tuple, tuple]] = {}  # (tasks, limit, generation length) -> {(bundle, model_args): arguments}
    for (attribute, limit, gen_tokens), tasks in task_groups(profile, columns).items():
        todo = runs.setdefault((tuple(tasks), limit, gen_tokens), {})
        for bundles, model_args in rows.values():
            bundle = bundles.get(attribute)
            args = (model, tasks, limit, bundle, model_args, gen_tokens, seed)
            if (bundle, model_args) not in todo and store.missing(*args):
                todo[bundle, model_args] = args
    for (tasks, _, _), todo in runs.items():
        if len(todo) > 1:
            shared = _shared_pass(model, store.placement)
            lms = {key: _mari_lm(model, key[0], key[1], store.placement, shared) for key in todo}  # all joined first
            for key, args in todo.items():
                store.evaluations(*args, lm=lms.pop(key))
            log.info("shared pass over %d runs of %s: %s", len(todo), ", ".join(tasks), dict(shared.stats))
    return {label: score(store, profile, model, seed, columns, bundles, model_args)
            for label, (bundles, model_args) in rows.items()}
