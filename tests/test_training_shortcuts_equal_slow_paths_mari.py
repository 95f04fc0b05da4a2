"""MARI's training shares the frozen model's work. Each speed-up is checked against
the slow path it replaced (kept here as a reference): the same numbers to 1e-5."""

import pytest
import torch

from mari_eval.evaluation import row_passes
from mari_eval.injection import layer_spans
from mari_eval.training import train
from mari_eval.training.session import example_batches
from mari_eval.mari.equations import pca_basis

from .tiny import tiny_session
from .tiny import tiny_model


def _reference_hidden_of_prompts(session, prompts):
    """``Session.hidden_of_prompts`` as it was: each whole prompt alone, up to l*."""
    states = []
    for tokens in prompts:
        ids = torch.tensor([tokens])
        states.append(layer_spans.hidden_at_site(session.model, ids, torch.ones_like(ids), session.layer)[0].float())
    return torch.stack(states)


def _prompts(n=12, preamble=10):
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(1, 97, (preamble,), generator=gen).tolist()
    return [shared + torch.randint(1, 97, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3's 6-token window is shorter than the preamble
@pytest.mark.parametrize("max_tokens", [1024, 20])  # one batch, or several
def test_pca_states_over_the_shared_preamble_equal_each_prompt_run_whole(family, max_tokens):
    session = tiny_session(tiny_model(family, sliding_window=6))
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


def _reference_prepare(session, examples):
    """``Session.prepare`` as it was: one example at a time over the shared preamble."""
    from mari_eval.training import memory
    from mari_eval.evaluation.prefix_cache import encode_prefix, own_part

    common, _, _ = memory.token_counts(examples)
    shared = encode_prefix(session.model, common)
    for ex in examples:
        prefix = encode_prefix(session.model, ex.context[:-1], base=shared)
        ex.shared, ex.own = shared, own_part(prefix, shared)
        rows = [[ex.context[-1]] + option[:-1] for option in ex.options]
        ex.lower = row_passes.lower_states(session.model, prefix, rows, session.layer)
        ex.hidden = ex.lower[0][0]


def _examples(preamble, n=7):
    from mari_eval.training.train import Example

    gen = torch.Generator().manual_seed(4)
    draw = lambda k: torch.randint(1, 97, (k,), generator=gen).tolist()
    out = []
    for i in range(n):
        own = draw(int(torch.randint(0, 6, (), generator=gen))) if i else []  # the first: nothing beyond the preamble
        options = [draw(int(torch.randint(1, 5, (), generator=gen))) for _ in range(2 + i % 3)]
        out.append(Example(f"ex{i}", preamble + own + draw(1), options, i % 2))
    return out


@pytest.mark.parametrize("preamble", [[7, 3, 9, 12, 4, 40, 41, 5], []])  # a shared preamble, or none at all
@pytest.mark.parametrize("max_tokens", [1024, 12])  # one packed pass, or several
def test_packed_encoding_keeps_what_one_example_at_a_time_kept(preamble, max_tokens):
    import copy

    from mari_eval.evaluation import runner
    from mari_eval.injection.plan import Plan

    session = tiny_session(tiny_model("llama"))
    session.max_tokens, session.memory_budget = max_tokens, 2**30
    examples = _examples(preamble)
    assert (len(example_batches(examples, len(preamble), max_tokens)) > 1) == (max_tokens < 100)
    reference = copy.deepcopy(examples)
    _reference_prepare(session, reference)
    session.prepare(examples, "packed")
    assert (examples[0].own is None) == (reference[0].own is None)
    plan = Plan.at_site(session.model, session.layer, lambda h, ids: h * (1 + ids[:, None].float()), [runner.BASE, 0, 1])
    for ex, ref in zip(examples, reference):
        cache, expected = session.prefix(ex).cache, session.prefix(ref).cache
        assert (cache is None) == (expected is None)  # None: a one-token prompt has nothing before p*
        for a, b in zip(cache.layers if cache else [], expected.layers if expected else []):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
        assert len(ex.lower) == len(ref.lower)
        for a, b in zip(ex.lower, ref.lower):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ex.hidden, ref.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(session.score(ex, plan).logprobs, session.score(ref, plan).logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eos", [None, 7])  # with an end-of-sequence token, rows may stop inside the window
def test_generation_routing_over_a_prompt_computed_once_equals_each_variant_run_whole(eos):
    from mari_eval.evaluation import generation
    from mari_eval.mari import fit as mari_fit
    from mari_eval.mari.equations import lowrank_delta
    from mari_eval.injection.plan import Plan

    model = tiny_model("llama")
    model.generation_config.eos_token_id = eos
    gen = torch.Generator().manual_seed(6)
    U, V, b = torch.randn(3, 32, 2, generator=gen), torch.randn(3, 32, 2, generator=gen), torch.randn(3, 2, generator=gen)
    edit = lambda h, ids: h + 3 * lowrank_delta(h, U[ids], V[ids], b[ids])
    plan = Plan.at_site(model, 1, edit, [0, 1, 2])
    for prompt in ([5, 9, 33, 2, 71, 12], [40]):
        expected = generation.routing_entropy(model, prompt, plan, window=4)  # each variant's prompt run whole
        got = mari_fit.routing_entropies(model, prompt, plan, window=4)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert len(set(got.tolist())) > 1  # the experts route differently


def test_training_runs_with_subnormals_flushed_and_turns_it_off_after(tmp_path, monkeypatch):
    from mari_eval.injection import devices

    subnormal = torch.tensor([1e-39])  # below float32's smallest normal number, 1.18e-38
    with devices.subnormals_flushed() as supported:
        flushed = float(subnormal * 1.0)
    if not supported:
        pytest.skip("this CPU cannot flush subnormals")
    assert flushed == 0.0 and float(subnormal * 1.0) > 0.0

    class Loaded(Exception):
        pass

    seen = []

    def session(*args, **kwargs):  # where training loads the model: stop there, noting the arithmetic in force
        seen.append(float(subnormal * 1.0))
        raise Loaded

    monkeypatch.setattr(train, "Session", session)
    with pytest.raises(Loaded):
        train.train("caa", "truthfulqa", "smollm2-135m-instruct", 0, tmp_path / "bundle")
    assert seen == [0.0] and float(subnormal * 1.0) > 0.0
