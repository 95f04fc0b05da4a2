"""Per-document scores of an lm-eval run, read from its logged samples and checked against its metrics.

``simple_evaluate(log_samples=True)`` keeps, per task, one sample per (document, filter)
with the document's value of every metric (``process_results``). Those values are what
the intervals and paired tests of the tables resample (repro/analysis/intervals.py). For each
metric whose aggregate is the mean of its per-document values, the mean is checked
against the figure lm-eval reported, so a table never carries an interval around one
number and a figure from another. SORRY-Bench's per-document items are responses (its
judge runs in the aggregation); they become the judge's verdict and the keyword match
(``harness_tasks/utils.py sorry_document_scores``), whose means are the two rates.

Clusters. A BBQ document (every task whose name starts with "bbq") belongs to a context that
holds its paired question (``mari_eval.benchmarks.data.bbq_context_key``: category, template, context
text), so its unit of resampling is the context (repro/analysis/intervals.py). Its key carries it:
"DOC@context:CATEGORY|TEMPLATE|HASH" (``cluster_id``: the context text as the first 12 hex
digits of its key's sha256), read from the logged sample's dataset record (``sample["doc"]``);
``split_clusters`` takes the keys apart again ({document: score}, {document: cluster}, unit).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
from typing import Any

from mari_eval.benchmarks.data import bbq_context_key, bbq_template_key
from repro.engine.profiles import BBQ_AMBIGUOUS, BENCHMARKS, GENERAL_UNDER_OTHERS, KEYWORD_REFUSAL, REPO

# {metric key as in lm-eval's results ("acc,none")}: {document id: score (None: no score)}
DocumentScores = dict[str, dict[str, float | None]]

TOLERANCE = 1e-6
CLUSTERED = {"bbq": "context"}  # task name prefix: the unit its documents are resampled in
_MARK = "@"  # "document id@unit:cluster id" (no document id holds it: "N" or "subtask/N")


def cluster_unit(task: str) -> str | None:
    """The unit that ``task``'s documents cluster in ("context" for BBQ), None if each is its own."""
    return next((unit for prefix, unit in CLUSTERED.items() if task.startswith(prefix)), None)


def clustered_columns() -> set[str]:
    """The tables' columns (repro/engine/profiles.py) whose task clusters: their documents must carry clusters."""
    return {column for column, task, *_ in [*BENCHMARKS, *GENERAL_UNDER_OTHERS, KEYWORD_REFUSAL, *BBQ_AMBIGUOUS]
            if cluster_unit(task)}


def cluster_id(record: dict) -> str:
    """A BBQ record's context as a short id: "category|question_index|hash of bbq_context_key"
    (the template, ``bbq_template_key``, is what precedes the last "|")."""
    digest = hashlib.sha256(bbq_context_key(record).encode("utf-8")).hexdigest()[:12]
    return f"{bbq_template_key(record)}|{digest}"


def split_clusters(scores: dict[str, float | None]) -> tuple[dict[str, float | None], dict[str, str] | None, str | None]:
    """({document: score}, {document: cluster} or None, unit or None) of one column's per-document
    scores, whose keys carry the cluster when their task clusters (``document_scores``)."""
    marked = [k for k in scores if _MARK in k]
    if not marked:
        return dict(scores), None, None
    if len(marked) != len(scores):
        raise ValueError(f"{len(scores) - len(marked)} of {len(scores)} documents carry no cluster id: "
                         "scores of a clustered task mixed with others")
    out, clusters, units = {}, {}, set()
    for key, score in scores.items():
        doc, tagged = key.split(_MARK, 1)
        unit, cluster = tagged.split(":", 1)
        out[doc], clusters[doc] = score, cluster
        units.add(unit)
    if len(units) != 1:
        raise ValueError(f"documents clustered in several units: {sorted(units)}")
    return out, clusters, units.pop()


@functools.lru_cache(maxsize=1)
def _task_utils():
    """harness_tasks/utils.py (the task YAMLs' functions), loaded by path as lm-eval loads it."""
    spec = importlib.util.spec_from_file_location("mari_eval_task_utils", REPO / "harness_tasks" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def document_scores(samples: dict[str, list[dict]], names: list[str], task: str) -> DocumentScores:
    """Per metric, the score of every document of ``task`` (a group: of all its subtasks
    ``names``; their documents are keyed "subtask/doc_id", a task's own by doc_id; a clustered
    task's keys end in "@unit:cluster", ``cluster_id`` of the logged dataset record)."""
    out: DocumentScores = {}
    for name in names:
        unit = cluster_unit(name)
        for sample in samples.get(name, []):
            doc = str(sample["doc_id"]) if name == task else f"{name}/{sample['doc_id']}"
            if unit is not None:
                doc = f"{doc}{_MARK}{unit}:{cluster_id(sample['doc'])}"
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
        if not _mean_agrees(mean, reported):
            if _aggregated_otherwise(metric):
                del documents[metric]
                continue
            raise ValueError(f"{task} {metric}: the mean of its {len(values)} per-document scores is {mean!r}, "
                             f"lm-eval reported {reported!r}; the per-document scores would not describe the "
                             "figure: this is a bug in repro/engine/documents.py or the task's metrics, report it")


def _mean_agrees(mean: float, reported: float) -> bool:
    """Whether the mean of a metric's per-document scores is the figure lm-eval reported (to
    ``TOLERANCE``, relative above 1); a non-finite mean or a NaN figure never agrees."""
    return math.isfinite(mean) and not math.isnan(reported) and abs(mean - reported) <= TOLERANCE * max(1.0, abs(reported))


def documents_disagree(documents: Any, metrics: dict[str, Any], n: int) -> str | None:
    """What in a stored evaluation's per-document scores contradicts its header, or None.

    Each metric's scores must be a {document: number or None} of ``n`` documents (one per
    document evaluated: a group's subtasks together) whose mean is the metric's figure, as
    ``check_against`` tied them when the evaluation was run; a file cut short, merged or edited
    by hand breaks one of these."""
    for metric, scores in documents.items():
        if not isinstance(scores, dict) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in scores.values()):
            return f"documents {metric!r} is not a map of document to score"
        if len(scores) != n:
            return f"documents {metric!r} holds {len(scores)} documents, its header says n = {n}"
        values = [v for v in scores.values() if v is not None]
        reported = metrics.get(metric)
        if not values or not isinstance(reported, (int, float)) or isinstance(reported, bool):
            return f"documents {metric!r} has no scores or no figure in metrics"
        mean = sum(values) / len(values)
        if not _mean_agrees(mean, reported):
            return f"the mean of documents {metric!r} is {mean!r}, its figure in metrics is {reported!r}"
    return None


def _aggregated_otherwise(metric: str) -> bool:
    """Metrics whose aggregate is not the mean of per-document numbers (BBQ's accuracies by
    context and bias scores, computed from per-document tuples or subsets)."""
    name = metric.split(",")[0]
    return "bias_score" in name or name.startswith("accuracy_")
