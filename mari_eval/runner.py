"""Run the frozen model on one prompt under several edits, computing the prompt once.

Every method edits the residual stream at or after the last prompt token p*, so the
frozen model's keys and values of the tokens *before* p* are the same for every edit,
every option and every epoch. This module computes them once (``encode_prefix``) and
runs only short suffixes over them:

    prefix  = context[:-1]                      (key/value cache, computed once, no grad)
    row     = [context[-1]] + continuation[:-1] (p* is row position 0)

A *variant* is one alternative edit proposed by a method (MARI: one per expert, plus
its gate probe); variant ``BASE`` (-1) is the untouched model. ``score_variants`` lays
out every (variant, option) row in packed batches, installs the method's edit with a
variant id per row, and returns each option's log-likelihood under each variant, the
greedy flags, and the hidden states at p* after the requested layers (for the energy
gate). An edit at l* changes nothing below it, so edited rows start from the untouched
rows' states after l*; and a method may stop after the untouched and probe rows (MARI's
closed gate). Gradients flow when enabled, so training uses the same path as evaluation.

``PrefixCache`` shares the prompts' common prefixes (few-shot preambles) across
questions, visited in sorted order.

``generate_variants`` does the same for free-text generation: the prompt before p* is
computed once, a closed gate hands the prompt to the untouched model, otherwise every
variant runs as one batch for a few greedy steps (the routing window), the method picks
a variant per prompt, and decoding continues from the winner's cache.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from mari_eval import site

BASE = -1  # variant id of the untouched model

# apply(variant_ids [R], positions [R] or None) -> context in which forward passes carry the edits
ApplyEdits = Callable[[torch.Tensor, torch.Tensor | None], AbstractContextManager]


@dataclass
class Prefix:
    """The frozen model's key/value cache of ``tokens`` (None when there are none)."""

    tokens: tuple[int, ...]
    cache: object | None


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


def encode_prefix(
    model: torch.nn.Module,
    tokens: Sequence[int],
    base: Prefix | None = None,
    apply: ApplyEdits | None = None,
    sites: Sequence[int] = (),
) -> Prefix:
    """The cache of ``tokens``; when ``base`` holds a prefix of them, only the rest is computed.

    With ``sites`` (positions in ``tokens``), the forward pass runs under ``apply``'s edit
    at those positions (``Intervention.prompt_sites``); gradients then flow if enabled.
    """
    tokens = tuple(tokens)
    if len(tokens) == 0:
        return Prefix((), None)
    device = site.input_device(model)
    cache, start = None, 0
    if base is not None and base.cache is not None and len(base.tokens) < len(tokens) and tokens[: len(base.tokens)] == base.tokens:
        if sites:
            raise ValueError("a prompt edited before p* cannot extend a shared prefix cache")
        cache, start = broadcast_cache(base.cache, 1), len(base.tokens)  # extends a copy; base is never written
    edit = contextlib.nullcontext()
    if sites:
        cols = torch.tensor(sorted(sites), device=device)
        edit = apply(None, (torch.zeros_like(cols), cols))
    with torch.set_grad_enabled(bool(sites) and torch.is_grad_enabled()), edit:
        out = model(input_ids=torch.tensor([tokens[start:]], device=device), **with_cache(model, cache), use_cache=True,
                    logits_to_keep=1)
    return Prefix(tokens, cache_of(out))


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

    def __init__(self, model: torch.nn.Module, min_shared: int = 32, max_depth: int = 4):
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
            top = _truncated(self.last, len(branch)) or encode_prefix(self.model, branch, base=top)
            self.path = (self.path + [top])[-self.max_depth:]
        self.last = encode_prefix(self.model, tokens, base=top)
        return self.last


def _truncated(prefix: Prefix, length: int) -> Prefix | None:
    """``prefix`` cut to its first ``length`` tokens, reading its cache (full-attention layers only, else None)."""
    if prefix.cache is None or not all(map(_full_attention, prefix.cache.layers)):
        return None  # a sliding-window layer no longer holds the early tokens
    cache = cache_rows(prefix.cache, [0])
    cache.crop(length - len(prefix.tokens))
    return Prefix(prefix.tokens[:length], cache)


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
    from transformers.cache_utils import DynamicLayer

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


