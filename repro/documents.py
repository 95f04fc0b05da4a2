"""Per-document scores of an lm-eval run, read from its logged samples and checked against its metrics.

``simple_evaluate(log_samples=True)`` keeps, per task, one sample per (document, filter)
with the document's value of every metric (``process_results``). Those values are what
the intervals and paired tests of the tables resample (repro/intervals.py). For each
metric whose aggregate is the mean of its per-document values, the mean is checked
against the figure lm-eval reported, so a table never carries an interval around one
number and a figure from another. SORRY-Bench's per-document items are responses (its
judge runs in the aggregation); they become the judge's verdict and the keyword match
(``harness_tasks/utils.py sorry_document_scores``), whose means are the two rates.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Any

from repro.profiles import REPO

# {metric key as in lm-eval's results ("acc,none")}: {document id: score (None: no score)}
DocumentScores = dict[str, dict[str, float | None]]

TOLERANCE = 1e-6


@functools.lru_cache(maxsize=1)
def _task_utils():
    """harness_tasks/utils.py (the task YAMLs' functions), loaded by path as lm-eval loads it."""
    spec = importlib.util.spec_from_file_location("mari_eval_task_utils", REPO / "harness_tasks" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def document_scores(samples: dict[str, list[dict]], names: list[str], task: str) -> DocumentScores:
    """Per metric, the score of every document of ``task`` (a group: of all its subtasks
    ``names``; their documents are keyed "subtask/doc_id", a task's own by doc_id)."""
    out: DocumentScores = {}
    for name in names:
        for sample in samples.get(name, []):
            doc = str(sample["doc_id"]) if name == task else f"{name}/{sample['doc_id']}"
            for metric in sample["metrics"]:
                value = sample[metric]
                if isinstance(value, bool) or isinstance(value, (int, float)):
                    out.setdefault(f"{metric},{sample['filter']}", {})[doc] = float(value)
    responses = [s for name in names for s in samples.get(name, []) if isinstance(s.get("refusal_rate"), dict)]
    if responses:
        _add_sorry(out, responses)
    return out


def _add_sorry(out: DocumentScores, samples: list[dict]) -> None:
    scores = _task_utils().sorry_document_scores([s["refusal_rate"] for s in samples])
    for metric, values in scores.items():
        for sample, value in zip(samples, values):
            doc = str(sample["doc_id"])
            out.setdefault(f"{metric},{sample['filter']}", {})[doc] = value


def check_against(documents: DocumentScores, metrics: dict[str, Any], task: str) -> None:
    """Every metric with per-document scores whose mean is what lm-eval reported must match it.

    Metrics aggregated otherwise (BBQ's bias scores, SORRY-Bench's per-category rates) keep
    no per-document scores here; a mismatch is an error naming the task and metric."""
    for metric, scores in list(documents.items()):
        reported = metrics.get(metric)
        values = [v for v in scores.values() if v is not None]
        if not isinstance(reported, (int, float)) or not values:
            del documents[metric]  # no figure to tie the scores to: not kept
            continue
        mean = sum(values) / len(values)
        if math.isnan(reported) or abs(mean - reported) > TOLERANCE * max(1.0, abs(reported)):
            if _aggregated_otherwise(metric):
                del documents[metric]
                continue
            raise ValueError(f"{task} {metric}: the mean of its {len(values)} per-document scores is {mean!r}, "
                             f"lm-eval reported {reported!r}; the per-document scores would not describe the "
                             "figure: this is a bug in repro/documents.py or the task's metrics, report it")


def _aggregated_otherwise(metric: str) -> bool:
    """Metrics whose aggregate is not the mean of per-document numbers (BBQ's accuracies by
    context and bias scores, computed from per-document tuples or subsets)."""
    name = metric.split(",")[0]
    return "bias_score" in name or name.startswith("accuracy_")
