"""Issue 26.4: MARI's training shares the frozen model's work. Each speed-up is checked against
the slow path it replaced (kept here as a reference): the same numbers to 1e-5."""

import pytest
import torch

from mari_eval import site
from mari_eval.mari_equations import pca_basis

from .test_reliability import _tiny_session
from .tiny import tiny_model


def _reference_hidden_of_prompts(session, prompts):
    """``Session.hidden_of_prompts`` as it was: each whole prompt alone, up to l*."""
    states = []
    for tokens in prompts:
        ids = torch.tensor([tokens])
        states.append(site.hidden_at_site(session.model, ids, torch.ones_like(ids), session.layer)[0].float())
    return torch.stack(states)


def _prompts(n=12, preamble=10):
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(1, 97, (preamble,), generator=gen).tolist()
    return [shared + torch.randint(1, 97, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3's 6-token window is shorter than the preamble
@pytest.mark.parametrize("max_tokens", [1024, 20])  # one batch, or several
def test_pca_states_over_the_shared_preamble_equal_each_prompt_run_whole(family, max_tokens):
    session = _tiny_session(tiny_model(family, sliding_window=6))
    session.max_tokens = max_tokens
    prompts = _prompts()
    expected = _reference_hidden_of_prompts(session, prompts)
    got = session.hidden_of_prompts(prompts)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pca_basis(got, 4).abs(), pca_basis(expected, 4).abs(), atol=1e-4, rtol=0)
    # No shared preamble, one prompt, a prompt that is the others' prefix: still each prompt's own state.
    for odd in ([[5, 6, 7]], [[5, 6], [5, 6, 7, 8], [9]], [prompts[0][:10], prompts[0]]):
        torch.testing.assert_close(session.hidden_of_prompts(odd), _reference_hidden_of_prompts(session, odd),
                                   atol=1e-5, rtol=1e-5)
