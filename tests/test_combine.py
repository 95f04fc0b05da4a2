"""``mari-eval combine`` (mari_eval/vectors/combine.py, issue 57.3): the weighted sum of a GGUF control vector
and a CAA bundle is one control-vector bundle that adds exactly that sum after each layer."""

import pytest
import torch

from mari_eval import cli, methods
from mari_eval.vectors import combine
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.vectors.control_vector_files import write_gguf

from .tiny import tiny_caa, tiny_model


@pytest.fixture
def model(tmp_path):
    m = tiny_model("llama")
    m.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_a_gguf_and_a_caa_bundle_sum_with_their_weights(tmp_path, model):
    g = torch.Generator().manual_seed(1)
    vector = {1: torch.randn(32, generator=g), 2: torch.randn(32, generator=g)}
    write_gguf(tmp_path / "happy.gguf", vector, "llama")
    bundle = tiny_caa(layer=2, multiplier=3.0)
    bundle.config["base_model"]["name"] = model
    caa_dir = bundle.save(tmp_path / "caa")
    out = combine.combine([f"{tmp_path / 'happy.gguf'}:2", f"{caa_dir}:-0.5"], tmp_path / "sum")
    combined = methods.load_bundle(out)
    added = combined.added_directions()
    assert sorted(added) == [1, 2]
    assert torch.allclose(added[1], 2 * vector[1])
    assert torch.allclose(added[2], 2 * vector[2] - 0.5 * 3.0 * bundle.tensors["vector"], atol=1e-6)
    assert combined.config["source"]["format"] == "combined"
    assert combined.config["source"]["file"] == "2 x happy.gguf + -0.5 x caa"
    assert combined.config["base_model"]["name"] == model  # the bundle term's model


def test_terms_parse_with_an_optional_weight():
    assert combine.parse_term("a.gguf:-0.5") == ("a.gguf", -0.5)
    assert combine.parse_term("bundles/caa") == ("bundles/caa", 1.0)
    assert combine.parse_term("C:/dir") == ("C:/dir", 1.0)  # not a number after the colon: part of the path
    with pytest.raises(ValueError, match="not a finite number"):
        combine.parse_term("a.gguf:nan")


def test_what_cannot_be_combined_is_refused(tmp_path, model):
    write_gguf(tmp_path / "a.gguf", {1: torch.ones(32)}, "llama")
    write_gguf(tmp_path / "b.gguf", {1: torch.ones(16)}, "llama")
    write_gguf(tmp_path / "q.gguf", {1: torch.ones(32)}, "qwen2")
    with pytest.raises(ValueError, match="every term is a .gguf file: give the model"):
        combine.combine([str(tmp_path / "a.gguf")], tmp_path / "o1")
    with pytest.raises(BundleError, match="the terms were made for different models"):
        combine.combine([str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")], tmp_path / "o2", model)
    with pytest.raises(BundleError, match="different families"):
        combine.combine([str(tmp_path / "a.gguf"), str(tmp_path / "q.gguf")], tmp_path / "o3", model)
    with pytest.raises(FileNotFoundError, match="neither a .gguf control vector nor a bundle directory"):
        combine.combine([str(tmp_path / "none")], tmp_path / "o4", model)


def test_the_command_writes_the_bundle(tmp_path, model, capsys):
    write_gguf(tmp_path / "a.gguf", {1: torch.ones(32)}, "llama")
    assert cli.main(["combine", f"{tmp_path / 'a.gguf'}:0.5", "--model", model, "--out", str(tmp_path / "c")]) == 0
    assert "bundle:" in capsys.readouterr().out
    assert torch.allclose(methods.load_bundle(tmp_path / "c").added_directions()[1], torch.full((32,), 0.5))
    assert cli.main(["combine", str(tmp_path / "a.gguf"), "--model", model, "--out", str(tmp_path / "c")]) == 1
    assert "pass --force" in capsys.readouterr().err
