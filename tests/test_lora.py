"""The LoRA baseline (baselines/lora.py, baselines/lora_hooks.py): it learns on a tiny random Llama
(its validation loss falls) and leaves the frozen model as it was; its bundle round-trips; its
hooks compute what peft's own PeftModel computes with the same A and B; BASE rows stay untouched
beside edited ones; batched scoring equals one question at a time; generation carries the adapter
on every generated token."""

import copy

import pytest
import torch
from lm_eval.api.instance import Instance

from baselines import lora
from baselines.lora_hooks import token_variants
from mari_eval.evaluation import runner
from mari_eval.evaluation.lm import MariLM
from mari_eval.injection.plan import BASE
from mari_eval.evaluation.prefix_cache import PackedPrompts, encode_prefix
from mari_eval.evaluation.row_passes import forward_rows
from mari_eval.training.train import Example

from .helpers import truthfulqa_requests
from .tiny import attribute_of, byte_llama, byte_tokenizer, reloaded, tiny_config, tiny_model, tiny_session


def learnable_examples(n=15, seed=1):
    """Multiple-choice examples whose gold option is always the same two tokens: learnable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        options = [torch.randint(10, 97, (2,), generator=g).tolist() for _ in range(2)]
        gold = i % 3
        options.insert(gold, [5, 6])
        out.append(Example(f"ex{i}", torch.randint(1, 97, (6,), generator=g).tolist(), options, gold))
    return out


def random_bundle(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj"), layers=None, seed=0, scale=0.3):
    """A LoRA with random A and B (B non-zero: the edit is not the identity)."""
    g = torch.Generator().manual_seed(seed)
    layers = list(range(model.config.num_hidden_layers)) if layers is None else layers
    tensors = {}
    for target in targets:
        module = getattr(model.model.layers[0].self_attn, target)
        tensors[f"{target}.A"] = torch.randn(len(layers), rank, module.in_features, generator=g) * scale
        tensors[f"{target}.B"] = torch.randn(len(layers), module.out_features, rank, generator=g) * scale
    config = {**tiny_config(model), "site": {"layer": min(layers)},
              "hyperparameters": {"rank": rank, "alpha": alpha, "targets": list(targets), "layers": layers}}
    return lora.LoRA(config, tensors)


def peft_model(model, bundle):
    """peft's own PeftModel over a copy of ``model``, holding ``bundle``'s A and B."""
    from peft import LoraConfig, get_peft_model

    hp = bundle.config["hyperparameters"]
    config = LoraConfig(r=hp["rank"], lora_alpha=hp["alpha"], target_modules=hp["targets"], lora_dropout=0.0,
                        layers_to_transform=hp["layers"])
    peft = get_peft_model(copy.deepcopy(model), config).eval()
    for j, layer in enumerate(hp["layers"]):
        for target in hp["targets"]:
            module = getattr(peft.base_model.model.model.layers[layer].self_attn, target)
            module.lora_A["default"].weight.data.copy_(bundle.tensors[f"{target}.A"][j])
            module.lora_B["default"].weight.data.copy_(bundle.tensors[f"{target}.B"][j])
    return peft


def by_hand(model, context, option):
    """Sum of log p(option tokens | context) from one forward pass of ``model``."""
    ids = torch.tensor([context + option])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return float(sum(logprobs[len(context) - 1 + k, t] for k, t in enumerate(option)))


def score(model, bundle, context, options):
    """The runner's scores of ``options`` under the bundle's plan, its prompt encoded under the adapter."""
    plan = bundle.plan(model)
    with torch.no_grad():
        prefix = encode_prefix(model, context[:-1], apply=plan.apply, sites=plan.prompt_sites(len(context)))
        return runner.score_variants(model, prefix, context[-1], options, plan).logprobs[0]


def test_training_lowers_the_validation_loss_and_restores_the_model():
    model = tiny_model("llama").requires_grad_(False)  # frozen, as MariLM loads it
    state = {k: v.clone() for k, v in model.state_dict().items()}
    types = [(name, type(m)) for name, m in model.named_modules()]
    session = tiny_session(model)
    examples = learnable_examples()
    bundle = lora.LoRA.fit(session, attribute_of(examples), tiny_config(model), {"epochs": 3, "lr": 1e-2, "batch": 4}, 0)
    diagnostics, hp = bundle.config["diagnostics"], bundle.config["hyperparameters"]
    losses = [epoch["validation_loss"] for epoch in diagnostics["history"]]
    assert len(losses) == 3 and losses[-1] < losses[0] < diagnostics["validation_loss_base"]
    assert diagnostics["validation_loss_selected"] == min(losses) and hp["epoch_kept"] == 3
    assert hp["layers"] == [0, 1, 2, 3] and hp["targets"] == ["q_proj", "v_proj"] and hp["rank"] == 8
    assert all(t.dtype == torch.float32 for t in bundle.tensors.values())
    assert float(bundle.tensors["v_proj.B"].abs().sum()) > 0  # B moved from its zero start
    # the frozen model as it was: the same weights, the same module types, no hook left behind
    assert [(name, type(m)) for name, m in model.named_modules()] == types
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and state.keys() == model.state_dict().keys()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p.requires_grad or p.grad is not None for p in model.parameters())


def test_bundle_round_trips(tmp_path):
    model = tiny_model("llama")
    bundle = random_bundle(model)
    loaded = reloaded(bundle, tmp_path / "lora")
    assert loaded.config["hyperparameters"] == bundle.config["hyperparameters"]
    assert all(torch.equal(loaded.tensors[k], bundle.tensors[k]) for k in bundle.tensors)
    context, options = [3, 14, 15, 92, 65, 35], [[8, 9], [79, 3, 2]]
    assert torch.equal(score(model, loaded, context, options), score(model, bundle, context, options))
    with pytest.raises(lora.BundleError, match="v_proj.B"):  # shapes are checked against the config (rank 4)
        lora.LoRA(bundle.config, {**bundle.tensors, "v_proj.B": bundle.tensors["v_proj.B"][..., :3]})
    other = lora.LoRA(bundle.config, {**bundle.tensors, "v_proj.B": bundle.tensors["v_proj.B"][:, :3]})
    with pytest.raises(lora.BundleError, match="v_proj of layer 0 is 3 x 32"):  # and against the model's modules
        other.check_compatible(model, "tiny")


@pytest.mark.parametrize("layers", [None, [1, 3]])
def test_hooks_equal_peft(layers):
    model = tiny_model("llama")
    bundle = random_bundle(model, layers=layers)
    reference = peft_model(model, bundle)
    context, options = [3, 14, 15, 92, 65, 35, 89, 79], [[32, 38], [46, 26, 43], [7]]
    got = score(model, bundle, context, options)
    expected = [by_hand(reference, context, option) for option in options]
    untouched = [by_hand(model, context, option) for option in options]
    assert max(abs(float(a) - b) for a, b in zip(got, expected)) <= 1e-4
    assert max(abs(float(a) - b) for a, b in zip(got, untouched)) > 1e-2  # the adapter changed the scores


def test_tokens_take_their_rows_variant():
    # a packed sequence of three rows starting at columns 0, 3 and 5
    variants = token_variants(1, 7, torch.tensor([0, BASE, 2]), (torch.zeros(3, dtype=torch.long), torch.tensor([0, 3, 5])),
                              torch.device("cpu"))
    assert variants.tolist() == [[0, 0, 0, BASE, BASE, 2, 2]]
    padded = token_variants(2, 3, torch.tensor([BASE, 0]), torch.zeros(2, dtype=torch.long), torch.device("cpu"))
    assert padded.tolist() == [[BASE] * 3, [0] * 3]


def test_base_rows_stay_untouched_in_a_mixed_batch():
    model = tiny_model("llama")
    bundle = random_bundle(model)
    plan = bundle.plan(model)
    context = [3, 14, 15, 92, 65, 35]
    with torch.no_grad():
        prefix = encode_prefix(model, context[:-1], apply=plan.apply, sites=plan.prompt_sites(len(context)))
        prompts = PackedPrompts.of(prefix)
        rows = [[35, 8, 9], [35, 79], [35, 3, 2, 1], [35]]
        mixed = torch.tensor([0, BASE, 0, BASE])

        def logits(variant_ids):
            return forward_rows(model, prompts, [0] * 4, rows, variant_ids, plan.apply)[0]

        together = logits(mixed)
        edited, untouched = logits(torch.zeros(4, dtype=torch.long)), logits(torch.full((4,), BASE))
    for j, v in enumerate(mixed.tolist()):
        alone = untouched[j] if v == BASE else edited[j]
        assert torch.allclose(together[j], alone, atol=1e-5), j
    assert not torch.allclose(edited[1], untouched[1], atol=1e-3)  # the rows differ under the edit


@pytest.fixture(scope="module")
def byte_setup(tmp_path_factory):
    tokenizer = byte_tokenizer()
    model = byte_llama(tokenizer, layers=4, hidden=64)
    bundle = random_bundle(model, scale=0.1)  # mild: a prefill-only adapter would decode other tokens
    return tokenizer, model, bundle, str(bundle.save(tmp_path_factory.mktemp("bundles") / "lora"))


def test_batched_scoring_equals_one_question_at_a_time(byte_setup):
    tokenizer, model, _, path = byte_setup
    lms = [MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=path,
                  allow_other_model=True, batch_size=size) for size in (1, 4)]
    alone, batched = (lm.loglikelihood(truthfulqa_requests()) for lm in lms)
    assert max(abs(a - b) for (a, _), (b, _) in zip(alone, batched)) <= 1e-4
    vanilla = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32").loglikelihood(truthfulqa_requests())
    assert max(abs(a - b) for (a, _), (b, _) in zip(alone, vanilla)) > 1e-2


def test_generation_carries_the_adapter_on_every_token(byte_setup):
    tokenizer, model, bundle, path = byte_setup
    lm = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=path, allow_other_model=True)
    ids = tokenizer("Q: What do bees make?\nA:", return_tensors="pt").input_ids
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    with torch.no_grad():  # MariLM's generation path (HFLM's generate_until calls it on each batch)
        got = lm._model_generate(ids, ids.shape[1] + 12, ["\u2603"], **kwargs)[0, ids.shape[1]:]
        expected = peft_model(model, bundle).generate(input_ids=ids, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id,
                                                      **kwargs)[0, ids.shape[1]:]
        vanilla = model.generate(input_ids=ids, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, **kwargs)[0, ids.shape[1]:]
    n = min(len(got), len(expected))
    assert n >= 4 and got[:n].tolist() == expected[:n].tolist()
    assert vanilla[:n].tolist() != expected[:n].tolist()
    # and through lm-eval's request path
    request = Instance("generate_until", {}, ("Q: What do bees make?\nA:", {"until": ["\u2603"], "max_gen_toks": 12,
                                                                              "do_sample": False}), 0)
    assert lm.generate_until([request]) == [tokenizer.decode(got).split("<eos>")[0]]
