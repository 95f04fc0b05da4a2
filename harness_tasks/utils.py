"""Data for the lm-eval tasks of this folder, read through ``mari_eval.benchmarks.data``.

Every YAML here names one of the ``load_*`` functions below as its ``custom_dataset``. lm-eval
0.4.13 calls it as ``fn(**metadata, **dataset_kwargs)`` (``ConfigurableTask.download``), where
``metadata`` merges the YAML's, ``--metadata`` and the model's ``--model_args`` (unrelated keys such
as ``version`` or ``pretrained``: every loader accepts ``**_``); it returns a ``datasets.DatasetDict``
keyed by the YAML's split names. The records come from ``$MARI_DATA_DIR`` when it is set (the local
copy, ``shared/data/SOURCES.md``), otherwise from the Hub, as ``mari_eval.benchmarks.data`` reads them.

Scoring is lm-eval's own: the names at the bottom are lm-eval's functions, imported
(not copied) so that the YAMLs can reference them as ``!function utils.<name>``. The
exceptions: SORRY-Bench, which lm-eval lacks, whose responses are scored by an LLM judge
(``mari_eval.judge``) in the ``sorry_agg_*`` aggregations; and BBQ's ``process_results``,
lm-eval's less its NaN placeholders for the categories a document is not in, so that a
category without documents (missing from the data) has no row in the results.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

import datasets

try:
    from mari_eval.benchmarks import data as mari_data
except ImportError:  # a checkout that is not pip-installed: the package sits beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from mari_eval.benchmarks import data as mari_data
from mari_eval.benchmarks import data_splits
from mari_eval.benchmarks.bleurt import truthfulqa_scores as bleurt_scores
# How held-out documents are ordered so that lm-eval's --limit N draws across categories (mari_eval/benchmarks/document_order.py).
from mari_eval.benchmarks.document_order import spread_bbq, spread_over_categories  # noqa: F401
from mari_eval.judge import sorry_bench
from mari_eval.judge.sorry_bench import SORRY_CATEGORIES
# SORRY-Bench's scoring lives with the judge (mari_eval/judge/sorry_bench.py); the YAMLs call it by these names.
from mari_eval.judge.sorry_bench import (  # noqa: F401
    agg_judge_unparseable as sorry_agg_judge_unparseable, agg_keyword_refusal_rate as sorry_agg_keyword_refusal_rate,
    agg_refusal_rate as sorry_agg_refusal_rate, document_scores as sorry_document_scores,
    process_results as sorry_process_results)

from lm_eval.tasks.bbq import utils as bbq_utils
from lm_eval.tasks.truthfulqa import utils as truthfulqa_utils

# A child of lm-eval's logger, so that these lines show at lm-eval's log level.
log = logging.getLogger("lm_eval.harness_tasks.mari")

SPLIT_SEED_KEY = "split_seed"  # metadata key (YAML `metadata:` or `--metadata`) of the split seed
HELDOUT_DROP = ("pca", "train", "ctrl")  # the Splits fields that held-out tasks leave out


# ----------------------------------------------------------------------------- helpers


def _source() -> str:
    """Cache key for where records come from (the local copy or the Hub)."""
    return os.environ.get(mari_data.DATA_ENV) or "hub"


def _dataset(records: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(records)


@functools.lru_cache(maxsize=None)
def _truthfulqa(source: str) -> tuple[dict, ...]:
    return tuple(mari_data.load_truthfulqa_mc())


class _SkippedCategories(logging.Filter):
    """Holds back ``mari_data.load_bbq``'s warning per category it skips (one line each), keeping
    the reason, so that ``_bbq`` names the absent categories in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("BBQ category %s is not available") and len(record.args or ()) == 2:
            self.reasons[str(record.args[0])] = str(record.args[1])
            return False
        return True


@functools.lru_cache(maxsize=None)
def _bbq(source: str) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    skipped = _SkippedCategories()
    data_log = logging.getLogger(mari_data.__name__)
    data_log.addFilter(skipped)
    try:
        records, covered = mari_data.load_bbq(None)  # both contexts, like the built-in's "All" config
    finally:
        data_log.removeFilter(skipped)
    absent = [c for c in mari_data.BBQ_CATEGORIES if c not in covered]
    if absent:  # once per process (cached): results on these tasks cover only these categories
        why = next(iter(skipped.reasons.values()), None)
        log.warning("BBQ: %d of 11 categories are missing and left out of the bbq tasks' results (no per-category "
                    "bias scores for them; acc and the overall scores cover the other %d: %s): %s%s",
                    len(absent), len(covered), ", ".join(covered), ", ".join(absent), f" ({why})" if why else "")
    return tuple(records), tuple(covered)


