"""The injection site: find a transformer's decoder layers, read and edit the residual stream.

This is the only module that knows how to reach a model's layers and how forward hooks
are installed (``mari_eval.injection.layer_spans``, which runs a span of the layers, uses its hooks).
Training, evaluation, the energy gate, the baselines and the diagnostics all go through it.

Conventions
-----------
* ``layer`` is a 0-based decoder-layer index ``l``; "the hidden state after layer l" is
  that layer's output, i.e. ``output_hidden_states[l + 1]`` in transformers' numbering.
  The paper's l* (eq:single_pos_edit) is such an index.
* ``positions`` holds one token index per batch row: the last prompt token p*. With
  right padding (lm-eval scoring) it differs per row; with left padding (generation) it
  is the last column. ``last_token_positions`` derives it from an attention mask.
* An edit replaces ``h[i, positions[i]]`` by ``edit(h[:, positions])`` (eq:single_pos_edit).
  With ``once=True`` only the first forward pass inside the context is edited: under
  ``generate`` that is the prefill, so the edited state enters the KV cache once and
  the decode steps run untouched, as in the paper's single-position edit.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

Edit = Callable[[torch.Tensor], torch.Tensor]  # [B, d] hidden states at p* -> [B, d] replacements

# Attribute paths, from the CausalLM wrapper, of the decoder-layer list of supported families.
_LAYER_PATHS = (
    "model.layers",  # Llama, Mistral, Qwen2, Gemma, Gemma3ForCausalLM, Phi3
    "model.language_model.layers",  # Gemma3ForConditionalGeneration (text tower)
    "transformer.h",  # GPT-2, GPT-J, GPT-Neo, Falcon
    "gpt_neox.layers",  # Pythia / GPT-NeoX
    "model.decoder.layers",  # OPT
)


class EditOverflowError(ArithmeticError):
    """An edit that makes a hidden state so large that its square overflows float32 in the next
    norm layer: the state is normed to 0 and every option scores the same, finite number."""


def check_edit_magnitude(new: torch.Tensor, layer: int) -> None:
    """Refuse an edited state [N, d] whose squares summed over d overflow float32, as the next
    RMSNorm / LayerNorm computes its variance (in float32 even for a bf16 or fp16 model): its
    output would be 0 and the scores uniform, with nothing non-finite to see. One number per edit
    is read back (a synchronisation on a GPU, once per edited layer and forward pass)."""
    if new.numel() == 0:
        return
    largest = float(new.detach().abs().amax())
    limit = (torch.finfo(torch.float32).max / new.shape[-1]) ** 0.5
    if math.isfinite(largest) and largest > limit:  # NaN and inf are left to the non-finite checks (they name the document)
        raise EditOverflowError(
            f"the edit after layer {layer} makes a hidden state of magnitude {largest:.3g}, whose square overflows "
            f"float32 in the next norm layer (above {limit:.3g} for d = {new.shape[-1]}): the model would be normed to "
            "0 and score every option the same. Lower the edit's strength (scale=, the bundle's multiplier or alpha) "
            "or check the bundle's tensors")


class SiteError(ValueError):
    """The site does not exist in this model (unknown architecture or layer out of range)."""


def _find(root: nn.Module, paths: Iterable[str], accept: Callable[[object], bool]):
    """The first attribute path of ``paths`` (dotted) that exists under ``root`` and is accepted."""
    for path in paths:
        obj = root
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None and accept(obj):
            return obj
    return None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = _find(model, _LAYER_PATHS, lambda obj: isinstance(obj, nn.ModuleList) and len(obj) > 0)
    if layers is None:
        raise SiteError(
            f"Cannot find the decoder layers of {type(model).__name__}: looked for {', '.join(_LAYER_PATHS)}. "
            "Add the attribute path of its layer list to mari_eval.injection.site._LAYER_PATHS."
        )
    return layers


# Attribute paths, from a decoder layer, of its attention output projection (the module
# whose input is the concatenation of the heads' outputs).
_ATTENTION_OUTPUT_PATHS = ("self_attn.o_proj", "attn.c_proj", "attention.dense", "self_attn.out_proj", "self_attention.dense")


def attention_output(model: nn.Module, layer: int) -> nn.Module:
    block = decoder_layers(model)[check_layer(model, layer)]
    projection = _find(block, _ATTENTION_OUTPUT_PATHS, lambda obj: isinstance(obj, nn.Module))
    if projection is None:
        raise SiteError(
            f"Cannot find the attention output projection of {type(block).__name__}: looked for "
            f"{', '.join(_ATTENTION_OUTPUT_PATHS)}. Add its path to mari_eval.injection.site._ATTENTION_OUTPUT_PATHS."
        )
    return projection


def attention_heads(model: nn.Module) -> tuple[int, int]:
    """(number of heads, head dimension) of the attention layers."""
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, int(head_dim)


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def kv_heads(model: nn.Module) -> int:
    """H_kv: the heads of keys and values (fewer than the query heads under grouped-query attention)."""
    return int(getattr(model.config.get_text_config(), "num_key_value_heads", None) or attention_heads(model)[0])


def element_bytes(model: nn.Module) -> int:
    """b: bytes per element of the model's dtype (works on meta models)."""
    return torch.empty((), dtype=model.dtype).element_size()


