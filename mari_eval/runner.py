"""Run the frozen model on one prompt under several edits, computing the prompt once.

Every method edits the residual stream at or after the last prompt token p*, so the
frozen model's keys and values of the tokens *before* p* are the same for every edit,
every option and every epoch. This module computes them once (``encode_prefix``) and
runs only short suffixes over them:

    prefix  = context[:-1]                      (key/value cache, computed once, no grad)
    row     = [context[-1]] + continuation[:-1] (p* is row position 0)

A *variant* is one alternative edit proposed by a method (MARI: one per expert, plus
its gate probe); variant ``BASE`` (-1) is the untouched model. ``score_variants`` lays
out every (variant, option) row in one batch, installs the method's edit with a
variant id per row, and returns each option's log-likelihood under each variant, the
greedy flags, and the hidden states at p* after the requested layers (for the energy
gate). Gradients flow when enabled, so training uses the same path as evaluation.

``generate_variants`` does the same for free-text generation: the prompt is run under
every variant as one left-padded batch for a few greedy steps (the routing window), the
method picks a variant per prompt, and decoding continues from the winner's cache.
"""

from __future__ import annotations

import contextlib
import copy
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
    device = next(model.parameters()).device
    cache, start = None, 0
    if base is not None and base.cache is not None and len(base.tokens) < len(tokens) and tokens[: len(base.tokens)] == base.tokens:
        if sites:
            raise ValueError("a prompt edited before p* cannot extend a shared prefix cache")
        cache, start = copy.deepcopy(base.cache), len(base.tokens)
    edit = contextlib.nullcontext()
    if sites:
        cols = torch.tensor(sorted(sites), device=device)
        edit = apply(None, (torch.zeros_like(cols), cols))
    with torch.set_grad_enabled(bool(sites) and torch.is_grad_enabled()), edit:
        out = model(input_ids=torch.tensor([tokens[start:]], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return Prefix(tokens, out.past_key_values)


def broadcast_cache(cache, rows: int):
    """A cache whose every layer reads the batch-1 ``cache`` for ``rows`` rows.

    The copies share the stored tensors through ``expand`` views; a forward pass
    concatenates new keys onto them and so never writes into the shared prefix.
    """
    if cache is None:
        return None
    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        layer = copy.copy(layer)
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.expand(rows, *layer.keys.shape[1:])
            layer.values = layer.values.expand(rows, *layer.values.shape[1:])
        new.layers.append(layer)
    return new


@dataclass
class VariantRun:
    """Outcome of one prompt under each variant (rows follow ``variants``)."""

    variants: list[int]
    logprobs: torch.Tensor | None  # [V, M] sum of log p(option tokens) (multiple choice)
    greedy: torch.Tensor | None  # [V, M] whether each option is the greedy continuation
    site: dict[int, torch.Tensor]  # layer -> [V, d] hidden state at p* after that layer
    entropy: torch.Tensor | None = None  # [V] mean next-token entropy of the routing window (generation)

    def row(self, variant: int) -> int:
        return self.variants.index(variant)


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
) -> VariantRun:
    """Log-likelihood of every continuation after ``prefix + [last_token]`` under every variant.

    Variants in ``site_only`` get one row holding p* alone: only their hidden states at
    p* (``capture``) are wanted, as for the gate's probe run. ``lower = (layer, states)``
    gives the frozen model's states after ``layer`` for each option's row
    (``lower_states``): the layers up to ``layer`` are then not recomputed (valid when the
    edits are at ``layer`` or above; training reuses them across experts and epochs).
    """
    device = next(model.parameters()).device
    layout = []  # (variant index, option index or None) per row
    for v_idx, v in enumerate(variants):
        if v in site_only:
            layout.append((v_idx, None))
        else:
            layout.extend((v_idx, m) for m in range(len(continuations)))
    n_var, n_opt = len(variants), len(continuations)
    scores: dict[tuple[int, int], torch.Tensor] = {}
    flags: dict[tuple[int, int], bool] = {}
    states: dict[int, dict[int, torch.Tensor]] = {layer: {} for layer in capture}
    # The untouched model's rows run in chunks of their own, laid out exactly as a run with
    # BASE alone would be: a closed gate then returns bit-identical scores to the vanilla model.
    size = lambda row: 1 + (len(continuations[row[1]]) - 1 if row[1] is not None else 0)
    base_rows = [row for row in layout if variants[row[0]] == BASE]
    edited_rows = [row for row in layout if variants[row[0]] != BASE]
    chunks = _chunks(base_rows, list(map(size, base_rows)), max_tokens) + _chunks(edited_rows, list(map(size, edited_rows)), max_tokens)
    for chunk in chunks:
        rows = [[last_token] + (list(continuations[m][:-1]) if m is not None else []) for _, m in chunk]
        variant_ids = torch.tensor([variants[v] for v, _ in chunk], device=device)
        start = None
        if lower is not None:
            start = (lower[0], torch.cat([lower[1][m] if m is not None else lower[1][0][:1] for _, m in chunk]))
        logits, seen = forward_rows(model, prefix, rows, variant_ids, apply, capture, start)
        for j, (v, m) in enumerate(chunk):
            for layer, h in seen.items():  # the state at p* is the same in all rows of a variant
                states[layer].setdefault(v, h[j])
            if m is None:
                continue
            target = torch.tensor(continuations[m], device=device)
            lp = F.log_softmax(logits[j].float(), dim=-1)
            scores[v, m] = lp.gather(-1, target[:, None]).sum()
            flags[v, m] = bool((lp.argmax(-1) == target).all())
    nan = torch.tensor(float("nan"), device=device)
    logprobs = torch.stack([torch.stack([scores.get((v, m), nan) for m in range(n_opt)]) for v in range(n_var)])
    greedy = torch.tensor([[flags.get((v, m), False) for m in range(n_opt)] for v in range(n_var)], device=device)
    site_states = {layer: torch.stack([by_v[v] for v in range(n_var)]) for layer, by_v in states.items()}
    return VariantRun(list(variants), logprobs, greedy, site_states)


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
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """Logits of every row (each after ``prefix``) and hidden states at each row's first token.

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
    if _packable(model, len(prefix.tokens), max(map(len, rows))):
        return _forward_packed(model, prefix, rows, variant_ids, apply, capture, start)
    return _forward_batched(model, prefix, rows, variant_ids, apply, capture)


def _packable(model: torch.nn.Module, prefix_len: int, longest_row: int) -> bool:
    config = model.config.get_text_config()
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    window = getattr(config, "sliding_window", None)
    sliding = any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or []))
    return not (sliding and window) or prefix_len + longest_row <= window


def _packing(model, prefix, rows):
    """Token ids, position ids and attention mask of ``rows`` packed into one sequence after ``prefix``."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
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


def lower_states(model: torch.nn.Module, prefix: Prefix, rows: list[list[int]], layer: int) -> list[torch.Tensor]:
    """The frozen model's states after ``layer`` for every token of every row (one [len, d] per row)."""
    inputs, starts, lengths = _packing(model, prefix, rows)
    everywhere = (torch.zeros_like(inputs["input_ids"][0]), torch.arange(inputs["input_ids"].shape[1], device=starts.device))
    cache = broadcast_cache(prefix.cache, 1)
    states = site.states_after(model, layer, everywhere, past_key_values=cache, use_cache=cache is not None, **inputs)
    return [states[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())]


def _forward_packed(model, prefix, rows, variant_ids, apply, capture, start=None):
    inputs, starts, lengths = _packing(model, prefix, rows)
    sites = (torch.zeros_like(starts), starts)
    cache = broadcast_cache(prefix.cache, 1)
    skip = contextlib.nullcontext()
    if start is not None and site.can_start_after(model):
        skip = site.start_after(model, start[0], start[1][None])
    with skip, apply(variant_ids, sites), site.capture_site(model, capture, sites) as seen:
        logits = model(past_key_values=cache, use_cache=cache is not None, **inputs).logits[0]
    return [logits[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())], dict(seen)


def _forward_batched(model, prefix, rows, variant_ids, apply, capture):
    device = next(model.parameters()).device
    width = max(map(len, rows))
    # Right padding needs no mask: pads come after every scored position.
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=device)
    at_p_star = torch.zeros(len(rows), dtype=torch.long, device=device)
    cache = broadcast_cache(prefix.cache, len(rows))
    with apply(variant_ids, at_p_star), site.capture_site(model, capture, at_p_star) as seen:
        logits = model(input_ids=ids, past_key_values=cache, use_cache=cache is not None).logits
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
    pad_token_id: int | None = None,
    stopping_criteria=None,
    **generation_kwargs,
) -> tuple[torch.Tensor, list[dict]]:
    """Greedy generation where each prompt is answered by the variant ``choose`` picks.

    Every prompt (left-padded rows of ``input_ids``) is run under every variant as one
    batch for ``window`` steps (eq:entropy_gen's T_ent); ``choose`` sees each prompt's
    mean next-token entropies and hidden states at p*; decoding then continues from the
    chosen rows' tokens and key/value cache, so nothing is recomputed. Returns the
    sequences (prompt + continuation, pad after the first end-of-sequence token) and
    the ``choose`` records.
    """
    n_prompts, n_var = input_ids.shape[0], len(variants)
    steps = max(1, min(window, max_length - input_ids.shape[1]))
    first, entropy, seen = _routing_window(model, input_ids, attention_mask, variants, apply, capture, steps,
                                           pad_token_id=pad_token_id, **generation_kwargs)
    chosen_rows, records = [], []
    for p in range(n_prompts):
        rows = slice(p * n_var, (p + 1) * n_var)
        run = VariantRun(list(variants), None, None, {m: h[rows] for m, h in seen.items()}, entropy[rows])
        chosen, record = choose(run)
        chosen_rows.append(p * n_var + run.row(chosen))
        records.append(record)
    sequences = first.sequences[chosen_rows]
    if sequences.shape[1] < max_length:
        cache = first.past_key_values
        cache.batch_select_indices(torch.tensor(chosen_rows, device=sequences.device))
        prompt_mask = attention_mask[[row // n_var for row in chosen_rows]]
        new_mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, input_ids.shape[1]:])], dim=1)
        sequences = model.generate(
            input_ids=sequences, attention_mask=new_mask, past_key_values=cache, max_length=max_length,
            pad_token_id=pad_token_id, stopping_criteria=stopping_criteria, use_cache=True, **generation_kwargs,
        )
    return _pad_after_eos(sequences, input_ids.shape[1], _eos_ids(model), pad_token_id), records