@dataclass
class VariantRun:
    """Outcome of one prompt under each variant (rows follow ``variants``)."""

    variants: list[int]
    logprobs: torch.Tensor | None  # [V, M] sum of log p(option tokens) (multiple choice)
    greedy: torch.Tensor | None  # [V, M] whether each option is the greedy continuation
    site: dict[int, torch.Tensor]  # layer -> [V, d] hidden state at p* after that layer
    entropy: torch.Tensor | None = None  # [V] mean next-token entropy of the routing window (generation)
    # Variants whose outputs (log-likelihoods or routing-window entropies) were computed; the
    # others' rows are NaN placeholders (site-only variants, experts behind a closed gate).
    # None: every variant's.
    scored: frozenset[int] | None = None
    prompt: int | None = None  # generation: the prompt's row in the batch

    def row(self, variant: int) -> int:
        return self.variants.index(variant)

    def was_scored(self, variant: int) -> bool:
        return self.scored is None or variant in self.scored

    def nonfinite(self) -> list[tuple[int, str]]:
        """(variant, what) for every computed number of the run that is NaN or infinite."""
        bad = []
        for v in self.variants:
            r = self.row(v)
            if self.was_scored(v):
                if self.logprobs is not None and not bool(torch.isfinite(self.logprobs[r]).all()):
                    bad.append((v, "log-likelihood"))
                if self.entropy is not None and not bool(torch.isfinite(self.entropy[r]).all()):
                    bad.append((v, "routing entropy"))
            for layer, states in self.site.items():
                if not bool(states[r].isnan().all()) and not bool(torch.isfinite(states[r]).all()):
                    bad.append((v, f"hidden state at p* after layer {layer}"))
        return bad


