"""LoRA applied to a frozen model by forward hooks (``lora_applied``): each target Linear's output
gains ``scaling * B (A x)`` (Hu et al., 2021, eq. 3; peft's ``LoraLayer.forward`` without dropout),
for the tokens of the rows whose variant is not ``BASE``. The model's modules are never replaced
nor wrapped (``mari_eval.injection.site.forward_hook`` installs and removes each hook), so the frozen model
shared by every method stays as loaded; training (``baselines.lora``) and evaluation run the same
hooks.

Which tokens a row holds follows the runner's ``Plan.apply(variant_ids, positions)``
(``mari_eval.injection.plan``): without ``variant_ids`` every token of every pass is edited (a prompt encoded
under the edit, generation's prefill and decode steps); with them, ``positions`` names each row's
first token (its p*): a [R] column per batch row (a padded batch: the row is the batch row), or
``(rows, cols)`` in a packed sequence, where row j holds the tokens from its column up to the next
row's (``mari_eval.evaluation.row_passes``). A token takes the variant of its row, and BASE rows stay untouched
in a batch they share with edited ones.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from mari_eval.injection import site
from mari_eval.injection.plan import BASE, Positions

# weights(x) -> {"<target>.A": [layers, r, in], "<target>.B": [layers, out, r]} for an input x of a target
Weights = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def target_modules(model: nn.Module, layers: Sequence[int], targets: Sequence[str]) -> dict[tuple[str, int], nn.Linear]:
    """{(target, index in ``layers``): the Linear named ``target`` in that decoder layer} (e.g.
    ``self_attn.q_proj`` for ``q_proj``, as peft matches ``target_modules`` by the name's last part)."""
    blocks = site.decoder_layers(model)
    found = {}
    for j, layer in enumerate(layers):
        site.check_layer(model, layer)
        for target in targets:
            named = [m for name, m in blocks[layer].named_modules() if name.rsplit(".", 1)[-1] == target]
            if len(named) != 1 or not isinstance(named[0], nn.Linear):
                raise site.SiteError(f"decoder layer {layer} of {type(model).__name__} has {len(named)} modules named "
                                     f"{target!r}{'' if len(named) != 1 else ', not a Linear'}: LoRA needs exactly one "
                                     "Linear of each target name per layer (hyperparameters.targets)")
            found[target, j] = named[0]
    return found


def token_variants(batch: int, length: int, variant_ids: torch.Tensor, positions: Positions,
                   device: torch.device) -> torch.Tensor:
    """[batch, length] variant of every token: each row's (module docstring). A token before its
    batch row's first listed position takes that position's row; a batch row with none, BASE."""
    ids = variant_ids.to(device)
    if positions is None or not isinstance(positions, tuple):  # one row per batch row
        return ids[:, None].expand(batch, length)
    rows, cols = (p.to(device) for p in positions)
    keys, order = torch.sort(rows * length + cols)
    rows, ids = rows[order], ids[order]
    token = torch.arange(batch * length, device=device)
    token_row = token // length
    at = (torch.searchsorted(keys, token, right=True) - 1).clamp(min=0)  # the last site at or before the token
    first = torch.searchsorted(keys, token_row * length).clamp(max=len(keys) - 1)  # the batch row's first site
    before = rows[at] == token_row
    variants = torch.where(before, ids[at], torch.where(rows[first] == token_row, ids[first], BASE))
    return variants.reshape(batch, length)


@contextlib.contextmanager
def lora_applied(model: nn.Module, layers: Sequence[int], targets: Sequence[str], weights: Weights, scaling: float,
                 variant_ids: torch.Tensor | None = None, positions: Positions = None) -> Iterator[None]:
    """Forward passes inside carry the LoRA update on every target of every layer of ``layers``
    (``weights``: the stacked A and B, in the input's dtype and device or as trained), for the
    tokens of the rows whose variant is not BASE (all tokens without ``variant_ids``)."""
    masks: dict[tuple, torch.Tensor | None] = {}  # (batch, length, device) -> [batch, length, 1] edited tokens

    def edited(output: torch.Tensor) -> torch.Tensor | None:
        if variant_ids is None:
            return None
        key = (*output.shape[:2], output.device)
        if key not in masks:
            variants = token_variants(output.shape[0], output.shape[1], variant_ids, positions, output.device)
            masks[key] = (variants != BASE)[..., None]
        return masks[key]

    def hook_for(target: str, j: int):
        def hook(module, args, output):
            x = args[0]
            w = weights(x)
            A, B = w[f"{target}.A"][j].to(x.device), w[f"{target}.B"][j].to(x.device)
            changed = output + ((x.to(A.dtype) @ A.T) @ B.T * scaling).to(output.dtype)
            mask = edited(output)
            return changed if mask is None else torch.where(mask, changed, output)  # BASE tokens exactly as they were

        return hook

    with contextlib.ExitStack() as stack:
        for (target, j), module in target_modules(model, layers, targets).items():
            stack.enter_context(site.forward_hook(module, hook_for(target, j)))
        yield
