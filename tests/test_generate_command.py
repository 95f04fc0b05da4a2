"""``mari-eval generate`` as a user types it (issue 83.5): ``hf://org/name`` read from the Hub as ``bundle=hf://``
reads it (here from a Hugging Face cache, offline), and each bad input refused before the model loads
(or, for a prompt past the model's context, before anything is decoded) with a message naming it and the fix."""

from __future__ import annotations

import io
import os
import subprocess

import pytest
import torch

from baselines import caa
from mari_eval import cli
from mari_eval.evaluation import side_by_side

from .test_hub import cache_repo
from .tiny import byte_llama, byte_tokenizer

PROMPT = "Tell me about the sea."


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(a byte Llama saved as a model folder (1024 positions), a CAA bundle for it, a Hugging Face cache holding
    that bundle as the repository org/name)."""
    root = tmp_path_factory.mktemp("generate")
    tokenizer = byte_tokenizer()
    model = byte_llama(tokenizer, layers=4, hidden=64)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    config = {"base_model": {"name": str(root / "model"), "hidden_size": 64, "num_layers": 4}, "site": {"layer": 2},
              "hyperparameters": {"multiplier": 3.0}}
    bundle = caa.CAA(config, {"vector": torch.randn(64, generator=torch.Generator().manual_seed(0))}).save(root / "caa")
    cache_repo(root / "hf-cache", "org/name", bundle)
    return root / "model", bundle, root / "hf-cache"


def _generate(*args: str, cache=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"HF_HUB_CACHE": str(cache)} if cache else {})}
    return subprocess.run(["mari-eval", "generate", *args], capture_output=True, text=True, env=env, timeout=600)


def test_hf_org_name_is_read_from_the_hub_as_bundle_hf_is(made, tmp_path):
    model, bundle, cache = made
    found = _generate("hf://org/name", PROMPT, "--max-new-tokens", "4", cache=cache)
    assert found.returncode == 0, found.stderr
    local = side_by_side.run(str(bundle), PROMPT, settings=side_by_side.GenerationSettings(max_new_tokens=4),
                             out=io.StringIO())
    assert found.stdout.split("\n", 1)[1] == local["steered"] + "\n"  # the same answer as the bundle it holds
    assert f"--- {model} with CAA" in found.stdout
    missing = _generate("hf://org/other", PROMPT, cache=tmp_path)  # an empty cache, offline: the Hub is named
    assert missing.returncode == 1 and "no such local directory" not in missing.stderr
    assert "bundle=hf://org/other: Hub repository org/other is not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE is set" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("flags, status, refusal", [
    (["--set", "foo=bar"], 1, "error: foo=bar: a caa bundle takes no option 'foo'; its options: layers, positions, scale"),
    (["--dtype", "foo"], 2, "argument --dtype: invalid choice: 'foo' (choose from 'auto', 'float32', 'bfloat16', "
                            "'float16')"),
    (["--device", "cuda:x"], 1, "error: --device 'cuda:x': not a device torch knows; give cpu, cuda, cuda:N or mps"),
    pytest.param(["--device", "cuda"], 1, "error: --device cuda: this torch is built without CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available() or torch.version.cuda is not None,
                                          reason="a torch built without CUDA")),
])
def test_bad_options_are_refused_before_the_model_loads(made, tmp_path, flags, status, refusal):
    _, bundle, _ = made
    # --model names no model: the refusal comes before any model is read
    found = _generate(str(bundle), PROMPT, "--model", str(tmp_path / "no-model"), *flags)
    assert found.returncode == status and refusal in found.stderr, found.stderr
    assert "Traceback" not in found.stderr and "no-model" not in found.stderr


def test_a_prompt_past_the_models_context_is_refused_before_anything_is_decoded(made, capsys):
    model, bundle, _ = made
    long = "word " * 1100  # 5,500 byte tokens, past the byte Llama's 1024 positions
    assert cli.main(["generate", str(bundle), long, "--compare"]) == 1
    printed = capsys.readouterr()
    assert printed.out == ""  # not even the first heading
    assert ("the prompt is 5501 tokens as" in printed.err and "--max-new-tokens asks 64 more: 5565, past the 1024 "
            "tokens the model reads; shorten the prompt by 4541 tokens or more" in printed.err)
    shown = io.StringIO()  # one that fits with its answer is decoded as before
    texts = side_by_side.run(str(bundle), "word " * 150, settings=side_by_side.GenerationSettings(max_new_tokens=4),
                             out=shown)
    assert texts["steered"] and shown.getvalue().startswith(f"--- {model} with CAA")