def score_variants(
    model: torch.nn.Module,
    prefix: Prefix,
    last_token: int,
    continuations: Sequence[Sequence[int]],
    variants: Sequence[int],
    apply: ApplyEdits,
    capture: Sequence[int] = (),
    site_only: Sequence[int] = (),
    max_tokens: int = 1024,
    lower: tuple[int, list[torch.Tensor]] | None = None,
    edit_layer: int | None = None,
    screen: Callable[[VariantRun], bool] | None = None,
) -> VariantRun:
    """Log-likelihood of every continuation after ``prefix + [last_token]`` under every variant.

    Variants in ``site_only`` get one row holding p* alone: only their hidden states at
    p* (``capture``) are wanted, as for the gate's probe run. ``lower = (layer, states)``
    gives the frozen model's states after ``layer`` for each option's row
    (``lower_states``): the layers up to ``layer`` are then not recomputed (valid when the
    edits are at ``layer`` or above; training reuses them across experts and epochs).

    The rows run in three stages:

    1. the untouched model's (BASE) rows, in chunks laid out exactly as a run with BASE
       alone would be, so a closed gate returns bit-identical scores to the vanilla
       model. With ``edit_layer`` (every edit is at that layer's output or above) they
       also keep their states after it, which become ``lower`` for the edited rows
       (without BASE rows, a pass up to ``edit_layer`` computes them for several variants);
    2. the site-only variants;
    3. the other variants, unless ``screen`` (given the run so far) says they are not
       needed: MARI's closed gate answers with BASE, so its experts are never run and
       their log-likelihoods stay NaN.
    """
    device = site.input_device(model)
    n_var, n_opt = len(variants), len(continuations)
    scores: dict[tuple[int, int], torch.Tensor] = {}
    flags: dict[tuple[int, int], bool] = {}
    states: dict[int, dict[int, torch.Tensor]] = {layer: {} for layer in capture}

    def run_rows(layout: list[tuple[int, int | None]], keep_after: int | None = None) -> list[torch.Tensor] | None:
        """Score the (variant index, option index or None) rows; states after ``keep_after`` per option."""
        size = lambda row: 1 + (len(continuations[row[1]]) - 1 if row[1] is not None else 0)
        kept: dict[int, torch.Tensor] = {}
        for chunk in _chunks(layout, list(map(size, layout)), max_tokens):
            rows = [[last_token] + (list(continuations[m][:-1]) if m is not None else []) for _, m in chunk]
            variant_ids = torch.tensor([variants[v] for v, _ in chunk], device=device)
            start = None
            if lower is not None:
                start = (lower[0], torch.cat([lower[1][m] if m is not None else lower[1][0][:1] for _, m in chunk]))
            logits, seen, below = forward_rows(model, prefix, rows, variant_ids, apply, capture, start, keep_after)
            for j, (v, m) in enumerate(chunk):
                for layer, h in seen.items():  # the state at p* is the same in all rows of a variant
                    states[layer].setdefault(v, h[j])
                if m is None:
                    continue
                if below is not None:
                    kept[m] = below[j]
                target = torch.tensor(continuations[m], device=logits[j].device)
                lp = F.log_softmax(logits[j].float(), dim=-1)
                scores[v, m] = lp.gather(-1, target[:, None]).sum()
                flags[v, m] = bool((lp.argmax(-1) == target).all())
        return [kept[m] for m in range(n_opt)] if len(kept) == n_opt else None

    def run_so_far() -> VariantRun:
        # Scores live where the output head computes (the last device of a device map).
        nan = torch.tensor(float("nan"), device=next(iter(scores.values())).device if scores else device)
        logprobs = torch.stack([torch.stack([scores.get((v, m), nan) for m in range(n_opt)]) for v in range(n_var)])
        greedy = torch.tensor([[flags.get((v, m), False) for m in range(n_opt)] for v in range(n_var)], device=device)
        site_states = {layer: _rows_of(by_v, n_var) for layer, by_v in states.items() if by_v}
        scored = frozenset(variants[v] for v, _ in scores)
        return VariantRun(list(variants), logprobs, greedy, site_states, scored=scored)

    def layout(of: list[int]) -> list[tuple[int, int | None]]:
        out = []
        for v_idx in of:
            out.extend([(v_idx, None)] if variants[v_idx] in site_only else [(v_idx, m) for m in range(n_opt)])
        return out

    base = [i for i, v in enumerate(variants) if v == BASE]
    probes = [i for i, v in enumerate(variants) if v != BASE and v in site_only]
    answering = [i for i, v in enumerate(variants) if v != BASE and v not in site_only]
    keep_after = edit_layer if lower is None and (probes or answering) and site.can_start_after(model) else None
    kept = run_rows(layout(base), keep_after)
    if kept is None and keep_after is not None and len(probes) + len(answering) > 1:
        rows = [[last_token] + list(c[:-1]) for c in continuations]  # no BASE rows to keep them from
        if packable(model, len(prefix.tokens), max(map(len, rows))):
            kept = lower_states(model, prefix, rows, keep_after)
    if kept is not None:
        lower = (keep_after, kept)
    run_rows(layout(probes))
    if answering and (screen is None or screen(run_so_far())):
        run_rows(layout(answering))
    return run_so_far()


def _rows_of(by_variant: dict[int, torch.Tensor], n_var: int) -> torch.Tensor:
    """[V, d] states of the variants run so far; NaN rows for those not run."""
    some = next(iter(by_variant.values()))
    return torch.stack([by_variant.get(v, torch.full_like(some, float("nan"))) for v in range(n_var)])


def no_edit(variant_ids, positions):
    return contextlib.nullcontext()