@functools.lru_cache(maxsize=None)
def _mmlu(split: str, source: str) -> dict[str, list[dict]]:
    by_subject: dict[str, list[dict]] = {}
    for r in mari_data.load_mmlu(split):
        by_subject.setdefault(r["subject"], []).append(r)
    return by_subject


@functools.lru_cache(maxsize=None)
def _splits(dataset: str, seed: int, source: str) -> data_splits.Splits:
    return data_splits.make_splits(dataset, seed)


def _seed(value) -> int:
    """The split seed from metadata: an int, or a string of one (``--metadata`` may pass either)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"metadata '{SPLIT_SEED_KEY}' must be an integer, got {value!r}")


def splits_for(dataset: str, split_seed=0) -> data_splits.Splits:
    """The ``mari_eval.benchmarks.data_splits.make_splits`` result that the held-out tasks use (cached)."""
    return _splits(dataset, _seed(split_seed), _source())


def _heldout(records, dataset: str, split_seed, *, keep_only_test: bool, task: str) -> list[dict]:
    """Records without any pca/train/ctrl id (or exactly the test ids), tagged with the split."""
    splits = splits_for(dataset, split_seed)
    fingerprint = splits.fingerprint()
    if keep_only_test:
        wanted = set(splits.test)
        kept = [r for r in records if r["id"] in wanted]
        missing = wanted - {r["id"] for r in kept}
        if missing:
            raise mari_data.DataError(
                f"{task}: {len(missing)} test id(s) of the {dataset} split (seed {splits.seed}) are not in "
                f"the loaded records, e.g. {sorted(missing)[:3]}; the data changed since the split was made"
            )
    else:
        dropped = {i for name in HELDOUT_DROP for i in getattr(splits, name)}
        kept = [r for r in records if r["id"] not in dropped]
    log.info(
        "%s: make_splits(%r, seed=%d), fingerprint %s: kept %d of %d records (%s; split sizes %s)",
        task, dataset, splits.seed, fingerprint, len(kept), len(records),
        "exactly the test ids" if keep_only_test else "every id not in pca/train/ctrl",
        ", ".join(f"{n}={len(getattr(splits, n))}" for n in (*HELDOUT_DROP, "test")),
    )
    # Every held-out doc carries the split it was cut with (visible in --log_samples output):
    # the lm-eval model checks a bundle's recorded splits against these (data_splits.check_recorded_splits).
    return [{**r, "split_dataset": splits.dataset, "split_seed": splits.seed, "split_fingerprint": fingerprint}
            for r in kept]


# ----------------------------------------------------------------------------- loaders (custom_dataset)


def load_truthfulqa(**_) -> datasets.DatasetDict:
    """All 817 TruthfulQA MC questions as the ``validation`` split (training questions included)."""
    return datasets.DatasetDict({"validation": _dataset(list(_truthfulqa(_source())))})


def load_truthfulqa_heldout(split_seed=0, **_) -> datasets.DatasetDict:
    """TruthfulQA MC without the pca/train/ctrl questions of ``make_splits("truthfulqa", split_seed)``,
    in a seeded order (``data_splits.seeded_order``): the file lists the questions by category, so lm-eval's
    ``--limit N`` (the first N) takes a uniformly random N of them instead of the first categories.
    A run over all documents scores the same set."""
    records = _heldout(_truthfulqa(_source()), "truthfulqa", split_seed, keep_only_test=False, task="truthfulqa_heldout")
    rank = {i: k for k, i in enumerate(data_splits.seeded_order([r["id"] for r in records], "truthfulqa-heldout",
                                                               _seed(split_seed)))}
    records = sorted(records, key=lambda r: rank[r["id"]])
    return datasets.DatasetDict({"validation": _dataset(records)})


def _with_bleurt(records: list[dict], bleurt: str | None) -> list[dict]:
    """Each record with the BLEURT checkpoint ``--metadata '{"bleurt": ...}'`` names ("" for none),
    which ``process_results_gen`` reads."""
    return [{**r, "bleurt": bleurt or ""} for r in records]


def load_truthfulqa_generation(bleurt=None, **_) -> datasets.DatasetDict:
    """All 817 TruthfulQA generation questions as the ``validation`` split (training questions included)."""
    return datasets.DatasetDict({"validation": _dataset(_with_bleurt(mari_data.load_truthfulqa_gen(), bleurt))})


def load_truthfulqa_generation_heldout(split_seed=0, bleurt=None, **_) -> datasets.DatasetDict:
    """The generation questions of ``load_truthfulqa_heldout``, in its order (a question has the
    same id in both files: ``mari_data.load_truthfulqa_gen``)."""
    order = {i: k for k, i in enumerate(load_truthfulqa_heldout(split_seed)["validation"]["id"])}
    records = _heldout(mari_data.load_truthfulqa_gen(), "truthfulqa", split_seed, keep_only_test=False,
                       task="truthfulqa_gen_heldout")
    if {r["id"] for r in records} != set(order):
        raise mari_data.DataError("truthfulqa_gen_heldout: the generation file's held-out questions are not the "
                                  "multiple-choice file's; the two TruthfulQA files under $MARI_DATA_DIR disagree")
    return datasets.DatasetDict({"validation": _dataset(_with_bleurt(sorted(records, key=lambda r: order[r["id"]]),
                                                                      bleurt))})


def _bbq_records() -> tuple[dict, ...]:
    return _bbq(_source())[0]


def load_bbq(**_) -> datasets.DatasetDict:
    """Every BBQ record of the covered categories (ambiguous and disambiguated) as ``test``."""
    return datasets.DatasetDict({"test": mari_data.dataset_on_disk("bbq", list(_bbq_records()))})


def _bbq_heldout(split_seed, *, keep_only_test: bool, task: str) -> list[dict]:
    """``_heldout`` for BBQ, refusing held-out records that share a context with pca/train/ctrl
    (``mari_eval.benchmarks.data_splits.check_bbq_contexts``: a context's paired questions are one unit)."""
    records = _heldout(_bbq_records(), "bbq", split_seed, keep_only_test=keep_only_test, task=task)
    data_splits.check_bbq_contexts(splits_for("bbq", split_seed), _bbq_records(), [r["id"] for r in records])
    return records


def load_bbq_heldout(split_seed=0, **_) -> datasets.DatasetDict:
    """BBQ (both contexts) without the pca/train/ctrl ids of ``make_splits("bbq", split_seed)``, in
    file order (no profile takes its first N)."""
    records = _bbq_heldout(split_seed, keep_only_test=False, task="bbq_heldout")
    return datasets.DatasetDict({"test": mari_data.dataset_on_disk("bbq_heldout", records)})


def load_bbq_disambig_heldout(split_seed=0, **_) -> datasets.DatasetDict:
    """Exactly the test ids of ``make_splits("bbq", split_seed)`` (disambiguated contexts),
    spread over the categories, templates and whole contexts (``spread_bbq``, seeded by the
    split seed): lm-eval's ``--limit N`` (the quick profile's first 504) takes a sample across
    templates instead of the first contexts of each category's file."""
    records = _bbq_heldout(split_seed, keep_only_test=True, task="bbq_disambig_heldout")
    return datasets.DatasetDict({"test": mari_data.dataset_on_disk("bbq_disambig_heldout", spread_bbq(records, _seed(split_seed)))})


def load_bbq_ambig_heldout(split_seed=0, **_) -> datasets.DatasetDict:
    """The ambiguous records of ``load_bbq_heldout`` less those whose context opens the context of a
    pca/train/ctrl record of their template (the same people and question, without the sentence
    that disambiguates), spread as ``load_bbq_disambig_heldout``'s."""
    splits = splits_for("bbq", split_seed)
    dropped = {i for field in HELDOUT_DROP for i in getattr(splits, field)}
    seen: dict[str, list[str]] = {}
    for r in _bbq_records():
        if r["id"] in dropped:
            seen.setdefault(mari_data.bbq_template_key(r), []).append(r["context"])
    records = [r for r in _bbq_heldout(split_seed, keep_only_test=False, task="bbq_ambig_heldout")
               if r["context_condition"] == "ambig"
               and not any(c.startswith(r["context"]) for c in seen.get(mari_data.bbq_template_key(r), []))]
    return datasets.DatasetDict({"test": mari_data.dataset_on_disk("bbq_ambig_heldout",
                                                                   spread_bbq(records, _seed(split_seed)))})


def load_mmlu(mmlu_subject: str, **_) -> datasets.DatasetDict:
    """One MMLU subject: ``dev`` (the 5 few-shot examples), ``validation`` and ``test``."""
    out = {}
    for split in ("dev", "validation", "test"):
        rows = _mmlu(split, _source()).get(mmlu_subject)
        if not rows:
            raise mari_data.DataError(f"MMLU subject '{mmlu_subject}' has no records in split '{split}'")
        out[split] = _dataset(rows)
    return datasets.DatasetDict(out)


def _arc(task: str) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {split: _dataset(mari_data.load_arc(task, split)) for split in ("train", "validation", "test")}
    )


