"""repro/figures.py's reading of the frozen model: each option's states and likelihood with the
shared few-shot preamble taken from a prefix cache equal those of one full pass per question."""

from __future__ import annotations

import pytest
import torch

from mari_eval.evaluation.prefix_cache import PrefixCache
from repro.figures import option_states

from .tiny import tiny_model


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_option_states_over_the_cached_preamble_equal_the_full_pass(family):
    model = tiny_model(family, sliding_window=64)
    g = torch.Generator().manual_seed(1)
    preamble = torch.randint(3, 90, (48,), generator=g).tolist()  # longer than MIN_SHARED: kept and shared
    prefixes = PrefixCache(model)
    for n in range(3):
        context = preamble + torch.randint(3, 90, (5 + n,), generator=g).tolist()
        options = [torch.randint(3, 90, (length,), generator=g).tolist() for length in (1, 4, 2)]
        alone, shared = option_states(model, 2, context, options), option_states(model, 2, context, options, prefixes)
        assert alone[0] == shared[0]
        torch.testing.assert_close(shared[1], alone[1], atol=1e-5, rtol=1e-4)
    assert prefixes.path and prefixes.path[0].tokens == tuple(preamble)  # the preamble was encoded once and kept