def common_prefix(seqs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The longest token prefix shared by all of ``seqs``."""
    first = tuple(seqs[0])
    n = len(first)
    for seq in seqs[1:]:
        n = min(n, len(seq))
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    return first[:n]


def _chunks(items: list, sizes: list[int], max_tokens: int) -> list[list]:
    out, current, total = [], [], 0
    for item, size in zip(items, sizes):
        if current and total + size > max_tokens:
            out.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    return out + ([current] if current else [])


def forward_rows(
    model: torch.nn.Module,
    prefix: Prefix,
    rows: list[list[int]],
    variant_ids: torch.Tensor,
    apply: ApplyEdits,
    capture: Sequence[int] = (),
    start: tuple[int, torch.Tensor] | None = None,
    keep_after: int | None = None,
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], list[torch.Tensor] | None]:
    """Logits of every row (each after ``prefix``), hidden states at each row's first token,
    and (with ``keep_after``, packed path only, else None) every token's state after that layer.

    ``start = (layer, states [sum of row lengths, d])`` runs only the layers above
    ``layer`` (packed path of supported families; otherwise everything is recomputed).

    The rows are packed into one sequence whose attention mask lets each row see the
    prefix and its own earlier tokens only (as tree attention does in speculative
    decoding), so the prefix cache is read once instead of being copied per row. Models
    with sliding-window layers whose window the rows would cross fall back to a padded
    batch over a broadcast cache. Both give the same numbers as running every row alone.
    """
    if bool((variant_ids == BASE).all()):  # nothing to edit: no hook at all, as in a vanilla run
        apply = no_edit
    if packable(model, len(prefix.tokens), max(map(len, rows))):
        return _forward_packed(model, prefix, rows, variant_ids, apply, capture, start, keep_after)
    return (*_forward_batched(model, prefix, rows, variant_ids, apply, capture), None)


def packable(model: torch.nn.Module, prefix_len: int, longest_row: int) -> bool:
    config = model.config.get_text_config()
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    window = getattr(config, "sliding_window", None)
    sliding = any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or []))
    return not (sliding and window) or prefix_len + longest_row <= window


def _packing(model, prefix, rows):
    """Token ids, position ids and attention mask of ``rows`` packed into one sequence after ``prefix``."""
    device, dtype = site.input_device(model), model.dtype
    past = len(prefix.tokens)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    starts = torch.cumsum(lengths, 0) - lengths
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    offset = torch.arange(int(lengths.sum()), device=device) - starts[row_of]
    allowed = (row_of[:, None] == row_of[None, :]) & (offset[None, :] <= offset[:, None])
    allowed = torch.cat([torch.ones(len(row_of), past, dtype=torch.bool, device=device), allowed], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    ids = torch.tensor([[t for r in rows for t in r]], device=device)
    inputs = dict(input_ids=ids, attention_mask=mask[None, None], position_ids=(past + offset)[None])
    return inputs, starts, lengths


def _all_positions(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of every token of a packed sequence."""
    length = inputs["input_ids"].shape[1]
    cols = torch.arange(length, device=inputs["input_ids"].device)
    return torch.zeros_like(cols), cols


def lower_states(model: torch.nn.Module, prefix: Prefix, rows: list[list[int]], layer: int) -> list[torch.Tensor]:
    """The frozen model's states after ``layer`` for every token of every row (one [len, d] per row)."""
    inputs, starts, lengths = _packing(model, prefix, rows)
    everywhere = _all_positions(inputs)
    cache = broadcast_cache(prefix.cache, 1)
    states = site.states_after(model, layer, everywhere, **with_cache(model, cache), use_cache=cache is not None, **inputs)
    return [states[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())]


def _forward_packed(model, prefix, rows, variant_ids, apply, capture, start=None, keep_after=None):
    inputs, starts, lengths = _packing(model, prefix, rows)
    sites = (torch.zeros_like(starts), starts)
    everywhere = _all_positions(inputs)
    cache = broadcast_cache(prefix.cache, 1)
    skip = contextlib.nullcontext()
    if start is not None and site.can_start_after(model):
        skip = site.start_after(model, start[0], start[1][None])
    with skip, apply(variant_ids, sites), site.capture_site(model, capture, sites) as seen, \
            site.capture_site(model, [] if keep_after is None else [keep_after], everywhere) as below:
        logits = model(**with_cache(model, cache), use_cache=cache is not None, **inputs).logits[0]
    split = lambda x: [x[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())]
    return split(logits), dict(seen), split(below[keep_after]) if keep_after is not None else None


def _forward_batched(model, prefix, rows, variant_ids, apply, capture):
    device = site.input_device(model)
    width = max(map(len, rows))
    # Right padding needs no mask: pads come after every scored position.
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=device)
    at_p_star = torch.zeros(len(rows), dtype=torch.long, device=device)
    cache = broadcast_cache(prefix.cache, len(rows))
    with apply(variant_ids, at_p_star), site.capture_site(model, capture, at_p_star) as seen:
        logits = model(input_ids=ids, **with_cache(model, cache), use_cache=cache is not None).logits
    return [logits[j, : len(r)] for j, r in enumerate(rows)], dict(seen)


