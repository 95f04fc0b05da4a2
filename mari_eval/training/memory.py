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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

from mari_eval.injection import site
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


def cache_bytes_per_token(model: torch.nn.Module) -> int:
    """c: bytes of keys and values one token adds to the cache of every layer (works on meta models)."""
    config = model.config.get_text_config()
    heads, head_dim = site.attention_heads(model)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return 2 * site.num_layers(model) * kv_heads * head_dim * _itemsize(model)


def _itemsize(model: torch.nn.Module) -> int:
    return torch.empty((), dtype=model.dtype).element_size()


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
    c = cache_bytes_per_token(model)
    d = int(model.config.get_text_config().hidden_size)
    return Estimate(len(own_tokens), shared_tokens, shared_tokens * c, sum(own_tokens) * c,
                    sum(row_tokens) * d * _itemsize(model) if lower else 0)


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


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
