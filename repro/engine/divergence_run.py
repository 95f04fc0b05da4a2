"""The KL and cross-entropy columns' measurement (mari_eval/evaluation/divergence.py) of one ``MariLM``'s method,
returned as ``lm_eval_run.evaluate`` returns a task's: metrics "kl,none" and "ce,none" (nats per token, means
over documents), every document's scores, and diagnostics (which variant answered; a gated method's
``summarize``, MARI's gate rate among it). Two sets of documents (``divergence.TASKS``):

* ``general_text`` (in source; the tables' ``kl``, ``ce`` columns): MMLU and ARC-Challenge question texts
  cut at their middle word, read as lm-eval reads a log-likelihood request (``HFLM._encode_pair``);
* ``benign_text`` (out of source, issue 81.1; ``kl_benign``, ``ce_benign``): Self-Instruct's 252 user-oriented
  requests. The untouched model reads each request as one user turn of the chat template, ready for the
  answer (``untouched_turn``: what ``--model mari`` generates from without a bundle), tokenised as
  generation tokenises it (``MariLM.generation_ids``, so p* is the token generation edits); the method
  reads its own rendering (``MariLM.chat_turn_prompt``: Prompting's instruction in the system turn, the
  same text for every other method). The continuation is the first ``divergence.BENIGN_ANSWER_TOKENS``
  tokens of the authors' answer (the request's first instance's output, tokenised alone). So the KL is
  that of the distributions the model answers a benign request from, under the edit the method makes on
  that request (MARI: its gate and routing on the whole request, as when it generates), and the
  cross-entropy that of a human answer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from tqdm import tqdm

from mari_eval.benchmarks.data import load_benign_instructions, load_general_text
from mari_eval.evaluation import divergence

BENIGN_SET = "user_oriented_instructions"  # data.BENIGN_SETS: the evaluation-only set


def measure(lm, task: str, limit: int | None) -> dict:
    """The measurement ``task`` (one of ``divergence.TASKS``) of ``lm``'s method on its first ``limit`` documents."""
    if task == divergence.TASK:
        return general_text(lm, limit)
    if task == divergence.BENIGN_TASK:
        return benign_text(lm, limit)
    raise ValueError(f"{task!r} is not a KL and cross-entropy measurement; choose one of {', '.join(divergence.TASKS)}")


def general_text(lm, limit: int | None) -> dict:
    """In source: the general-text documents (``data.load_general_text``) as log-likelihood requests."""
    from lm_eval.models.huggingface import HFLM  # deferred: lm-eval is heavy; only this path needs it

    documents = load_general_text()[:limit]
    return _scored(lm, divergence.TASK, [d["id"] for d in documents], [(d["context"], d["continuation"]) for d in documents],
                   lambda context, continuation: HFLM._encode_pair(lm, context, continuation),  # the untouched model's tokens
                   lm.instructed)


def untouched_turn(tokenizer, user: str) -> str:
    """``user`` as one user turn of ``tokenizer``'s chat template, ready for the answer, as ``MariLM.chat_turn_prompt``
    renders it without a method's instruction (``user + "\\n"`` for a tokenizer without a template)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    return user + "\n"


def benign_text(lm, limit: int | None) -> dict:
    """Out of source: Self-Instruct's user-oriented requests and their authors' answers (module docstring)."""
    records = load_benign_instructions(BENIGN_SET, use="evaluation")[:limit]
    pairs = [(untouched_turn(lm.tokenizer, r["prompt"]), r["instances"][0]["output"]) for r in records]
    own = {context: lm.chat_turn_prompt(r["prompt"]) for (context, _), r in zip(pairs, records)}

    def encode_pair(context: str, answer: str) -> tuple[list[int], list[int]]:
        return lm.generation_ids(context), lm.tok_encode(answer, add_special_tokens=False)[:divergence.BENIGN_ANSWER_TOKENS]

    return _scored(lm, divergence.BENIGN_TASK, [r["id"] for r in records], pairs, encode_pair, own.__getitem__)


def _scored(lm, task: str, ids: list[str], pairs: Sequence[tuple[str, str]],
            encode_pair: divergence.EncodePair, instructed: Callable[[str], str]) -> dict:
    started = time.time()
    scores = divergence.score_texts(
        lm.model, lm.plan, pairs, encode_pair, instructed, lm.tokenizer.pad_token_id,
        progress=lambda items: tqdm(items, desc=f"{task}: KL and cross-entropy", leave=False),
        untouched=lm.shared.shared.untouched_text if lm.shared is not None else None)  # one reading for a group's rows
    by_metric = {f"{name},none": {i: getattr(s, name) for i, s in zip(ids, scores)} for name in divergence.METRICS}
    answered = Counter(lm.intervention.variant_name(s.variant) if lm.intervention else "the untouched model" for s in scores)
    records = [s.record for s in scores if s.record is not None]
    chosen = lm.intervention.summarize(records) if lm.intervention is not None and records else {}  # MARI: gate_rate
    return {"metrics": {metric: sum(values.values()) / len(values) for metric, values in by_metric.items()},
            "n": len(ids), "seconds": round(time.time() - started, 1), "tasks_run_together": [task],
            "documents": by_metric, "model_dtype": str(lm.model.dtype).removeprefix("torch."),
            "diagnostics": {**chosen, "prompts": len(scores), "answered_by": dict(answered),
                            "continuation_tokens": sum(s.tokens for s in scores)}}
