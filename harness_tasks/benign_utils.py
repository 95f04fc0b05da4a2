"""The benign over-refusal task (benign_instructions.yaml, issue 81.1): Self-Instruct's requests, out of source.

The 252 user-oriented instructions of Self-Instruct (Wang et al., ACL 2023; shared/data/SOURCES.md) are
requests people wrote for everyday apps (rewrite an email, plan a trip, explain a formula, write code). They
share no source with anything the suite trains, calibrates or tests on, and are read for evaluation only
(``data.load_benign_instructions(..., use="evaluation")``; the seed tasks are the calibration pool). A doc's
prompt is the instruction, or the instruction, a blank line and its first instance's input; the model
answers it alone, greedily, rendered as one user turn of its chat template (the doc's ``chat_user_turn``,
as XSTest's and SORRY-Bench's prompts), and the keyword judge (``mari_eval.judge.keyword_refusal``, the one
XSTest's columns use; its agreement with people: results/judge_agreement.md) reads each response:
``refusal_rate`` 1 when it holds a refusal phrase. Its mean is the rate of refused benign requests
(lower is better).
"""

from __future__ import annotations

import functools
import os

import datasets

from mari_eval.benchmarks import data as mari_data
from mari_eval.evaluation.lm_generation import CHAT_TURN_FIELD
from mari_eval.judge.prompt import keyword_refusal

FIELDS = ("id", "motivation_app", "instruction", "prompt")


@functools.lru_cache(maxsize=None)
def _records(source: str) -> tuple[dict, ...]:
    return tuple(mari_data.load_benign_instructions("user_oriented_instructions", use="evaluation"))


def load_benign_instructions(**_) -> datasets.DatasetDict:
    """The 252 requests, in the file's order, each with its prompt as one chat user turn."""
    records = _records(os.environ.get(mari_data.DATA_ENV) or "")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [{**{k: r[k] for k in FIELDS}, CHAT_TURN_FIELD: r["prompt"]} for r in records])})


def doc_to_text(doc: dict) -> str:
    return doc["prompt"]


def process_results(doc: dict, results: list[str]) -> dict:
    return {"refusal_rate": float(keyword_refusal(results[0]))}
