"""How many questions ``--model mari`` scores per forward pass: lm-eval's ``batch_size``.

lm-eval's ``hf`` model fills a GPU by running many (context, continuation) requests per
pass. ``MariLM`` computes each question's prompt once and its options as short rows after
it (``mari_eval.evaluation.runner``), so a question is a few small passes; on a GPU, many questions'
prompts and rows go into the same passes instead (``runner.score_questions``). The
``batch_size`` model arg, as lm-eval reads it, says how many:

* ``1`` (lm-eval's default): one question at a time, as before batching existed;
* ``N``: consecutive questions (in token order, so that they share their preamble) while
  their requests (options) add up to at most N; one question alone may have more;
* ``auto``: as many as fit the token budget. Batches are sized by tokens, not requests (issue
  59): lm-eval's ``max_batch_size`` caps the requests only when the user gives it (its default
  of 64, a cap on HFLM's own ``auto``, held BBQ's batches to about 5 questions). ``auto:N``'s
  re-detection schedule has nothing to re-detect here: the budget is read once per call.

Every batch also keeps its prompts' own tokens (after the preamble they share) and its
option rows within the token budget, so one pass's attention mask and logits stay bounded:
``batch_tokens=N`` in ``--model_args``, else ``token_budget`` (the device's free memory).
Scores equal one question at a time to float rounding (tests/test_batching.py).

Generation (``generate_until``) keeps HFLM's left-padded batches of prompts; with ``auto`` their
size is read from the same kind of budget, in prompt and generated tokens: ``batch_tokens``, else
``generation_token_budget`` (the keys and values the device's free memory holds), divided by the
longest prompt plus its ``max_gen_toks`` and by the rows each prompt runs (``generation_batch``),
instead of HFLM's search for the largest batch that does not run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mari_eval.injection import devices, site
from mari_eval.evaluation.prefix_cache import common_prefix
from mari_eval.storage.numbers import NumberError, read_number

ONE_AT_A_TIME_TOKENS = 1024  # row tokens per pass when questions go one at a time (the runner's default)
MAX_TOKENS = 8192  # row tokens per pass at most: the packed mask grows with their square
CPU_TOKENS = 4096  # a CPU's passes gain little from more


@dataclass(frozen=True)
class Batching:
    """What ``batch_size`` asks for: at most ``max_requests`` requests per batch (None: no cap
    but the tokens), and ``max_tokens`` row and prompt tokens per pass."""

    max_requests: int | None
    max_tokens: int

    @property
    def one_at_a_time(self) -> bool:
        return self.max_requests == 1

    @classmethod
    def of(cls, batch_size: int | str, max_batch_size: int | None, model: torch.nn.Module,
           batch_tokens: int | None = None) -> "Batching":
        """The batching of lm-eval's ``batch_size`` (an int, "auto" or "auto:N") for ``model``:
        ``max_batch_size`` the request cap the user gave (None: none), ``batch_tokens`` the token
        budget per pass the user gave (None: ``token_budget``, or ``ONE_AT_A_TIME_TOKENS`` for one question)."""
        check_batch_tokens(batch_tokens)
        if str(batch_size).startswith("auto"):
            return cls(max_batch_size, batch_tokens or token_budget(model))
        size = int(batch_size)
        if size < 1:
            raise ValueError(f"batch_size={batch_size}: give a positive number of requests per batch, or auto")
        return cls(1, batch_tokens or ONE_AT_A_TIME_TOKENS) if size == 1 else cls(size, batch_tokens or token_budget(model))


def check_batch_tokens(batch_tokens: object) -> int | None:
    """``batch_tokens=`` (as typed, or an int) as a positive whole number of tokens, or a ValueError
    (``numbers.read_number``); None stays None."""
    if batch_tokens is None:
        return None
    try:
        return read_number(batch_tokens, integer=True, lo=1)
    except NumberError as e:
        raise ValueError(f"batch_tokens={batch_tokens!r}: give a positive whole number of tokens per pass (or leave it "
                         f"out: a budget from the device's free memory); {e.why}") from None


def token_budget(model: torch.nn.Module) -> int:
    """Row tokens per pass that a quarter of the input device's free memory holds: per token,
    the logits in the model's dtype and twice in float32 (the log-softmax), the MLP's
    activations and a few hidden states; between ``ONE_AT_A_TIME_TOKENS`` and ``MAX_TOKENS``."""
    device = devices.input_device(model)
    if device.type != "cuda":
        return CPU_TOKENS
    per_token = int(model.config.get_text_config().vocab_size) * (site.element_bytes(model) + 8) + _pass_bytes_per_token(model)
    free, _ = torch.cuda.mem_get_info(device)
    return max(ONE_AT_A_TIME_TOKENS, min(MAX_TOKENS, free // 4 // per_token))


def _pass_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a token holds inside one forward pass: the MLP's activations and a few hidden states."""
    config = model.config.get_text_config()
    hidden = int(config.hidden_size)
    return (int(getattr(config, "intermediate_size", 4 * hidden)) * 4 + hidden * 8) * site.element_bytes(model)


def generation_token_budget(model: torch.nn.Module) -> int:
    """Prompt and generated tokens per generation batch that a quarter of the input device's free
    memory holds: per token, its keys and values in every layer (2 L H_kv d_h b) and the prefill's
    MLP and hidden states (only the last position's logits are computed); ``CPU_TOKENS`` on a CPU."""
    device = devices.input_device(model)
    if device.type != "cuda":
        return CPU_TOKENS
    per_token = site.kv_bytes_per_token(model) + _pass_bytes_per_token(model)
    free, _ = torch.cuda.mem_get_info(device)
    return max(ONE_AT_A_TIME_TOKENS, free // 4 // per_token)


def generation_batch(row_tokens: int, rows_per_prompt: int, budget: int, max_requests: int | None) -> int:
    """Prompts per generation batch for ``batch_size=auto``: as many rows of ``row_tokens`` (the
    longest prompt and the most tokens it may generate) as ``budget`` holds, ``rows_per_prompt``
    rows each (a routed method runs every variant over its window), capped at ``max_requests``
    when the user gave one; at least 1."""
    prompts = max(1, budget // max(1, row_tokens * rows_per_prompt))
    return prompts if max_requests is None else max(1, min(prompts, max_requests))


def question_batches(prompts: Sequence[Sequence[int]], rows: Sequence[int], requests: Sequence[int],
                     batching: Batching) -> list[list[int]]:
    """The questions' indices, in order, cut into batches: question i has prompt ``prompts[i]``
    (before p*), ``rows[i]`` option-row tokens and ``requests[i]`` requests. A batch keeps its
    requests within ``batching.max_requests`` and its rows, and its prompts' tokens beyond the
    prefix they all share, within ``batching.max_tokens``; one question alone may exceed them."""
    batches: list[list[int]] = []
    shared = n_requests = n_rows = 0
    for i, prompt in enumerate(prompts):
        if batches and not batching.one_at_a_time:
            batch = batches[-1]
            common = min(shared, len(common_prefix([prompts[batch[0]], prompt])))
            own = sum(len(prompts[j]) - common for j in batch) + len(prompt) - common
            fits = batching.max_requests is None or n_requests + requests[i] <= batching.max_requests
            if fits and n_rows + rows[i] <= batching.max_tokens and own <= batching.max_tokens:
                batch.append(i)
                shared, n_requests, n_rows = common, n_requests + requests[i], n_rows + rows[i]
                continue
        batches.append([i])
        shared, n_requests, n_rows = len(prompt), requests[i], rows[i]
    return batches