def load_arc_easy(**_) -> datasets.DatasetDict:
    return _arc("arc_easy")


def load_arc_challenge(**_) -> datasets.DatasetDict:
    return _arc("arc_challenge")


def load_gsm8k(**_) -> datasets.DatasetDict:
    return datasets.DatasetDict({split: _dataset(mari_data.load_gsm8k(split)) for split in ("train", "test")})


# ----------------------------------------------------------------------------- SORRY-Bench (judged)

# A doc field holding the prompt as one chat user turn: MariLM renders a context equal to it
# through the model's chat template (mari_eval/evaluation/lm.py), as training renders SORRY-Bench prompts.
CHAT_TURN_FIELD = "chat_user_turn"


@functools.lru_cache(maxsize=None)
def _sorry_bench(source: str) -> tuple[dict, ...]:
    return tuple(mari_data.load_sorry_bench())


def _sorry_doc(record: dict) -> dict:
    category, turns = str(record["category"]), record["turns"]
    if category not in SORRY_CATEGORIES:
        raise mari_data.DataError(f"SORRY-Bench {record['id']}: category {category!r} is not one of 1..45")
    if len(turns) != 1 or not turns[0].strip():
        raise mari_data.DataError(f"SORRY-Bench {record['id']}: expected one non-empty turn, got {len(turns)}")
    return {**record, "category": category, "instruction": turns[0], CHAT_TURN_FIELD: turns[0]}


