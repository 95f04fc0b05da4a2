"""Score a prompt's options under every variant of a method's ``Plan``, computing the prompt once.

The frozen model's cache of the prompt before p* is computed once
(``mari_eval.prefix_cache``) and only short suffixes run over it:

    prefix  = context[:-1]                      (key/value cache, computed once, no grad)
    row     = [context[-1]] + continuation[:-1] (p* is row position 0)

A *variant* is one alternative edit proposed by a method (MARI: one per expert, plus
its gate probe); variant ``BASE`` (-1) is the untouched model (``mari_eval.plan``). ``score_variants`` lays
out every (variant, option) row in packed batches, installs the method's edit with a
variant id per row, and returns each option's log-likelihood under each variant, the
greedy flags, and the hidden states at p* after the requested layers (for the energy
gate). An edit at l* changes nothing below it, so edited rows start from the untouched
rows' states after l*; and a method may stop after the untouched and probe rows (MARI's
closed gate). Gradients flow when enabled, so training uses the same path as evaluation.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F

from mari_eval import devices, site
from mari_eval.plan import BASE, VANILLA, ApplyEdits, Plan, VariantRun, no_edit
from mari_eval.prefix_cache import Prefix, broadcast_cache, with_cache

__all__ = ["BASE", "VANILLA", "Plan", "VariantRun", "score_variants", "forward_rows", "lower_states", "packable"]


def score_variants(
    model: torch.nn.Module,
    prefix: Prefix,
    last_token: int,
    continuations: Sequence[Sequence[int]],
    plan: Plan,
    max_tokens: int = 1024,
    lower: tuple[int, list[torch.Tensor]] | None = None,
) -> VariantRun:
    """Log-likelihood of every continuation after ``prefix + [last_token]`` under every variant of ``plan``.

    Variants in ``plan.site_only`` get one row holding p* alone: only their hidden states at
    p* (``plan.capture``) are wanted, as for the gate's probe run. ``lower = (layer, states)``
    gives the frozen model's states after ``layer`` for each option's row
    (``lower_states``): the layers up to ``layer`` are then not recomputed (valid when the
    edits are at ``layer`` or above; training reuses them across experts and epochs).

    The rows run in three stages:

    1. the untouched model's (BASE) rows, in chunks laid out exactly as a run with BASE
       alone would be, so a closed gate returns bit-identical scores to the vanilla
       model. With ``plan.edit_layer`` (every edit is at that layer's output or above) they
       also keep their states after it, which become ``lower`` for the edited rows
       (without BASE rows, a pass up to that layer computes them for several variants);
    2. the site-only variants;
    3. the other variants, unless ``plan.screen`` (given the run so far) says they are not
       needed: MARI's closed gate answers with BASE, so its experts are never run and
       their log-likelihoods stay NaN.
    """
    device = devices.input_device(model)
    variants, apply, capture, site_only = plan.variants, plan.apply, plan.capture, plan.site_only
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
    keep_after = plan.edit_layer if lower is None and (probes or answering) and site.can_start_after(model) else None
    kept = run_rows(layout(base), keep_after)
    if kept is None and keep_after is not None and len(probes) + len(answering) > 1:
        rows = [[last_token] + list(c[:-1]) for c in continuations]  # no BASE rows to keep them from
        if packable(model, len(prefix.tokens), max(map(len, rows))):
            kept = lower_states(model, prefix, rows, keep_after)
    if kept is not None:
        lower = (keep_after, kept)
    run_rows(layout(probes))
    if answering and (plan.screen is None or plan.screen(run_so_far())):
        run_rows(layout(answering))
    return run_so_far()


def _rows_of(by_variant: dict[int, torch.Tensor], n_var: int) -> torch.Tensor:
    """[V, d] states of the variants run so far; NaN rows for those not run."""
    some = next(iter(by_variant.values()))
    return torch.stack([by_variant.get(v, torch.full_like(some, float("nan"))) for v in range(n_var)])



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


def _packing(model: torch.nn.Module, prefix: Prefix, rows: list[list[int]]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Token ids, position ids and attention mask of ``rows`` packed into one sequence after ``prefix``."""
    device, dtype = devices.input_device(model), model.dtype
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


def _forward_packed(model: torch.nn.Module, prefix: Prefix, rows: list[list[int]], variant_ids: torch.Tensor,
                    apply: ApplyEdits, capture: Sequence[int], start: tuple[int, torch.Tensor] | None = None,
                    keep_after: int | None = None) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], list[torch.Tensor] | None]:
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


def _forward_batched(model: torch.nn.Module, prefix: Prefix, rows: list[list[int]], variant_ids: torch.Tensor,
                     apply: ApplyEdits, capture: Sequence[int]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    device = devices.input_device(model)
    width = max(map(len, rows))
    # Right padding needs no mask: pads come after every scored position.
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=device)
    at_p_star = torch.zeros(len(rows), dtype=torch.long, device=device)
    cache = broadcast_cache(prefix.cache, len(rows))
    with apply(variant_ids, at_p_star), site.capture_site(model, capture, at_p_star) as seen:
        logits = model(input_ids=ids, **with_cache(model, cache), use_cache=cache is not None).logits
    return [logits[j, : len(r)] for j, r in enumerate(rows)], dict(seen)