def _routing_window(model, input_ids, attention_mask, variants, apply, capture, steps, **generation_kwargs):
    """Every prompt under every variant (rows prompt-major) for ``steps`` greedy steps.

    Returns generate's output, each row's mean next-token entropy over the window up to
    its end-of-sequence token (eq:entropy_gen), and the captured states at p*.
    """
    n_prompts, n_var = input_ids.shape[0], len(variants)
    ids = input_ids.repeat_interleave(n_var, 0)
    mask = attention_mask.repeat_interleave(n_var, 0)
    variant_ids = torch.tensor(list(variants), device=ids.device).repeat(n_prompts)
    with apply(variant_ids, None), site.capture_site(model, capture, None) as seen:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, output_logits=True,
                             return_dict_in_generate=True, use_cache=True, **generation_kwargs)
    per_step = step_entropy(torch.stack(out.logits, dim=1))  # [P*V, steps]
    generated = out.sequences[:, input_ids.shape[1]:]
    ended = torch.isin(generated, torch.tensor(_eos_ids(model) or [-1], device=ids.device)).long()
    live = ((ended.cumsum(-1) - ended) == 0).float()
    return out, (per_step * live).sum(-1) / live.sum(-1).clamp_min(1), dict(seen)


@torch.no_grad()
def routing_entropy(model: torch.nn.Module, prompt: Sequence[int], variants: Sequence[int], apply: ApplyEdits,
                    window: int) -> torch.Tensor:
    """u_k of eq:entropy_gen for one prompt under each variant ([V])."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    pad = getattr(model.generation_config, "pad_token_id", None)
    _, entropy, _ = _routing_window(model, ids, torch.ones_like(ids), variants, apply, (), window,
                                    pad_token_id=pad if pad is not None else (_eos_ids(model) or [0])[0], do_sample=False)
    return entropy


def _pad_after_eos(sequences: torch.Tensor, prompt_len: int, eos: list[int], pad: int | None) -> torch.Tensor:
    """Tokens after a row's first end-of-sequence token become padding (as generate does)."""
    if not eos or pad is None:
        return sequences
    generated = sequences[:, prompt_len:]
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device))
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return torch.cat([sequences[:, :prompt_len], generated.masked_fill(after, pad)], dim=1)
