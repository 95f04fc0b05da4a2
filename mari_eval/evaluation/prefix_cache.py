"""The frozen model's key/value caches of prompt prefixes, computed once and shared.

Every method edits the residual stream at or after the last prompt token p*, so the
frozen model's keys and values of the tokens *before* p* are the same for every edit,
every option and every epoch: ``encode_prefix`` computes them once, and the runner
(``mari_eval.evaluation.runner``, ``mari_eval.evaluation.generation``) runs only short suffixes over them.
``PrefixCache`` shares the prompts' common prefixes (few-shot preambles) across
questions visited in sorted order; ``own_part`` and ``joined`` let training keep one
shared preamble and each example's own tokens apart (``session.Session.prepare``).
``PackedPrompts`` holds several prompts in one cache (a shared preamble, then each
prompt's own tokens), so that many questions' rows run in one forward pass
(``packed_inputs``; ``runner.score_questions``, training's ``Session.prepare``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mari_eval.injection import devices
from mari_eval.injection.plan import ApplyEdits

MIN_SHARED = 32  # tokens a common prefix must save to be kept and reused (PrefixCache, shared_pass.EditedPrefix)


@dataclass
class Prefix:
    """The key/value cache of ``tokens`` (None when there are none): the frozen model's, or,
    with ``sites``, the model's under an edit at those positions (``encode_prefix``)."""

    tokens: tuple[int, ...]
    cache: object | None
    sites: tuple[int, ...] = ()


