"""Tiny things shared by the tests: random models of every supported family (fast, no download), a
training session around one, and small bundles of every method with made-up tensors."""

import torch
import transformers

from baselines import caa
from mari_eval import mari
from mari_eval.evaluation import runner
from mari_eval.injection import site
from mari_eval.storage.checkpoint import EpochCheckpoints
from mari_eval.injection.plan import Plan
from mari_eval.evaluation.prefix_cache import encode_prefix
from mari_eval.training.train import AttributeData, Example, Session

VOCAB = 97


def tiny_model(family: str, sliding_window: int = 16):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
    elif family == "mistral":
        config = transformers.MistralConfig(**common)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=sliding_window)
    elif family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=256)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def reloaded(bundle, directory):
    """Save ``bundle``, load it back, and check it is the same method with the same fingerprint."""
    from mari_eval import methods

    bundle.save(directory)
    loaded = methods.load_bundle(directory)
    assert type(loaded) is type(bundle) and loaded.fingerprint() == bundle.fingerprint()
    return loaded


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte alphabet, no merges) and an end-of-text token: built in
    memory, so tests of the lm-eval class need no embedded model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def byte_llama(tokenizer, layers: int = 8, hidden: int = 256):
    """A random Llama (GQA) over ``tokenizer``'s vocabulary, float32, on the CPU."""
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=1024, eos_token_id=len(tokenizer) - 1,
                                      pad_token_id=len(tokenizer) - 1)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tiny_session(model, checkpoints=None) -> Session:
    # A Session around a tiny random model (Session() itself loads a checkpoint through lm-eval).
    session = Session.__new__(Session)
    session.model, session.layer, session.num_layers, session.hidden_size = model, 1, 4, 32
    session.max_tokens = 1024
    session.checkpoints = checkpoints or EpochCheckpoints(None)
    return session


def tiny_examples(session, n=6):
    g = torch.Generator().manual_seed(1)
    examples = [Example(f"ex{i}", torch.randint(1, 97, (7,), generator=g).tolist(),
                        [torch.randint(1, 97, (2,), generator=g).tolist() for _ in range(3)], i % 3) for i in range(n)]
    session.prepare(examples, "tiny")
    return examples


def chat_free_session(model):
    """A tiny session whose 'tokenizer' maps characters to ids (the runner needs no real one)."""
    session = tiny_session(model)
    session.chat_prompt = lambda user, without_template: without_template
    session.encode_prompt = lambda text: [1 + ord(c) % 96 for c in text]
    return session


def tiny_mari(K=3, d=32, layers=4, layer=1, rank=2, seed=0, energies=None, applicable=None):
    g = torch.Generator().manual_seed(seed)
    hp = {**mari.DEFAULTS, "K": K, "rank": rank}
    n = 20
    tensors = {
        "expert_U": torch.randn(K, d, rank, generator=g), "expert_V": torch.randn(K, d, rank, generator=g) / d,
        "expert_b": torch.randn(K, rank, generator=g),
        "single_U": torch.randn(1, d, rank, generator=g), "single_V": torch.randn(1, d, rank, generator=g) / d,
        "single_b": torch.randn(1, rank, generator=g),
        "probe_U": torch.randn(d, 2, generator=g), "probe_V": torch.randn(d, 2, generator=g) / d,
        "probe_b": torch.randn(2, generator=g), "pca_basis": torch.linalg.qr(torch.randn(d, 16, generator=g)).Q,
        "ctrl_energy": torch.rand(n, generator=g) if energies is None else energies,
        "ctrl_applicable": (torch.arange(n) % 2).to(torch.uint8) if applicable is None else applicable,
        "ctrl_applicable_single": (torch.arange(n) % 3 == 0).to(torch.uint8),
    }
    config = {"base_model": {"name": "tiny", "hidden_size": d, "num_layers": layers}, "site": {"layer": layer},
              "hyperparameters": hp}
    return mari.MARI(config, tensors)


def score_under(model, bundle, context, options, variants=None):
    """Every option of ``context`` under each variant of ``bundle``'s plan (or ``variants``), all of
    them run: the plan without its choice, screen or shared start (None: the untouched model)."""
    full = Plan((runner.BASE,)) if bundle is None else bundle.plan(model)
    plan = Plan(tuple(variants) if variants is not None else full.variants, full.apply, capture=full.capture,
                site_only=full.site_only)
    prefix = encode_prefix(model, context[:-1])
    with torch.no_grad():
        return runner.score_variants(model, prefix, context[-1], options, plan)


def tiny_caa(d=32, layers=4, layer=2, multiplier=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    config = {"base_model": {"name": "tiny", "hidden_size": d, "num_layers": layers}, "site": {"layer": layer},
              "hyperparameters": {"multiplier": multiplier}}
    return caa.CAA(config, {"vector": torch.randn(d, generator=g)})


def tiny_iti(model, heads=((1, 0), (1, 3), (2, 2)), alpha=4.0, cls=None, seed=0):
    from baselines import iti

    g = torch.Generator().manual_seed(seed)
    n_heads, head_dim = site.attention_heads(model)
    theta = torch.randn(len(heads), head_dim, generator=g)
    config = {"base_model": {"name": "tiny", "hidden_size": model.config.hidden_size, "num_layers": site.num_layers(model)},
              "site": {"layer": min(h[0] for h in heads)}, "hyperparameters": {"alpha": alpha}}
    tensors = {"heads": torch.tensor(heads), "directions": theta / theta.norm(dim=-1, keepdim=True),
               "sigma": torch.rand(len(heads), generator=g) + 0.5}
    return (cls or iti.ITI)(config, tensors)


def tiny_reft(d=32, layers=4, layer=2, rank=3, first=2, last=3, seed=0):
    from baselines import reft

    g = torch.Generator().manual_seed(seed)
    config = {"base_model": {"name": "tiny", "hidden_size": d, "num_layers": layers}, "site": {"layer": layer},
              "hyperparameters": {"first": first, "last": last}}
    R = reft.orthonormal_rows(torch.randn(rank, d, generator=g))
    return reft.ReFT(config, {"R": R, "W": torch.randn(rank, d, generator=g), "b": torch.randn(rank, generator=g)})


def char_examples(session, n=10):
    """Multiple-choice examples whose prompts and options use the character tokenizer."""
    out = []
    for i in range(n):
        question, choices = f"Is {i} odd or even, and why {i * 7}?", [f"option {i}-{j} says {j * i}" for j in range(3)]
        out.append(Example(f"ex{i}", session.encode_prompt(f"Q: {question}\nA:"),
                           [session.encode_prompt(" " + c) for c in choices], i % 3, question=question, choices=choices))
    return out


def attribute_of(examples):
    return AttributeData("truthfulqa", None, [], examples, [], [])


def tiny_config(model):
    return {"base_model": {"name": "tiny", "hidden_size": model.config.hidden_size, "num_layers": site.num_layers(model)},
            "site": {"layer": 1, "position": "last prompt token"}}