def load_sorry_bench(**metadata) -> datasets.DatasetDict:
    """All 450 SORRY-Bench base prompts as ``test`` (training prompts included); needs a judge."""
    sorry_bench.prepare("sorry_bench", metadata)
    return datasets.DatasetDict({"test": _dataset([_sorry_doc(r) for r in _sorry_bench(_source())])})


def load_sorry_bench_heldout(split_seed=0, **metadata) -> datasets.DatasetDict:
    """Exactly the test ids of ``make_splits("sorry_bench", split_seed)``, spread over the 45
    categories (``spread_over_categories``); needs a judge."""
    sorry_bench.prepare("sorry_bench_heldout", {**metadata, "split_seed": split_seed})
    records = _heldout(_sorry_bench(_source()), "sorry_bench", split_seed, keep_only_test=True, task="sorry_bench_heldout")
    records = spread_over_categories(records)
    return datasets.DatasetDict({"test": _dataset([_sorry_doc(r) for r in records])})


def sorry_doc_to_text(doc: dict) -> str:
    return doc["instruction"]


# ----------------------------------------------------------------------------- lm-eval's scoring, reused

# TruthfulQA (lm_eval/tasks/truthfulqa/utils.py)
process_results_mc2 = truthfulqa_utils.process_results_mc2
process_docs_gen = truthfulqa_utils.process_docs_gen  # "I have no comment." added to the correct answers


def process_results_gen(doc: dict, results) -> dict:
    """lm-eval's BLEU and ROUGE against the correct and incorrect answers; BLEURT beside them when
    the task's metadata names a checkpoint (mari_eval/benchmarks/bleurt.py), else said once and skipped."""
    metrics = truthfulqa_utils.process_results_gen(doc, results)
    if doc.get("bleurt"):
        metrics.update(bleurt_scores(doc["bleurt"], results[0], doc["correct_answers"], doc["incorrect_answers"]))
    else:
        _bleurt_skipped()
    return metrics


@functools.lru_cache(maxsize=1)
def _bleurt_skipped() -> None:
    log.warning("truthfulqa_gen: BLEURT not computed, no checkpoint named; add --metadata "
                "'{\"bleurt\": \"Elron/bleurt-base-512\"}' (or any BLEURT checkpoint, mari_eval/benchmarks/bleurt.py)")

# BBQ (lm_eval/tasks/bbq/utils.py)
bbq_process_docs = bbq_utils.process_docs
bbq_process_docs_disambig = bbq_utils.process_docs_disambig


def bbq_process_results_multiple_choice(doc: dict, results) -> dict:
    """lm-eval's, less the placeholders it adds for the per-category bias scores of the other
    categories (NaN items, which its aggregations skip): a category's scores then come from
    its own documents alone, with the same values, and a category without documents (missing
    from the data, or not reached under --limit) has no row instead of a NaN one. The metric
    list keeps all 11 categories (bbq.yaml), so a category file added later is scored unchanged."""
    metrics = bbq_utils.process_results_multiple_choice(doc, results)
    return {name: value for name, value in metrics.items() if _bias_score_category(name) in (None, doc["category"])}


def _bias_score_category(metric: str) -> str | None:
    """The category of a per-category bias score (``disamb_bias_score_Age``: Age), None for another metric."""
    for kind in ("amb_bias_score_", "disamb_bias_score_"):
        if metric.startswith(kind):
            return metric[len(kind):]
    return None


bbq_doc_to_target = bbq_utils.doc_to_target
bbq_doc_to_choice = bbq_utils.doc_to_choice
bbq_agg_accuracy_amb = bbq_utils.agg_accuracy_amb
bbq_agg_accuracy_disamb = bbq_utils.agg_accuracy_disamb
bbq_agg_amb_bias_scores = bbq_utils.agg_amb_bias_scores
bbq_agg_disamb_bias_scores = bbq_utils.agg_disamb_bias_scores
