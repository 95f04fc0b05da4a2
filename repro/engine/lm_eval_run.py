"""One lm-eval run of the frozen model under a bundle (``evaluate``): the loaded model shared by
every run of the process, the task index, the judge SORRY-Bench needs, and the run's figures
and per-document scores per task. ``repro.engine.cache.Store`` stores what it returns; the tables'
scoring (``repro.engine.scoring``) asks the store.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import time
from pathlib import Path

from mari_eval.benchmarks.tasks import task_manager
from mari_eval.evaluation import divergence
from mari_eval.injection.devices import Placement
from mari_eval.judge import ENV_BASE_URL, ENV_MODEL, judge_environment
from mari_eval.evaluation.lm import MariLM
from mari_eval.evaluation.shared_pass import SharedPass
from repro.engine.completions import FIELD as COMPLETIONS, generated
from repro.engine import divergence_run
from repro.engine.documents import check_against, document_scores
from repro.engine.profiles import GENERATION_BATCH

LM_EVAL_BOOTSTRAP = 1000  # lm-eval's bootstrap iterations for its stderr of non-mean metrics

log = logging.getLogger("repro")


_BASE_MODELS: dict[tuple, tuple] = {}  # (model name, placement) -> (frozen model, tokenizer), loaded once per process


def mari_lm(model: str, bundle: Path | None, model_args: str, placement=None, shared_pass=None):
    from lm_eval.utils import \
        simple_parse_args_string  # deferred: lm-eval is heavy; only this path needs it

    placement = placement or Placement()
    if (model, placement) not in _BASE_MODELS:  # loaded in the placement; the later MariLMs share the loaded model
        first = MariLM(pretrained=model, **placement.model_args())
        _BASE_MODELS[(model, placement)] = (first.model, first.tokenizer)
    frozen, tokenizer = _BASE_MODELS[(model, placement)]
    kwargs = {"batch_size": GENERATION_BATCH, **(simple_parse_args_string(model_args) if model_args else {})}
    return MariLM(pretrained=frozen, tokenizer=tokenizer, bundle=str(bundle) if bundle else None,
                  shared_pass=shared_pass, **kwargs)


def shared_pass_over(model: str, placement=None):
    """A shared pass over ``model`` as loaded for this placement (``mari_lm``'s base model)."""
    placement = placement or Placement()
    if (model, placement) not in _BASE_MODELS:
        mari_lm(model, None, "", placement)  # loads it
    return SharedPass(_BASE_MODELS[(model, placement)][0])


def _task_names(out: dict, name: str) -> set[str]:
    """A task's name and, for a group (MMLU), the names of all its subtasks, at any depth."""
    return {name}.union(*(_task_names(out, sub) for sub in out.get("group_subtasks", {}).get(name, [])))


def _documents(out: dict, name: str) -> int:
    """Documents evaluated for a task or, for a group, summed over its subtasks."""
    return sum(out["n-samples"][t]["effective"] for t in _task_names(out, name) if t in out["n-samples"])


def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement=None, lm=None) -> dict[str, dict]:
    from lm_eval import simple_evaluate  # deferred: lm-eval is heavy; only this path needs it

    if any(t.startswith("sorry") for t in tasks):
        _ensure_judge()
    lm = lm or mari_lm(model, bundle, model_args, placement)
    results = {task: divergence_run.measure(lm, task, limit) for task in tasks if task in divergence.TASKS}
    tasks = [task for task in tasks if task not in results]
    if not tasks:
        return results
    started = time.time()
    # Samples are logged for the per-document scores (repro/engine/documents.py); the bootstrap iterations
    # only give lm-eval's own standard errors (closed form for means), kept beside our intervals.
    out = simple_evaluate(
        model=lm, tasks=list(tasks), limit=limit, bootstrap_iters=LM_EVAL_BOOTSTRAP, log_samples=True,
        gen_kwargs=f"max_gen_toks={gen_tokens}" if gen_tokens else None,
        task_manager=_task_manager(split_seed or 0, tuple(sorted(tasks))),
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
        texts = generated(out["samples"], names, task, results[task]["n"], lm.max_gen_toks)
        if texts is not None:  # every answer a generation task wrote (repro/engine/completions.py)
            results[task][COMPLETIONS] = texts
        label = judge_label(out, task)
        if label:  # the judge that read it (repro/engine/judged.py)
            results[task]["judge"] = label
    return results


def judge_label(out: dict, task: str) -> str | None:
    """The judge a SORRY-Bench task's verdicts came from, as the task records it in lm-eval's results
    (``configs``/TASK/``metadata``/``judge``/``label``: mari_eval/judge/sorry_bench.py); None for other tasks."""
    judge = ((((out.get("configs") or {}).get(task) or {}).get("metadata") or {}).get("judge"))
    label = judge.get("label") if isinstance(judge, dict) else None
    return label if isinstance(label, str) and label else None


@functools.lru_cache(maxsize=None)
def _task_manager(split_seed: int, tasks: tuple[str, ...]):
    """lm-eval's index of ``tasks`` (ours, and lm-eval's built-ins only where a task is not ours),
    built once per split seed and task group: a table evaluates several rows per task group."""
    return task_manager(tasks, metadata={"split_seed": split_seed})


_JUDGE = contextlib.ExitStack()


def _ensure_judge() -> None:
    """SORRY-Bench tasks need a judge: the configured one (MARI_JUDGE_*), else the embedded one,
    started once for this process and stopped at its exit (mari_eval.judge.judge_environment)."""
    if os.environ.get(ENV_BASE_URL) and os.environ.get(ENV_MODEL):
        return
    os.environ.update(_JUDGE.enter_context(judge_environment()))
    atexit.register(_JUDGE.close)
