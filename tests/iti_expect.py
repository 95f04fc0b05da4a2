"""ITI's edit computed by another path than ``baselines.iti``: the per-layer shift of an ITI or
NL-ITI bundle built head by head, and forward pre-hooks adding it to the heads' outputs (the
attention output projection's input) themselves. Shared by tests/test_baselines.py and
tests/test_recipe_iti.py."""

import contextlib

import torch

from mari_eval.injection import site


def head_shift(model, bundle, alpha: float) -> dict[int, torch.Tensor]:
    """{layer: [heads * head_dim]}: alpha * sigma * theta added into each chosen head's slice."""
    n_heads, head_dim = site.attention_heads(model)
    shift = {}
    for (layer, head), theta, sigma in zip(bundle.tensors["heads"].tolist(), bundle.tensors["directions"], bundle.tensors["sigma"]):
        shift.setdefault(layer, torch.zeros(n_heads * head_dim))[head * head_dim : (head + 1) * head_dim] += alpha * sigma * theta
    return shift


@contextlib.contextmanager
def heads_shifted(model, shift: dict[int, torch.Tensor], first: int):
    """Within the block, every layer of ``shift`` adds its shift to the heads' outputs at
    positions ``first`` and later (one sequence, the whole of it run at once)."""

    def on_heads(layer):
        def pre_hook(module, args):
            heads = args[0].clone()
            heads[:, first:] += shift[layer]
            return (heads,)
        return pre_hook

    handles = [site.attention_output(model, layer).register_forward_pre_hook(on_heads(layer)) for layer in shift]
    try:
        yield shift
    finally:
        for handle in handles:
            handle.remove()