def kv_bytes_per_token(model: nn.Module) -> int:
    """Bytes of keys and values one token adds to the cache of every layer: 2 L H_kv d_h b
    (works on meta models)."""
    return 2 * num_layers(model) * kv_heads(model) * attention_heads(model)[1] * element_bytes(model)


def check_layer(model: nn.Module, layer: int) -> int:
    n = num_layers(model)
    if not isinstance(layer, int) or not 0 <= layer < n:
        raise SiteError(
            f"Layer {layer} is out of range for {type(model).__name__} with {n} decoder layers; "
            f"choose a layer in 0..{n - 1}."
        )
    return layer


def last_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of every row, for left- or right-padded batches."""
    mask = attention_mask.to(torch.long)
    if (mask.sum(-1) == 0).any():
        raise ValueError("A row of the batch has no tokens (empty prompt)")
    idx = torch.arange(mask.shape[-1], device=mask.device)
    return (mask * idx).argmax(-1)


def _hidden_of(output):
    """Decoder layers return a tensor (transformers 5) or a tuple whose first item is it."""
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(output, hidden: torch.Tensor):
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def _site_index(hidden: torch.Tensor, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the edited tokens in a [B, T, d] hidden state.

    ``positions`` is None (the last column of every row), a [B] tensor (one column per
    row), or an explicit ``(rows, cols)`` pair (several sites per row, as in a packed
    sequence holding many suffixes).
    """
    if isinstance(positions, tuple):
        rows, cols = positions
        return rows.to(hidden.device), cols.to(hidden.device)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if positions is None:
        return rows, torch.full_like(rows, hidden.shape[1] - 1)
    if positions.shape[0] != hidden.shape[0]:
        raise ValueError(f"{positions.shape[0]} site positions for a batch of {hidden.shape[0]} rows")
    return rows, positions.to(hidden.device)


@contextmanager
def forward_hook(module: nn.Module, hook) -> Iterator[None]:
    """Install a forward hook for the duration of the block; it is removed on exit and on error."""
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def edit_site(
    model: nn.Module,
    layer: int,
    edit: Edit,
    positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    once: bool = True,
) -> Iterator[dict]:
    """Replace the hidden state after ``layer`` at ``positions`` (default: the last column).

    Yields a small state dict; ``state["calls"]`` counts the forward passes edited.
    """
    check_layer(model, layer)
    state = {"calls": 0}

    def hook(module, args, output):
        if once and state["calls"] > 0:
            return None
        hidden = _hidden_of(output)
        rows, cols = _site_index(hidden, positions)
        new = edit(hidden[rows, cols]).to(hidden.dtype)
        check_edit_magnitude(new, layer)
        state["calls"] += 1
        # Out of place, so that gradients flow to the editor during training.
        return _with_hidden(output, hidden.index_put((rows, cols), new))

    with forward_hook(decoder_layers(model)[layer], hook):
        yield state


