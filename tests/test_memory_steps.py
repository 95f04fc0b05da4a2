"""The activations of a training step (``memory.step_estimate``) against what autograd keeps and the
step's measured peak, for every method that backpropagates through the model: MARI (K variants at
l*), published ReFT (edits at every layer, a shared preamble run once per step, packed groups or one
prompt at a time), the adapted ReFT (l* only) and LoRA (every layer, every token)."""

import gc

import pytest
import torch
import transformers

from baselines import lora, loreft, reft, reft_published, reft_step
from mari_eval.training import memory
from mari_eval.training.train import Example

from .tiny import byte_llama, byte_tokenizer, tiny_session

GiB = 2**30
LAYERS, HIDDEN = 4, 64


def _model(family: str, dtype: torch.dtype):
    """A random 6-layer Llama or Qwen2 (GQA, 128 wide) over the byte tokenizer, frozen as MariLM loads it."""
    config = byte_llama(byte_tokenizer(), layers=LAYERS, hidden=HIDDEN).config
    if family == "qwen2":
        config = transformers.Qwen2Config(**{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)


def _session(model, max_tokens: int):
    session = tiny_session(model)
    session.num_layers, session.hidden_size, session.layer, session.max_tokens = LAYERS, HIDDEN, 2, max_tokens
    session.memory_budget = 10 * GiB
    return session


def _examples(n: int, preamble: int = 0, options: int = 4):
    g = torch.Generator().manual_seed(5)
    draw = lambda k: torch.randint(1, 200, (k,), generator=g).tolist()
    shared = draw(preamble)
    return [Example(f"ex{i}", shared + draw(20 + 7 * i), [draw(3 + (i + k) % 5) for k in range(options)], i % options)
            for i in range(n)]


def saved_bytes(forward, exclude) -> int:
    """Bytes autograd keeps for the backward of ``forward()``: the distinct storages its saved-tensor
    hooks see, those of ``exclude`` (weights, trained parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen, alive = {}, []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
            alive.append(t)  # held, so that no later tensor reuses the address
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def peak_bytes(step) -> int:
    """The peak of CPU tensor memory while ``step()`` runs, above its start (the profiler's allocations).
    Earlier graphs are collected first: freed inside the profile, they would count against the peak."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    running = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("family, dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16)])
def test_a_mari_steps_activations_are_the_formula(family, dtype):
    model = _model(family, dtype)
    session = _session(model, max_tokens=40)
    examples = _examples(3, options=4)
    session.prepare(examples, "test")
    U = torch.zeros(3, HIDDEN, requires_grad=True)
    edit = lambda h, ids: h + U[ids].to(h)
    step = session.step_estimate(examples, 3)
    assert step.passes > len(examples)  # max_tokens=40 splits each example's 3 x 4 rows into several passes
    loss = lambda: sum(session.run(ex, [0, 1, 2], edit).logprobs.float().sum() for ex in examples)
    saved = saved_bytes(loss, model.parameters())
    peak = peak_bytes(lambda: loss().backward())
    assert abs(saved - step.saved_bytes) <= 0.02 * saved, (saved, step.saved_bytes)
    assert abs(peak - step.total) <= 0.10 * peak, (peak, step.total)
    assert session.largest_step == step.total


@pytest.mark.parametrize("family, dtype, packed", [("llama", torch.float32, True), ("qwen2", torch.bfloat16, True),
                                                   ("llama", torch.bfloat16, False)])
def test_a_published_reft_steps_peak_is_the_formula(family, dtype, packed):
    """The shared preamble's pass and its keys' gradients through the step, plus one group (or one
    prompt) at a time: before each group's graph was dropped ahead of the next, two were alive (1.4x)."""
    model = _model(family, dtype)
    session = _session(model, max_tokens=60)
    examples = _examples(5, preamble=40, options=3)
    layers, rank = list(range(LAYERS)), 4
    params = loreft.initial_parameters(torch.Generator().manual_seed(1), LAYERS, rank, HIDDEN)
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    sites = lambda length: loreft.pyreft_positions(length, 7, 7)
    shared = reft_step.shared_length(examples, 7, 7)
    assert shared == 40  # the preamble runs once per step

    def gradient():
        R = loreft.continuous_rows(params["free"])
        plan = reft_published.Plan((0,), lambda ids, positions: loreft.edits_at_layers(
            model, layers, lambda i, h: loreft.loreft(h, R[i].to(h), params["W"][i].to(h), params["b"][i].to(h)), positions))
        reft_step.batch_gradient(session, examples, plan, sites, params, shared, packed)

    step = reft_step.step_estimate(session, examples, sites, shared, packed, layers, rank)
    gradient()  # warm: the first call allocates caches of its own
    peak = peak_bytes(gradient)
    assert abs(peak - step.total) <= 0.10 * peak, (peak, step.total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_and_adapted_reft_steps_are_the_formula(dtype):
    """Each prompt encoded under the edit, then its options; the batch's graphs all alive until its backward."""
    model = _model("llama", dtype)
    session = _session(model, max_tokens=40)
    examples = _examples(4, preamble=40, options=4)
    session.prepare(examples, "test")
    shapes = [(len(ex.context), [len(o) for o in ex.options]) for ex in examples]

    hp = dict(lora.DEFAULTS, layers=list(range(LAYERS)))
    weights = lora.initial_weights(model, hp["layers"], hp["targets"], hp["rank"], 0, torch.device("cpu"))
    loss = lambda: torch.stack([lora.task_loss(session, ex, hp, lambda x: weights, 1.0) for ex in examples]).mean()
    step = lora.step_estimate(session, examples, hp)
    saved = saved_bytes(loss, [*model.parameters(), *weights.values()])
    peak = peak_bytes(lambda: loss().backward())
    assert abs(saved - step.saved_bytes) <= 0.03 * saved, ("lora", saved, step.saved_bytes)
    # The formula counts what saved-tensor hooks see; a step run without hooks holds less (0.84-0.90 of
    # it here, the gap in the prompts' passes from scratch, not yet explained): an estimate on the safe side.
    assert 0.80 * step.total <= peak <= 1.10 * step.total, ("lora", peak, step.total)

    hp = dict(reft.DEFAULTS)
    params = {"free": torch.randn(hp["rank"], HIDDEN), "W": torch.randn(hp["rank"], HIDDEN) * 0.1, "b": torch.zeros(hp["rank"])}
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    loss = lambda: torch.stack([reft.task_loss(session, ex, hp, params) for ex in examples]).mean()
    step = memory.step_estimate(model, session.layer, memory.edited_prompt_passes(shapes, session.max_tokens))
    saved = saved_bytes(loss, [*model.parameters(), *params.values()])
    assert abs(saved - step.saved_bytes) <= 0.03 * saved, ("reft adapted", saved, step.saved_bytes)
