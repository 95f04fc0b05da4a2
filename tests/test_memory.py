"""Training memory: the estimate (mari_eval.training.memory), what Session.prepare really holds, and the
over-budget path that recomputes instead of failing."""

import pytest
import torch
import transformers

from mari_eval.evaluation import runner
from mari_eval.training import memory
from mari_eval.injection import site
from mari_eval.injection.plan import Plan
from mari_eval.evaluation.prefix_cache import encode_prefix
from mari_eval.training.train import Example, Session

from .tiny import tiny_session
from .tiny import tiny_model

GiB = 2**30


def _meta(config, dtype=torch.bfloat16):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


# Shapes from the public configs of the paper's smallest and largest models.
LLAMA_2_7B = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32)
QWEN_25_32B = transformers.Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                       num_attention_heads=40, num_key_value_heads=8)


@pytest.mark.parametrize("config, layers, kv_heads, head_dim, hidden", [
    (LLAMA_2_7B, 32, 32, 128, 4096), (QWEN_25_32B, 64, 8, 128, 5120)])
def test_estimate_for_paper_shaped_models_is_the_formula(config, layers, kv_heads, head_dim, hidden):
    model = _meta(config)  # no weights: shapes only
    assert all(p.device.type == "meta" for p in model.parameters())
    own, rows = [40, 55, 31], [12, 9, 20]
    got = memory.estimate(model, shared_tokens=600, own_tokens=own, row_tokens=rows, lower=True)
    c = 2 * layers * kv_heads * head_dim * 2  # keys and values, every layer, bf16
    assert site.kv_bytes_per_token(model) == c
    assert got.shared_bytes == 600 * c and got.cache_bytes == sum(own) * c and got.lower_bytes == sum(rows) * hidden * 2
    assert got.total == 600 * c + sum(own) * c + sum(rows) * hidden * 2
    assert memory.estimate(model, 600, own, rows, lower=False).lower_bytes == 0
    # float32 doubles everything
    assert memory.estimate(_meta(config, torch.float32), 600, own, rows, lower=True).total == 2 * got.total


def test_plan_keeps_what_fits_and_recomputes_the_rest():
    e = memory.Estimate(examples=3, shared_tokens=10, shared_bytes=100, cache_bytes=1000, lower_bytes=50)
    assert (lambda p: (p.keep_caches, p.keep_lower))(memory.plan(e, 2000)) == (True, True)
    assert (lambda p: (p.keep_caches, p.keep_lower))(memory.plan(e, 500)) == (False, True)
    assert (lambda p: (p.keep_caches, p.keep_lower))(memory.plan(e, 10)) == (False, False)
    assert "recomputed" in memory.plan(e, 500).describe("x")


def test_sizes_are_parsed_with_units_or_refused():
    assert memory.parse_size("40GiB") == 40 * GiB and memory.parse_size("500MB") == 500 * 10**6
    assert memory.parse_size("1.5 GiB") == int(1.5 * GiB) and memory.parse_size(123) == 123
    with pytest.raises(ValueError, match="e.g. 40GiB"):
        memory.parse_size("forty")


def _examples(n=5, preamble=12):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 97, (preamble,), generator=g).tolist()
    return [Example(f"ex{i}", shared + torch.randint(1, 97, (4 + i,), generator=g).tolist(),
                    [torch.randint(1, 97, (1 + (i + k) % 3,), generator=g).tolist() for k in range(3)], i % 3)
            for i in range(n)]


def _state_tensors(examples):
    tensors = []
    for ex in examples:
        for prefix in (ex.shared, ex.own):
            for layer in (prefix.cache.layers if prefix is not None and prefix.cache is not None else []):
                tensors += [layer.keys, layer.values]
        tensors += list(ex.lower or [])
    return tensors


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prepared_examples_run_alike_kept_or_recomputed(family):
    """The shared preamble held once + own parts, or everything recomputed, give what a full cache gives."""
    model = tiny_model(family, sliding_window=8)  # Gemma: prompts cross the window (sliding layers, batched path)
    edit = lambda h, ids: h + 0.5 * torch.sin(h) * (ids[:, None] + 1)  # one edit per variant, at l*
    runs = {}
    for budget in (10 * GiB, 0):
        session = tiny_session(model)
        session.memory_budget = budget
        examples = _examples()
        plan = session.prepare(examples, "test")
        assert plan.keep_caches == (budget > 0) and plan.keep_lower == (budget > 0)
        assert all(ex.shared is examples[0].shared for ex in examples)  # one object: the preamble is held once
        with torch.no_grad():
            runs[budget] = [session.run(ex, [runner.BASE, 0, 1], edit).logprobs for ex in examples]
    with torch.no_grad():
        for ex, kept, recomputed in zip(_examples(), runs[10 * GiB], runs[0]):
            full = encode_prefix(model, ex.context[:-1])
            plan = Plan.at_site(model, session.layer, edit, [runner.BASE, 0, 1])
            want = runner.score_variants(model, full, ex.context[-1], ex.options, plan).logprobs
            torch.testing.assert_close(kept, want, atol=1e-5, rtol=0)
            torch.testing.assert_close(recomputed, want, atol=1e-5, rtol=0)


def test_prepare_holds_what_it_estimated():
    session = tiny_session(tiny_model("llama"))
    session.memory_budget = 10 * GiB
    examples = _examples(n=6, preamble=20)
    plan = session.prepare(examples, "test")
    assert plan.estimate.shared_tokens == 20
    assert memory.held_bytes(_state_tensors(examples)) == plan.estimate.total


@pytest.mark.needs_data
def test_prepare_holds_what_it_estimated_on_the_embedded_model():
    from mari_eval.training.train import attribute_data

    session = Session("smollm2-135m-instruct", max_memory="8GiB")
    data = attribute_data(session, "truthfulqa", seed=0, max_train=6, max_ctrl=2, max_pca=4)
    plan = session.prepare(data.train, "D_train")
    assert plan.keep_caches and plan.estimate.shared_tokens > 100  # TruthfulQA's 6-shot preamble, held once
    assert memory.held_bytes(_state_tensors(data.train)) == plan.estimate.total
    # Before this change every example held its own copy of the preamble: 6 copies instead of one.
    assert plan.estimate.total < 6 * plan.estimate.shared_bytes
