"""Tiny random models of every supported family (fast, no download)."""

import torch
import transformers

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