@contextmanager
def edit_from_site(
    model: nn.Module,
    layer: int,
    edit: Edit,
    positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Iterator[dict]:
    """Replace the hidden state after ``layer`` at p* and at every later position.

    For steering methods that act on all tokens after the prompt (CAA): in the first
    forward pass the tokens before each row's p* are left alone; every later pass
    (decode steps under ``generate``) is edited entirely. ``edit`` maps [N, d] -> [N, d].
    """
    check_layer(model, layer)
    with _edit_output_from_site(decoder_layers(model)[layer], edit, positions, layer=layer) as state:
        yield state


@contextmanager
def edit_every_position(model: nn.Module, layer: int, edit: Edit) -> Iterator[dict]:
    """Replace the hidden state after ``layer`` at every position of every forward pass: the
    prompt's tokens, the options' and, under ``generate``, the decode steps' (a control vector,
    as llama.cpp applies one). ``edit`` maps [N, d] -> [N, d]."""
    check_layer(model, layer)
    state = {"calls": 0}

    def hook(module, args, output):
        hidden = _hidden_of(output)
        edited = edit(hidden.reshape(-1, hidden.shape[-1])).reshape(hidden.shape).to(hidden.dtype)
        check_edit_magnitude(edited, layer)
        state["calls"] += 1
        return _with_hidden(output, edited)

    with forward_hook(decoder_layers(model)[layer], hook):
        yield state


@contextmanager
def shift_attention_from_site(
    model: nn.Module,
    shifts: dict[int, torch.Tensor],
    positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    at_site: bool = True,
) -> Iterator[dict]:
    """Add ``shifts[layer]`` ([d]) to the output of ``layer``'s attention output projection,
    at p* and every later position (as ``edit_from_site``); with ``at_site=False``, at the
    positions after p* only (the continuation's tokens: ITI's published recipe shifts the
    answer, not the prompt), and in generation from the first generated token on.

    A shift of the attention heads' outputs (the projection's input) by ``s`` is a shift
    of its output by ``W_o s``: this is how ITI moves selected heads.
    """
    with contextlib.ExitStack() as stack:
        states = []
        for layer, shift in shifts.items():
            check_layer(model, layer)
            edit = lambda h, shift=shift: h + shift.to(h)
            states.append(stack.enter_context(_edit_output_from_site(attention_output(model, layer), edit, positions, at_site,
                                                                     layer=layer)))
        yield states[0] if states else {"calls": 0}


@contextmanager
def _edit_output_from_site(module: nn.Module, edit: Edit, positions, at_site: bool = True,
                           layer: int = -1) -> Iterator[dict]:
    state = {"calls": 0}

    def hook(module, args, output):
        hidden = _hidden_of(output)
        batch, length = hidden.shape[:2]
        start = torch.zeros(batch, dtype=torch.long, device=hidden.device)
        rows = cols = None
        if state["calls"] == 0:
            rows, cols = _site_index(hidden, positions)
            start = torch.full_like(start, length).scatter_reduce(0, rows, cols, reduce="amin")
        state["calls"] += 1
        after = torch.arange(length, device=hidden.device)[None, :] >= start[:, None]
        if rows is not None and not at_site:  # each site itself stays (several per row in a packed sequence)
            after = after.index_put((rows, cols), torch.zeros_like(rows, dtype=torch.bool))
        edited = edit(hidden.reshape(batch * length, -1)).reshape(hidden.shape).to(hidden.dtype)
        edited = torch.where(after[..., None], edited, hidden)
        check_edit_magnitude(edited, layer)
        return _with_hidden(output, edited)

    with forward_hook(module, hook):
        yield state


@contextmanager
def capture_site(
    model: nn.Module,
    layers: Iterable[int],
    positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Iterator[dict[int, torch.Tensor]]:
    """Record the hidden state after each of ``layers`` at ``positions`` ([B, d] per layer).

    Hooks run in installation order, so a capture entered inside ``edit_site`` on the
    same layer records the edited state.
    """
    seen: dict[int, torch.Tensor] = {}
    blocks = decoder_layers(model)
    hooks = []
    for layer in layers:
        check_layer(model, layer)

        def hook(module, args, output, layer=layer):
            if layer in seen:  # keep the prefill only
                return None
            hidden = _hidden_of(output)
            seen[layer] = hidden[_site_index(hidden, positions)]
            return None

        hooks.append(blocks[layer].register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def capture_attention_heads(
    model: nn.Module, layers: Iterable[int], positions: tuple[torch.Tensor, torch.Tensor]
) -> Iterator[dict[int, torch.Tensor]]:
    """Record the heads' outputs (the attention output projection's input, [N, heads * head_dim])
    of each of ``layers`` at ``positions`` (rows, cols), in the first forward pass."""
    seen: dict[int, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        for layer in layers:

            def hook(module, args, layer=layer):
                if layer not in seen:
                    heads = args[0]
                    seen[layer] = heads[_site_index(heads, positions)]

            handle = attention_output(model, layer).register_forward_pre_hook(hook)
            stack.callback(handle.remove)
        yield seen