def with_cache(model: torch.nn.Module, cache) -> dict:
    """The forward/generate keyword holding a key/value cache: ``cache`` in transformers that
    renamed it (``past_key_values`` is deprecated there, removed in 5.40), else ``past_key_values``."""
    return {_cache_keyword(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_of(output):
    """The key/value cache a forward pass or ``generate`` returned (under either name)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _edited_at(model: torch.nn.Module, apply: ApplyEdits | None, cols: Sequence[int]):
    """``apply``'s edit of the states at columns ``cols`` of a one-row pass (no edit when there are none)."""
    if not cols:
        return contextlib.nullcontext()
    cols = torch.tensor(list(cols), device=devices.input_device(model))
    return apply(None, (torch.zeros_like(cols), cols))


def encode_prefix(
    model: torch.nn.Module,
    tokens: Sequence[int],
    base: Prefix | None = None,
    apply: ApplyEdits | None = None,
    sites: Sequence[int] = (),
) -> Prefix:
    """The cache of ``tokens``; when ``base`` holds a prefix of them, only the rest is computed.

    With ``sites`` (positions in ``tokens``), the forward pass runs under ``apply``'s edit
    at those positions (``Plan.prompt_sites``); gradients then flow if enabled. A
    ``base`` extended under an edit must have been computed under the same edit at exactly
    the sites that lie in it (``base.sites``): an edit of one position's state alone (ReFT's)
    then gives the base's tokens the same keys and values in both prompts.
    """
    tokens, sites = tuple(tokens), tuple(sorted(sites))
    if len(tokens) == 0:
        return Prefix((), None)
    device = devices.input_device(model)
    cache, start = None, 0
    if base is not None and base.cache is not None and len(base.tokens) < len(tokens) and tokens[: len(base.tokens)] == base.tokens:
        start = len(base.tokens)
        if base.sites != tuple(s for s in sites if s < start):
            raise ValueError(f"a prompt edited at {list(sites)} cannot extend a prefix cache edited at {list(base.sites)}: "
                             "the edited positions within the prefix must be the same")
        cache = broadcast_cache(base.cache, 1)  # extends a copy; base is never written
    edit = _edited_at(model, apply, [s - start for s in sites if s >= start])  # positions in the part computed now
    with torch.set_grad_enabled(bool(sites) and torch.is_grad_enabled()), edit:
        out = model(input_ids=torch.tensor([tokens[start:]], device=device), **with_cache(model, cache), use_cache=True,
                    logits_to_keep=1)
    return Prefix(tokens, cache_of(out), sites)


class PrefixCache:
    """Key/value caches of token prefixes shared between requests visited in sorted order.

    The prompts of an evaluation form a radix tree over their token ids (a few-shot
    preamble is an inner node, each question a leaf), as in SGLang's RadixAttention.
    Visiting the prompts sorted by their token ids walks that tree depth first, so the
    caches worth keeping are those on the path from the root to the current prompt: a
    stack of ``Prefix``es, each extending the one below it. A branch point (the prefix
    the new prompt shares with the previous one) gets an entry of its own when it adds at
    least ``min_shared`` tokens; entries off the current path are dropped, so memory is
    bounded by the path (at most ``max_depth`` entries), not by the number of prompts.
    """

    def __init__(self, model: torch.nn.Module, min_shared: int = MIN_SHARED, max_depth: int = 4):
        self.model, self.min_shared, self.max_depth = model, min_shared, max_depth
        self.path: list[Prefix] = []
        self.last = Prefix((), None)

    def encode(self, tokens: Sequence[int]) -> Prefix:
        """The cache of ``tokens``, computing only what the path does not hold."""
        tokens = tuple(tokens)
        if tokens == self.last.tokens:  # the same prompt again (e.g. truthfulqa_mc1 and _mc2)
            return self.last
        while self.path and tokens[: len(self.path[-1].tokens)] != self.path[-1].tokens:
            self.path.pop()
        top = self.path[-1] if self.path else None
        branch = common_prefix([self.last.tokens, tokens])
        if len(branch) < len(tokens) and len(branch) - (len(top.tokens) if top else 0) >= self.min_shared:
            top = truncated(self.last, len(branch)) or encode_prefix(self.model, branch, base=top)
            self.path = (self.path + [top])[-self.max_depth:]
        self.last = encode_prefix(self.model, tokens, base=top)
        return self.last


def truncated(prefix: Prefix, length: int) -> Prefix | None:
    """``prefix`` cut to its first ``length`` tokens, reading its cache (full-attention layers only, else None)."""
    if prefix.cache is None or not all(map(_full_attention, prefix.cache.layers)):
        return None  # a sliding-window layer no longer holds the early tokens
    cache = cache_rows(prefix.cache, [0])
    if length < len(prefix.tokens):  # crop(0) is a no-op only in newer transformers (older ones read it as "keep 0")
        cache.crop(length - len(prefix.tokens))
    return Prefix(prefix.tokens[:length], cache, tuple(s for s in prefix.sites if s < length))


def own_part(prefix: Prefix, shared: Prefix) -> Prefix | None:
    """What ``prefix`` (which extends ``shared``) holds beyond ``shared``: its full-attention
    layers cut to the tokens after ``shared`` (a copy, so the shared part is not kept twice);
    sliding-window layers, which hold at most their window, whole. None when nothing is beyond."""
    if len(prefix.tokens) == len(shared.tokens):
        return None
    if shared.cache is None:
        return prefix
    cut = len(shared.tokens)

    def beyond(i, layer):
        if _full_attention(layer):
            layer.keys, layer.values = layer.keys[..., cut:, :].clone(), layer.values[..., cut:, :].clone()

    return Prefix(prefix.tokens, _layerwise(prefix.cache, beyond))


def joined(shared: Prefix, own: Prefix | None) -> Prefix:
    """The cache of ``own.tokens`` from the shared part and an example's own part (``own_part``);
    new tensors, so neither part is ever written."""
    if own is None:
        return shared
    if shared.cache is None:
        return own

    def after_shared(i, layer):
        if _full_attention(layer):
            base = shared.cache.layers[i]
            layer.keys = torch.cat([base.keys, layer.keys], dim=-2)
            layer.values = torch.cat([base.values, layer.values], dim=-2)

    return Prefix(own.tokens, _layerwise(own.cache, after_shared))


def _layerwise(cache, change: Callable[[int, object], None]):
    """A shallow copy of ``cache`` whose layers are copies, each handed to ``change(i, layer)``
    to rebind its tensors; ``cache`` itself is never written."""
    new = copy.copy(cache)
    new.layers = []
    for i, layer in enumerate(cache.layers):
        layer = copy.copy(layer)
        change(i, layer)
        new.layers.append(layer)
    return new


def _full_attention(layer) -> bool:
    from transformers.cache_utils import \
        DynamicLayer  # deferred: transformers is heavy; only this path needs it

    return type(layer) is DynamicLayer


def broadcast_cache(cache, rows: int):
    """A cache whose every layer reads the batch-1 ``cache`` for ``rows`` rows."""
    return cache_rows(cache, [0] * rows)


def cache_rows(cache, index: Sequence[int]):
    """A cache whose row i is row ``index[i]`` of ``cache`` (None stays None).

    A batch-1 cache is shared through ``expand`` views, others are gathered. A forward
    pass concatenates new keys onto the copy's layers and so never writes into ``cache``.
    """
    if cache is None:
        return None

    def gather(i, layer):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            if layer.keys.shape[0] == 1:
                layer.keys = layer.keys.expand(len(index), *layer.keys.shape[1:])
                layer.values = layer.values.expand(len(index), *layer.values.shape[1:])
            else:
                rows = torch.tensor(list(index), device=layer.keys.device)
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]

    return _layerwise(cache, gather)


def common_prefix(seqs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The longest token prefix shared by all of ``seqs``."""
    first = tuple(seqs[0])
    n = len(first)
    for seq in seqs[1:]:
        n = min(n, len(seq))
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    return first[:n]


# ----------------------------------------------------------------------------- several prompts in one cache


@dataclass
class PackedPrompts:
    """The caches of several prompts before p* as one: ``shared`` tokens every prompt begins
    with, then each prompt's own tokens in turn (prompt i's at ``shared + spans[i][0]`` up to
    ``shared + spans[i][1]``). Rows after prompt i see the shared tokens and prompt i's own
    (``packed_inputs``), so the rows of many questions run in one pass."""

    cache: object | None
    shared: int
    spans: list[tuple[int, int]]

    @classmethod
    def of(cls, prefix: Prefix) -> "PackedPrompts":
        """One prompt: all of it shared."""
        return cls(prefix.cache, len(prefix.tokens), [(0, 0)])

    def length(self, i: int) -> int:
        """Prompt i's length, hence the position of its p*."""
        return self.shared + self.spans[i][1] - self.spans[i][0]

    @property
    def own_width(self) -> int:
        """The cached tokens after the shared ones."""
        return self.spans[-1][1] if self.spans else 0


def spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces of the given lengths."""
    return [(stop - n, stop) for stop, n in zip(itertools.accumulate(lengths), lengths)]


def encode_prompts(model: torch.nn.Module, shared: Prefix, prompts: Sequence[Sequence[int]],
                   apply: ApplyEdits | None = None, sites: Sequence[Sequence[int]] | None = None) -> PackedPrompts | None:
    """The frozen model's cache of ``prompts`` (each beginning with ``shared.tokens``) in one pass:
    their own tokens packed after the shared cache, each seeing the shared tokens and its own
    earlier ones only, at its own positions. The same keys and values as one prompt at a time;
    None when the model holds some layer's tokens in a sliding window (nothing to pack into).
    With ``sites`` (prompt i's edited positions, ``Plan.prompt_sites``), the pass runs under
    ``apply``'s edit at each prompt's sites beyond the shared tokens (those within them must be
    ``shared.sites``): an edit of one position's state alone gives what ``encode_prefix`` gives."""
    past = len(shared.tokens)
    owns = [list(p[past:]) for p in prompts]
    cache = broadcast_cache(shared.cache, 1)
    if any(owns):
        rows = [own for own in owns if own]
        inputs = packed_inputs(model, past, rows, [], [past] * len(rows))
        cols = []  # each prompt's sites beyond the shared tokens, as columns of the packed pass
        for start, own_sites in zip(itertools.accumulate([0] + [len(own) for own in owns]), sites or ()):
            cols += [start + s - past for s in own_sites if s >= past]
        with torch.set_grad_enabled(bool(cols) and torch.is_grad_enabled()), _edited_at(model, apply, cols):
            cache = cache_of(model(**with_cache(model, cache), use_cache=True, logits_to_keep=1, **inputs))
    if cache is not None and not all(map(_full_attention, cache.layers)):
        return None
    return PackedPrompts(cache, past, spans(list(map(len, owns))))


def packed_inputs(model: torch.nn.Module, past: int, rows: list[list[int]], context: list[tuple[int, int]],
                  first: list[int], width: int | None = None) -> dict[str, torch.Tensor]:
    """Token ids, positions and attention mask of ``rows`` packed in one sequence after a cache of
    ``past`` shared tokens followed by (with ``context``) ``width`` tokens of packed prompts (default:
    up to the last span's end): row i sees the shared tokens, the cached tokens ``past + context[i]``
    (its prompt's own), and its own earlier tokens; its tokens stand at positions ``first[i]``,
    ``first[i] + 1``... As tree attention packs candidate continuations in speculative decoding."""
    device, dtype = devices.input_device(model), model.dtype
    lengths = torch.tensor([len(r) for r in rows], device=device)
    starts = torch.cumsum(lengths, 0) - lengths
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    offset = torch.arange(int(lengths.sum()), device=device) - starts[row_of]
    own = (row_of[:, None] == row_of[None, :]) & (offset[None, :] <= offset[:, None])
    parts = [torch.ones(len(row_of), past, dtype=torch.bool, device=device)]
    if context:
        span = torch.tensor(context, device=device)[row_of]  # [T, 2]
        col = torch.arange(max(stop for _, stop in context) if width is None else width, device=device)
        parts.append((col[None, :] >= span[:, :1]) & (col[None, :] < span[:, 1:]))
    allowed = torch.cat([*parts, own], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    positions = torch.tensor(first, device=device)[row_of] + offset
    return {"input_ids": torch.tensor([[t for r in rows for t in r]], device=device),
            "attention_mask": mask[None, None], "position_ids": positions[None]}
