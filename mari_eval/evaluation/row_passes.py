"""One pass of option rows through the model over their prompts' cache (``forward_rows``): the
rows packed into one sequence whose attention mask lets each see its prompt and its own earlier
tokens only (``prefix_cache.packed_inputs``, as tree attention in speculative decoding), or a
padded batch over a broadcast cache where a sliding window forbids packing (``packable``); and the
frozen model's states after a layer of every row (``lower_states``), from which edited rows start.
``mari_eval.evaluation.runner`` lays out which rows run under which variant; training reads the states.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from mari_eval.injection import devices, layer_spans, site
from mari_eval.injection.plan import BASE, ApplyEdits, no_edit
from mari_eval.evaluation.prefix_cache import PackedPrompts, Prefix, broadcast_cache, packed_inputs, with_cache


def forward_rows(
    model: torch.nn.Module,
    prompts: PackedPrompts,
    row_prompt: list[int],
    rows: list[list[int]],
    variant_ids: torch.Tensor,
    apply: ApplyEdits,
    capture: Sequence[int] = (),
    start: tuple[int, torch.Tensor] | None = None,
    keep: Sequence[int] = (),
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], dict[int, list[torch.Tensor]]]:
    """Logits of every row (row j after prompt ``row_prompt[j]`` of ``prompts``), hidden states at
    each row's first token, and, per layer of ``keep`` (packed path only, else none), every row's
    states after that layer.

    ``start = (layer, states [sum of row lengths, d])`` runs only the layers above
    ``layer`` (packed path of supported families; otherwise everything is recomputed).

    The rows are packed into one sequence whose attention mask lets each row see its prompt
    and its own earlier tokens only (as tree attention does in speculative decoding), so the
    prompts' cache is read once instead of being copied per row. Models with sliding-window
    layers whose window the rows would cross fall back to a padded batch over a broadcast
    cache (one prompt only). Both give the same numbers as running every row alone.
    """
    if bool((variant_ids == BASE).all()):  # nothing to edit: no hook at all, as in a vanilla run
        apply = no_edit
    if packable(model, max(map(prompts.length, set(row_prompt))), max(map(len, rows))):
        return _forward_packed(model, prompts, row_prompt, rows, variant_ids, apply, capture, start, keep)
    if prompts.own_width:
        raise ValueError("rows after several prompts run packed only (row_passes.packable)")
    return (*_forward_batched(model, prompts.cache, rows, variant_ids, apply, capture), {})


def packable(model: torch.nn.Module, prefix_len: int, longest_row: int) -> bool:
    config = model.config.get_text_config()
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    window = getattr(config, "sliding_window", None)
    sliding = any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or []))
    return not (sliding and window) or prefix_len + longest_row <= window


def _packing(model: torch.nn.Module, prompts: PackedPrompts, row_prompt: list[int],
             rows: list[list[int]]) -> tuple[dict, torch.Tensor]:
    """Token ids, position ids and attention mask of ``rows`` packed into one sequence after their
    prompts, and each row's lengths."""
    inputs = packed_inputs(model, prompts.shared, rows, [prompts.spans[q] for q in row_prompt],
                           [prompts.length(q) for q in row_prompt], width=prompts.own_width)
    return inputs, torch.tensor([len(r) for r in rows], device=inputs["input_ids"].device)


def _all_positions(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of every token of a packed sequence."""
    length = inputs["input_ids"].shape[1]
    cols = torch.arange(length, device=inputs["input_ids"].device)
    return torch.zeros_like(cols), cols


def lower_states(model: torch.nn.Module, prefix: Prefix, rows: list[list[int]], layer: int) -> list[torch.Tensor]:
    """The frozen model's states after ``layer`` for every token of every row (one [len, d] per row)."""
    return packed_lower_states(model, PackedPrompts.of(prefix), [0] * len(rows), rows, layer)


def packed_lower_states(model: torch.nn.Module, prompts: PackedPrompts, row_prompt: list[int], rows: list[list[int]],
                         layer: int) -> list[torch.Tensor]:
    """``lower_states`` of rows after several prompts: row j after prompt ``row_prompt[j]`` of ``prompts``."""
    inputs, lengths = _packing(model, prompts, row_prompt, rows)
    cache = broadcast_cache(prompts.cache, 1)
    states = layer_spans.states_after(model, layer, _all_positions(inputs), **with_cache(model, cache),
                               use_cache=cache is not None, **inputs)
    return list(torch.split(states, lengths.tolist()))


def _forward_packed(model: torch.nn.Module, prompts: PackedPrompts, row_prompt: list[int], rows: list[list[int]],
                    variant_ids: torch.Tensor, apply: ApplyEdits, capture: Sequence[int],
                    start: tuple[int, torch.Tensor] | None = None,
                    keep: Sequence[int] = ()) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], dict[int, list[torch.Tensor]]]:
    inputs, lengths = _packing(model, prompts, row_prompt, rows)
    starts = torch.cumsum(lengths, 0) - lengths
    sites = (torch.zeros_like(starts), starts)
    everywhere = _all_positions(inputs)
    cache = broadcast_cache(prompts.cache, 1)
    skip = contextlib.nullcontext()
    if start is not None and layer_spans.can_start_after(model):
        skip = layer_spans.start_after(model, start[0], start[1][None])
    with skip, apply(variant_ids, sites), site.capture_site(model, capture, sites) as seen, \
            site.capture_site(model, keep, everywhere) as below:
        logits = model(**with_cache(model, cache), use_cache=cache is not None, **inputs).logits[0]
    # torch.split: one backward node for all rows (a slice per row each built a zero gradient the size of the
    # whole packed logits, [tokens, vocabulary], and summed them: most of a training step's time).
    split = lambda x: list(torch.split(x, lengths.tolist()))
    return split(logits), dict(seen), {layer: split(states) for layer, states in below.items()}


def _forward_batched(model: torch.nn.Module, prefix_cache, rows: list[list[int]], variant_ids: torch.Tensor,
                     apply: ApplyEdits, capture: Sequence[int]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    device = devices.input_device(model)
    width = max(map(len, rows))
    # Right padding needs no mask: pads come after every scored position.
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=device)
    at_p_star = torch.zeros(len(rows), dtype=torch.long, device=device)
    cache = broadcast_cache(prefix_cache, len(rows))
    with apply(variant_ids, at_p_star), site.capture_site(model, capture, at_p_star) as seen:
        logits = model(input_ids=ids, **with_cache(model, cache), use_cache=cache is not None).logits
    return [logits[j, : len(r)] for j, r in enumerate(rows)], dict(seen)