# ----------------------------------------------------------------------------- generation


def step_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) over the last axis (eq:entropy_def), at the shared temperature 1."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _eos_ids(model: torch.nn.Module) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


@torch.no_grad()
def generate_variants(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    variants: Sequence[int],
    apply: ApplyEdits,
    choose: Callable[[VariantRun], tuple[int, dict]],
    window: int,
    max_length: int,
    capture: Sequence[int] = (),
    site_only: Sequence[int] = (),
    screen: Callable[[VariantRun], bool] | None = None,
    edit_layer: int | None = None,
    pad_token_id: int | None = None,
    stopping_criteria: Callable[[int, int], object] | None = None,
    streamer=None,
    **generation_kwargs,
) -> tuple[torch.Tensor, list[dict]]:
    """Greedy generation where each prompt is answered by the variant ``choose`` picks.

    The prompts are left-padded rows of ``input_ids``, so p* is the last column.

    * With ``screen`` (MARI's gate): the untouched model reads each prompt once and
      proposes its first token, as ``generate`` alone would; the ``site_only`` variants
      (the probe) then rerun p* alone over that cache, from ``edit_layer`` up. A prompt
      that ``screen`` turns away keeps the untouched model's answer, decoded on at base
      speed. For the others, the untouched p* is masked out of the cache and p* is fed
      again under every remaining variant.
    * Without it, the prompts before p* are computed once and every variant starts at p*.

    The variants then run as one batch for ``window`` greedy steps (eq:entropy_gen's
    T_ent); ``choose`` sees each prompt's mean next-token entropies and its states at p*,
    and decoding continues from the chosen rows' tokens and cache, so nothing is
    recomputed. ``stopping_criteria(rows, prompt_width)`` builds the criteria of a batch;
    a ``streamer`` (one prompt) receives the answer only, the routing window's once chosen.
    Returns the sequences (prompt + answer, pad after the first end-of-sequence token) and
    the ``choose`` records.
    """
    n_prompts, width = input_ids.shape
    stop = stopping_criteria or (lambda rows, prompt_width: None)
    kwargs = dict(pad_token_id=pad_token_id, use_cache=True, **generation_kwargs)
    screened = [BASE, *site_only] if screen is not None else []
    answering = [v for v in variants if v not in screened]
    device = input_ids.device

    def run_of(p: int, states: dict, entropy: torch.Tensor | None) -> VariantRun:
        """Prompt p's run over screened + answering variants (NaN for what was not run)."""
        nan = lambda n: torch.full((n,), float("nan"), device=device)
        u = torch.cat([nan(len(screened)), entropy if entropy is not None else nan(len(answering))])
        site_states = {m: torch.cat([h, h[:1].new_full((len(screened) + len(answering) - len(h), h.shape[-1]), float("nan"))])
                       for m, h in states.items()}
        return VariantRun(screened + answering, None, None, site_states, u,
                          scored=frozenset(answering if entropy is not None else []), prompt=p)

    answers: dict[int, torch.Tensor] = {}
    records: dict[int, dict] = {}
    states = {p: {} for p in range(n_prompts)}
    routed = list(range(n_prompts))
    if screened:
        first, base = _base_first_token(model, input_ids, attention_mask, capture, edit_layer, kwargs)
        probe = _probe_at_p_star(model, input_ids, attention_mask, cache_of(first), site_only, apply,
                                 capture, edit_layer, base)
        n = len(site_only)
        states = {p: {m: torch.cat([base[m][p:p + 1], probe[m][p * n:(p + 1) * n]]) for m in capture} for p in range(n_prompts)}
        routed = [p for p in range(n_prompts) if screen(run_of(p, states[p], None))]
        kept = [p for p in range(n_prompts) if p not in routed]
        if kept:  # the untouched model answers, decoding on from its first token
            out = _continue(model, first.sequences[kept], attention_mask[kept], cache_rows(cache_of(first), kept),
                            width, max_length, stop(len(kept), width), streamer, kwargs)
            for j, p in enumerate(kept):
                answers[p] = out[j]
                records[p] = choose(run_of(p, states[p], None))[1]
        # The routed prompts feed p* again over the untouched cache, whose p* is masked out.
        ids, mask = torch.cat([input_ids, input_ids[:, -1:]], dim=1), _p_star_fed_again(attention_mask)
        cache = cache_of(first)
    else:
        ids, mask, cache = input_ids, attention_mask, _prefill(model, input_ids[:, :-1], attention_mask[:, :-1])
    if routed:
        n_var = len(answering)
        index = [p for p in routed for _ in range(n_var)]
        steps = max(1, min(window, max_length - width))
        variant_ids = torch.tensor(answering, device=device).repeat(len(routed))
        window_out, entropy, seen = _routing_window(model, ids[index], mask[index], variant_ids, apply,
                                                    () if screened else capture, steps, cache=cache_rows(cache, index), **kwargs)
        chosen_rows = []
        for j, p in enumerate(routed):
            rows = slice(j * n_var, (j + 1) * n_var)
            run = run_of(p, states[p] or {m: h[rows] for m, h in seen.items()}, entropy[rows])
            chosen, record = choose(run)
            chosen_rows.append(j * n_var + answering.index(chosen))
            records[p] = record
        cache = cache_of(window_out)
        cache.batch_select_indices(torch.tensor(chosen_rows, device=device))
        extra = ids.shape[1] - width  # the re-fed p*, dropped from the answer
        out = _continue(model, window_out.sequences[chosen_rows], mask[routed], cache, ids.shape[1],
                        max_length + extra, stop(len(routed), ids.shape[1]), streamer, kwargs)
        answers.update(zip(routed, torch.cat([out[:, :width], out[:, ids.shape[1]:]], dim=1)))
    longest = max(len(a) for a in answers.values())
    pad = pad_token_id if pad_token_id is not None else 0
    sequences = torch.stack([F.pad(answers[p], (0, longest - len(answers[p])), value=pad) for p in range(n_prompts)])
    return _pad_after_eos(sequences, width, _eos_ids(model), pad_token_id), [records[p] for p in range(n_prompts)]


