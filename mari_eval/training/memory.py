"""What training holds in memory per example, said before it starts, and kept within a budget.

Training runs every example's options many times (epochs, experts, the probe, the
calibration), so the frozen model's work that no edit changes is done once
(``session.Session.prepare``) and kept:

* the key/value cache of the prompt before p*, split in two: the preamble every example
  shares (TruthfulQA's 6-shot prompt, a chat template's header), held **once**, and each
  example's own remainder (its question), held per example;
* for methods that edit at l* (MARI, ReFT), the frozen states after l* of p* and of every
  option token (so edited rows run only the layers above l*).

With ``b`` bytes per element of the model's dtype, ``L`` layers, ``H_kv`` key/value heads
of dimension ``d_h`` and hidden size ``d``, one cached token costs

    c = 2 * L * H_kv * d_h * b            (keys and values of every layer)

and the training state of a set of examples is

    M = P * c + sum_i (q_i * c + r_i * d * b)

with P the shared preamble's tokens, q_i example i's own prompt tokens before p*, and
r_i its option rows' tokens (p* plus each option but its last token). The model's own
weights (N parameters * b) come on top. A layer with a sliding window holds at most its
window of tokens, so for such models M is an upper bound.

When M does not fit the budget (``mari-eval train --max-memory``, by default half of the
memory free on the site layer's device), the per-example caches are not kept: each is
recomputed from the shared preamble when the example runs (one forward pass of its
question, as evaluation does). If the states after l* do not fit either, they are
recomputed too (edited rows then run every layer). Results are the same either way
(tested); only time changes.

A training step adds the activations autograd keeps for its backward (``step_estimate``).
A step of MARI scores each example of its batch under K variants: its option rows (T
tokens, p* and each option but its last token, per variant) run the n = L - l* - 1 layers
above the edit in packed passes of at most ``max_tokens`` tokens, each attending to the
example's cached prompt (C tokens), so S = C + T keys. For a gated-MLP decoder (Llama,
Mistral, Qwen2, Gemma) with SDPA, intermediate size I, H query heads of dimension d_h and
vocabulary V, one pass keeps

    A = n * [T (3 I b + 2 H d_h b + 8 d + 4 H) + 2 S H d_h b]      (per layer above l*)
        + T (4 d + 4 V) + T S b + 2 T d_h b                         (final norm, log-softmax, mask, rope)

and a step keeps the sum over its passes, plus the largest pass's logits (T V b) while they
are live. The terms, per layer: the MLP's gate output, its activation and its up
projection (3 I); the rotated queries and SDPA's output (2 H d_h); the two RMSNorms'
float32 inputs (2 x 4 d); SDPA's float32 log-sum-exp (4 H); keys and values repeated to
H heads over all S positions (2 S H d_h). Frozen linear layers keep no input. The
counting follows Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models", sec. 4.1, for this inference-style graph (no dropout, frozen
weights, flash-style attention); each term was read off the tensors
``torch.autograd.graph.saved_tensors_hooks`` sees in transformers 5's Llama and Qwen2
layers (tests/test_memory_steps.py checks the sum, and the step's peak, on CPU).

Other passes (``Pass``) change two terms. A pass that reads the log-softmax of some of its
tokens only (ReFT's answers after a packed prompt) keeps 4 V for those; one that keeps none (a
prompt encoded under the edit) keeps only the final norm's input. A pass from scratch, without
a cache or packed rows, has no mask (SDPA's causal flag): no T S b, and its keys and values are
kept at their H_kv heads, unrepeated. Which passes a method's step runs, and which of them are
alive at once, is the method's: ``Session.step_estimate`` (MARI), ``edited_prompt_passes``
(LoRA, the adapted ReFT: every example's prompt and options until the batch's backward),
``baselines.reft_step.step_estimate`` (published ReFT: the shared preamble through the step,
one packed group at a time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from mari_eval.injection import site
from mari_eval.evaluation import runner
from mari_eval.evaluation.prefix_cache import common_prefix

DEFAULT_BUDGET_FRACTION = 0.5
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``40GiB``, ``500MB`` or ``1073741824``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"memory size {text!r}: write a number with a unit, e.g. 40GiB, 500MB or 2TB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class Estimate:
    """The training state of one set of examples (bytes), by the formula in the module docstring."""

    examples: int
    shared_tokens: int
    shared_bytes: int  # P * c, held once
    cache_bytes: int  # sum_i q_i * c
    lower_bytes: int  # sum_i r_i * d * b (0 when the method does not edit at l*)

    @property
    def total(self) -> int:
        return self.shared_bytes + self.cache_bytes + self.lower_bytes


def token_counts(examples) -> tuple[tuple[int, ...], list[int], list[int]]:
    """(P's tokens, q_i, r_i) of a set of ``train.Example``s: the preamble all share (when
    longer than one token), each one's own prompt tokens before p*, its option rows' tokens."""
    common = common_prefix([ex.context[:-1] for ex in examples]) if len(examples) > 1 else ()
    common = common if len(common) > 1 else ()
    return common, [len(ex.context) - 1 - len(common) for ex in examples], [sum(map(len, ex.options)) for ex in examples]


def estimate(model: torch.nn.Module, shared_tokens: int, own_tokens: Sequence[int], row_tokens: Sequence[int],
             lower: bool) -> Estimate:
    """M for examples with ``own_tokens[i]`` prompt tokens after the shared preamble and
    ``row_tokens[i]`` option-row tokens; ``lower``: whether the states after l* are kept."""
    c = site.kv_bytes_per_token(model)
    d = int(model.config.get_text_config().hidden_size)
    return Estimate(len(own_tokens), shared_tokens, shared_tokens * c, sum(own_tokens) * c,
                    sum(row_tokens) * d * site.element_bytes(model) if lower else 0)


@dataclass(frozen=True)
class Plan:
    """What ``Session.prepare`` keeps: per-example caches, states after l*, both or neither."""

    estimate: Estimate
    budget: int
    keep_caches: bool
    keep_lower: bool

    def describe(self, what: str) -> str:
        e = self.estimate
        parts = [f"{what}: {e.examples} examples hold {format_size(e.total)} "
                 f"(shared preamble {e.shared_tokens} tokens, {format_size(e.shared_bytes)}, once; "
                 f"own prompt caches {format_size(e.cache_bytes)}; states after l* {format_size(e.lower_bytes)}) "
                 f"against a budget of {format_size(self.budget)}"]
        if not self.keep_caches:
            parts.append("over budget: per-example caches are recomputed from the shared preamble at each use")
        if e.lower_bytes and not self.keep_lower:
            parts.append("the states after l* are recomputed too (edited rows run every layer)")
        return "; ".join(parts)


def plan(estimate_: Estimate, budget: int) -> Plan:
    keep_lower = estimate_.shared_bytes + estimate_.lower_bytes <= budget
    keep_caches = keep_lower and estimate_.total <= budget
    return Plan(estimate_, budget, keep_caches, keep_lower)


def default_budget(device: torch.device) -> int:
    """Half of the memory free on ``device`` now (GPU: its free memory; CPU: available RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil  # deferred: only the CPU budget reads it

        free = psutil.virtual_memory().available
    return int(DEFAULT_BUDGET_FRACTION * free)


@dataclass(frozen=True)
class Step:
    """A training step's activations (bytes): kept for the backward, and the largest pass's live logits."""

    passes: int
    saved_bytes: int
    transient_bytes: int

    @property
    def total(self) -> int:
        return self.saved_bytes + self.transient_bytes


class Pass(NamedTuple):
    """One forward pass a training step runs with gradients, as ``step_estimate`` counts it."""

    tokens: int  # T: the tokens it runs
    keys: int  # S: the keys each attends to (a cached prompt's and its own)
    scored: int | None = None  # tokens whose float32 log-softmax the loss reads (None: all T; 0: none)
    masked: bool = True  # an explicit mask (packed rows, a cache); False: SDPA's causal flag, keys and values unrepeated


def step_passes(shapes: Sequence[tuple[int, Sequence[int]]], variants: int, max_tokens: int) -> list[Pass]:
    """The packed passes of rows a training step runs over examples of ``shapes`` (each: its
    prompt's length with p*, its options' lengths) under ``variants`` edits at l*, as
    ``runner.score_variants`` packs them: T row tokens attending to S = T + the prompt's C cached keys."""
    passes = []
    for context, options in shapes:
        sizes = [len_ for _ in range(variants) for len_ in options]
        for chunk in runner.chunks(sizes, sizes, max_tokens):
            passes.append(Pass(sum(chunk), context - 1 + sum(chunk)))
    return passes


def example_shapes(examples) -> list[tuple[int, list[int]]]:
    """(prompt length with p*, option lengths) of each of ``examples``: what the step's passes depend on."""
    return [(len(ex.context), [len(option) for option in ex.options]) for ex in examples]


def edited_prompt_passes(shapes: Sequence[tuple[int, Sequence[int]]], max_tokens: int) -> list[Pass]:
    """The passes of a step that encodes each prompt under the edit (from scratch: SDPA's causal
    flag, no logits kept) and then scores its options after it (``step_passes``, one variant), every
    example's kept until the batch's backward: LoRA's and the adapted ReFT's steps."""
    return [p for context, options in shapes
            for p in (Pass(context - 1, context - 1, scored=0, masked=False), *step_passes([(context, options)], 1, max_tokens))]


def step_estimate(model: torch.nn.Module, layer: int, passes: Sequence[Pass]) -> Step:
    """A by the module docstring's formula for ``passes``, run with gradients through the layers
    above ``layer`` (-1: every layer; works on meta models): what autograd keeps while all of
    them are alive, and the largest pass's logits."""
    config = model.config.get_text_config()
    heads, head_dim = site.attention_heads(model)
    kv_heads = site.kv_heads(model)
    d, inner, vocab = int(config.hidden_size), int(config.intermediate_size), int(config.vocab_size)
    b, f, n = site.element_bytes(model), 4, site.num_layers(model) - layer - 1
    saved = 0
    for p in passes:
        t, s, scored = p.tokens, p.keys, p.tokens if p.scored is None else p.scored
        repeated = heads if p.masked else kv_heads  # SDPA takes GQA's heads unrepeated only without a mask
        saved += n * (t * (3 * inner * b + 2 * heads * head_dim * b + 2 * f * d + f * heads) + 2 * s * repeated * head_dim * b) \
            + t * f * d + scored * f * vocab + (t * s * b if p.masked else 0) + 2 * t * head_dim * b
    largest = max((p.tokens if p.scored is None else p.scored for p in passes), default=0)
    return Step(len(passes), saved, largest * vocab * b)


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
