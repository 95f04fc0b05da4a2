"""Running a span of a model's decoder layers with the site's hooks: up to a layer and no further
(``run_through``, ``states_after``, ``hidden_at_site``), or from a layer whose output was computed
earlier (``start_after``: the layers below do one token's work). Layers are reached and hooks
installed through ``mari_eval.injection.site`` only; no ``forward`` is replaced.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from mari_eval.injection.site import (SiteError, _hidden_of, _with_hidden, capture_site, check_layer, decoder_layers, forward_hook,
                                      last_token_positions)


class _StopForward(Exception):
    pass


def hidden_at_site(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layer: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """h^{(layer)}_{p*} for every row, stopping the forward pass right after ``layer``."""
    if positions is None:
        positions = last_token_positions(attention_mask)
    return states_after(model, layer, positions, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


# Families whose decoder layers return the hidden state as a plain tensor (transformers >= 5).
_TENSOR_LAYER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text")


def can_start_after(model: nn.Module) -> bool:
    return getattr(model.config.get_text_config(), "model_type", None) in _TENSOR_LAYER_TYPES


@contextmanager
def start_after(model: nn.Module, layer: int, hidden: torch.Tensor) -> Iterator[None]:
    """Forward passes inside skip the work of the layers up to ``layer``; ``layer`` outputs ``hidden``.

    ``hidden`` ([B, T, d]) is the frozen model's state after ``layer`` for the same
    tokens, computed earlier. Nothing below ``layer`` may be edited. Everything is done
    with hooks, so accelerate's own hooks (device alignment, offload) stay in place and
    no ``forward`` is replaced:

    * a forward pre-hook on each layer up to ``layer`` shortens its input to the first
      token (the hidden states, the position ids and embeddings, the cache position and
      the attention mask's query rows and key columns), so it computes one token instead
      of T; what it appends to its key/value cache is never read (the caches passed here
      are copies made for one pass);
    * a forward hook on ``layer``, run before any other, replaces its output by ``hidden``,
      so the edits and captures installed on ``layer`` apply to ``hidden``.
    """
    check_layer(model, layer)
    if not can_start_after(model):
        raise SiteError(f"{type(model).__name__}: skipping lower layers is supported for {', '.join(_TENSOR_LAYER_TYPES)}")
    blocks = decoder_layers(model)
    length = hidden.shape[1]

    def first_token_only(module, args, kwargs):
        states, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
        kwargs = {name: _first_query(name, value, length) for name, value in kwargs.items()}
        return (states[:, :1], *rest), kwargs

    def replay(module, args, output):
        return _with_hidden(output, hidden.to(device=_hidden_of(output).device, dtype=_hidden_of(output).dtype))

    handles = [blocks[i].register_forward_pre_hook(first_token_only, with_kwargs=True) for i in range(layer + 1)]
    handles.append(blocks[layer].register_forward_hook(replay, prepend=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _first_query(name: str, value, length: int):
    """A decoder layer's keyword argument cut to the first of ``length`` query tokens."""
    if isinstance(value, tuple):  # position_embeddings: (cos, sin), each [B, T, head_dim]
        return tuple(_first_query(name, v, length) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if name == "attention_mask" and value.dim() == 4:  # [B, 1, T, past + T]: first query row, keys up to it
        return value[:, :, :1, : value.shape[-1] - length + 1]
    if name == "cache_position":
        return value[:1]
    if value.dim() >= 2 and value.shape[1] == length:  # position ids [B, T], cos/sin [B, T, head_dim]
        return value[:, :1]
    return value


def run_through(model: nn.Module, layer: int, **forward_kwargs) -> None:
    """One forward pass of ``model`` stopped right after ``layer`` (for hooks that only read states)."""

    def stop(module, args, output):
        raise _StopForward

    try:
        with forward_hook(decoder_layers(model)[layer], stop):
            model(**forward_kwargs)
    except _StopForward:
        pass


@torch.no_grad()
def states_after(model: nn.Module, layer: int, positions, **forward_kwargs) -> torch.Tensor:
    """Hidden states after ``layer`` at ``positions`` of one forward pass, stopping right after ``layer``."""
    with capture_site(model, [layer], positions) as seen:
        run_through(model, layer, **forward_kwargs)
    return seen[layer]