def _continue(model, sequences, prompt_mask, cache, answer_from, max_length, criteria, streamer, kwargs):
    """Decode on from ``sequences`` (the cache holds all but their last token); the tokens from
    ``answer_from`` on are the answer so far, streamed before decoding goes on."""
    if streamer is not None:
        streamer.put(sequences[0, :answer_from].cpu())
        for token in sequences[0, answer_from:]:
            streamer.put(token[None].cpu())
    if sequences.shape[1] >= max_length:
        if streamer is not None:
            streamer.end()
        return sequences
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, prompt_mask.shape[1]:])], dim=1)
    return model.generate(input_ids=sequences, attention_mask=mask, **with_cache(model, cache), max_length=max_length,
                          stopping_criteria=criteria, streamer=_SkipPrompt(streamer) if streamer is not None else None,
                          **kwargs)


def _base_first_token(model, input_ids, attention_mask, capture, edit_layer, kwargs):
    """generate's first step of the untouched model, with its states at p* after ``capture`` and ``edit_layer``."""
    layers = sorted(set(capture) | ({edit_layer} if edit_layer is not None else set()))
    with site.capture_site(model, layers, None) as seen:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=1,
                             return_dict_in_generate=True, **kwargs)
    return out, dict(seen)


def _probe_at_p_star(model, input_ids, attention_mask, cache, variants, apply, capture, edit_layer, base):
    """p* fed again under each of ``variants`` (rows prompt-major) over ``cache`` (the prompt,
    with its untouched p* masked out): the states after ``capture`` layers at p*, [P * V, d]."""
    index = [p for p in range(input_ids.shape[0]) for _ in variants]
    prompt_mask = attention_mask[index]
    mask = _p_star_fed_again(prompt_mask)
    variant_ids = torch.tensor(list(variants), device=input_ids.device).repeat(input_ids.shape[0])
    skip = contextlib.nullcontext()
    if edit_layer is not None and site.can_start_after(model):  # below the site, p* is the untouched model's
        skip = site.start_after(model, edit_layer, base[edit_layer][index][:, None])
    with skip, apply(variant_ids, None), site.capture_site(model, capture, None) as seen:
        site.run_through(model, max(capture), input_ids=input_ids[index, -1:], attention_mask=mask,
                         position_ids=_positions(prompt_mask)[:, -1:], **with_cache(model, cache_rows(cache, index)), use_cache=True)
    return dict(seen)


