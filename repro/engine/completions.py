"""Every generated answer of an evaluation, kept in its step beside the per-document scores (issue 81.4).

A generation task (``output_type: generate_until``: SORRY-Bench, XSTest, GSM8K, TruthfulQA generation)
scores what the model wrote, and the scores alone cannot show it: whether a bundle that refuses every
safe XSTest prompt says "I'm sorry" or something else. ``generated`` reads each document's completion
from lm-eval's logged samples with its prompt and the decoding settings it ran under, and
``repro.engine.lm_eval_run.evaluate`` stores them in the evaluation's step (``FIELD``), whose key then
carries ``cache_keys.GENERATION_DOCUMENTS_VERSION``. A table's cell keeps them (``cell_completions``:
with the bundle and the step they came from, or ``documents`` None for a step stored without them),
and the table writes them to NAME_completions.parquet (repro/analysis/completions_file.py), where
``python -m repro.rejudge`` reads them.

Per document: ``prompt`` (the request as one chat user turn when the task's documents carry one,
``chat_turn`` true, which the model saw through its chat template; else the context lm-eval gave
the model, few-shot examples included), ``completion`` (the model's output, before any filter of
the task; generation also stops at the tokenizer's end-of-text token besides ``until``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mari_eval.evaluation.lm_generation import CHAT_TURN_FIELD
from repro.engine.cache_keys import config_key

FIELD = "completions"  # in an evaluation's step: {"decoding": Decoding as a dict, "documents": {doc: Completion}}


@dataclass(frozen=True)
class Decoding:
    """The settings a task's answers were generated under, as HFLM reads them (lm-eval's
    ``normalize_gen_kwargs``: the task's ``generation_kwargs`` with the run's ``max_gen_toks``)."""

    max_gen_toks: int
    do_sample: bool
    temperature: float
    until: tuple[str, ...]

    @classmethod
    def of(cls, gen_kwargs: dict, default_max_gen_toks: int) -> "Decoding":
        from lm_eval.models.utils import normalize_gen_kwargs  # deferred: lm-eval is heavy; only evaluating needs it

        found = normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks)
        return cls(int(found["max_gen_toks"]), bool(found["do_sample"]), float(found["temperature"]),
                   tuple(found["until"]))

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "until": list(self.until)}


def generated(samples: dict[str, list[dict]], names: list[str], task: str, n: int,
              default_max_gen_toks: int) -> dict[str, Any] | None:
    """``FIELD``'s record of ``task``'s generated answers (a group's subtasks ``names`` keyed "subtask/doc_id",
    as ``repro.engine.documents.document_scores`` keys them), or None when its samples hold no generated
    text (a log-likelihood task). Every one of its ``n`` documents must have one, under one decoding."""
    documents: dict[str, dict[str, Any]] = {}
    decodings: set[Decoding] = set()
    for name in names:
        for sample in samples.get(name, []):
            doc = str(sample["doc_id"]) if name == task else f"{name}/{sample['doc_id']}"
            responses = sample.get("resps") or [[]]
            if doc in documents or not responses[0] or not isinstance(responses[0][0], str):
                continue  # a further filter's sample of the same answer (GSM8K), or not generated
            context, gen_kwargs = sample["arguments"][0]
            turn = sample["doc"].get(CHAT_TURN_FIELD) if isinstance(sample.get("doc"), dict) else None
            decodings.add(Decoding.of(gen_kwargs, default_max_gen_toks))
            documents[doc] = {"prompt": turn if isinstance(turn, str) else context,
                              "chat_turn": isinstance(turn, str), "completion": responses[0][0]}
    if not documents:
        return None
    if len(documents) != n or len(decodings) != 1:
        raise ValueError(f"{task}: {len(documents)} generated answers under {len(decodings)} decoding settings for "
                         f"its {n} documents; one answer per document under one setting is what is stored")
    return {"decoding": decodings.pop().as_json(), "documents": documents}


def cell_completions(result: dict, task: str, metric: str, bundle: Path | None, model_args: str) -> dict[str, Any]:
    """What a table's cell keeps of a stored evaluation's completions: the task and the metric the cell
    reads from them (a judge's verdict or its opposite: repro/rejudge.py), the bundle (its directory
    under the runs folder, None for the untouched model; its fingerprint), the row's model_args, the step's
    file under evaluations/, the decoding and the documents; ``documents`` None when the step holds none
    (stored before completions were kept: ``repro.analysis.completions_file`` says so, never an empty file)."""
    config = result["config"]
    stored = result.get(FIELD)
    if stored is not None and (not isinstance(stored, dict) or not isinstance(stored.get("documents"), dict)
                               or len(stored["documents"]) != result["n"]):
        raise ValueError(f"evaluations/{task}-{config_key(config)}.json: its {FIELD!r} is not one completion for each of "
                         f"its {result['n']} documents; delete the file and run the command again to generate it anew")
    return {"task": task, "metric": metric, "bundle": bundle.name if bundle else None, "bundle_fingerprint": config.get("bundle"),
            "model_args": model_args, "evaluation": f"{task}-{config_key(config)}.json",
            "decoding": stored["decoding"] if stored else None, "documents": stored["documents"] if stored else None}