def _p_star_fed_again(attention_mask: torch.Tensor) -> torch.Tensor:
    """The mask of a prompt whose cached p* (the last column) is hidden and fed again as a new column."""
    last = attention_mask[:, -1:]
    return torch.cat([attention_mask[:, :-1], torch.zeros_like(last), torch.ones_like(last)], dim=1)


class _SkipPrompt:
    """A streamer that ignores generate's first ``put`` (the prompt and the tokens already streamed)."""

    def __init__(self, streamer):
        self.streamer, self.started = streamer, False

    def put(self, value):
        if self.started:
            self.streamer.put(value)
        self.started = True

    def end(self):
        self.streamer.end()


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as ``generate`` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def _prefill(model, input_ids, attention_mask):
    """The untouched model's cache of left-padded prompts (None when they are empty)."""
    if input_ids.shape[1] == 0:
        return None
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                use_cache=True, logits_to_keep=1)
    return cache_of(out)


def _routing_window(model, input_ids, attention_mask, variant_ids, apply, capture, steps, cache=None, **generation_kwargs):
    """Rows of prompts, row i under variant ``variant_ids[i]``, for ``steps`` greedy steps.

    ``cache`` (optional) holds each row's prompt before p*. Returns generate's output,
    each row's mean next-token entropy over the window up to its end-of-sequence token
    (eq:entropy_gen), and the captured states at p*.
    """
    with apply(variant_ids, None), site.capture_site(model, capture, None) as seen:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=steps, output_logits=True,
                             return_dict_in_generate=True, **with_cache(model, cache), **generation_kwargs)
    per_step = step_entropy(torch.stack(out.logits, dim=1)).to(input_ids.device)  # [rows, steps]
    generated = out.sequences[:, input_ids.shape[1]:]
    ended = torch.isin(generated, torch.tensor(_eos_ids(model) or [-1], device=input_ids.device)).long()
    live = ((ended.cumsum(-1) - ended) == 0).float()
    return out, (per_step * live).sum(-1) / live.sum(-1).clamp_min(1), dict(seen)


@torch.no_grad()
def routing_entropy(model: torch.nn.Module, prompt: Sequence[int], variants: Sequence[int], apply: ApplyEdits,
                    window: int) -> torch.Tensor:
    """u_k of eq:entropy_gen for one prompt under each variant ([V])."""
    device = site.input_device(model)
    ids = torch.tensor([list(prompt)] * len(variants), device=device)
    pad = getattr(model.generation_config, "pad_token_id", None)
    _, entropy, _ = _routing_window(model, ids, torch.ones_like(ids), torch.tensor(list(variants), device=device), apply,
                                    (), window, pad_token_id=pad if pad is not None else (_eos_ids(model) or [0])[0],
                                    do_sample=False)
    return entropy


def _pad_after_eos(sequences: torch.Tensor, prompt_len: int, eos: list[int], pad: int | None) -> torch.Tensor:
    """Tokens after a row's first end-of-sequence token become padding (as generate does)."""
    if not eos or pad is None:
        return sequences
    generated = sequences[:, prompt_len:]
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device))
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return torch.cat([sequences[:, :prompt_len], generated.masked_fill(after, pad)], dim=1)
