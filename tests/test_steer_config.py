"""lm-eval's ``--model steered`` configs imported as bundles (mari_eval/vectors/steer_config.py, issue 57.3):
scored through MariLM, the log-likelihoods equal lm-eval's own steered model's on the same file."""

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.hf_steered import SteeredModel

from mari_eval import cli
from mari_eval.vectors import steer_config
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.evaluation.lm import MariLM

from .test_batching import model, tokenizer  # noqa: F401 (its byte Llama's fixtures)

REQUESTS = [("The sea is", " blue."), ("Fish live in", " water."), ("Two and two make", " four.")]


def _config(hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"layers.1": {"steering_vector": torch.randn(hidden, generator=g), "steering_coefficient": 2.0,
                         "action": "add", "bias": None, "head_index": None},
            "layers.2": {"steering_vector": torch.randn(hidden, generator=g), "steering_coefficient": -1.5,
                         "action": "clamp", "bias": torch.randn(hidden, generator=g) * 0.1, "head_index": None}}


def _loglikelihoods(lm) -> list[float]:
    return [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)])]


def test_an_imported_config_scores_as_lm_evals_steered_model(model, tokenizer, tmp_path):
    path = tmp_path / "steer.pt"
    torch.save(_config(model.config.hidden_size), path)
    theirs = _loglikelihoods(SteeredModel(pretrained=model, tokenizer=tokenizer, steer_path=str(path), device="cpu",
                                          dtype="float32"))
    bundle = steer_config.import_steer_file(path, model, tmp_path / "bundle")
    ours = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=str(bundle),
                  allow_other_model=True)
    plain = _loglikelihoods(MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32"))
    assert _loglikelihoods(ours) == pytest.approx(theirs, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(theirs, plain)) > 1e-2  # the config does steer
    assert ours.intervention.summarize([])["hookpoints"][1] == {"layer": 2, "action": "clamp", "coefficient": -1.5}


def test_scale_multiplies_every_coefficient(model, tokenizer, tmp_path):
    config = _config(model.config.hidden_size)
    torch.save(config, tmp_path / "one.pt")
    doubled = {k: {**v, "steering_coefficient": 2 * v["steering_coefficient"]} for k, v in config.items()}
    torch.save(doubled, tmp_path / "two.pt")
    one = steer_config.import_steer_file(tmp_path / "one.pt", model, tmp_path / "b1")
    two = steer_config.import_steer_file(tmp_path / "two.pt", model, tmp_path / "b2")
    scaled = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=str(one), scale=2,
                    allow_other_model=True)
    direct = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=str(two),
                    allow_other_model=True)
    assert _loglikelihoods(scaled) == pytest.approx(_loglikelihoods(direct), abs=1e-5)


@pytest.mark.parametrize("change, match", [
    ({"layers.1": {"head_index": 3}}, "head_index 3: lm-eval edits acts"),
    ({"layers.1": {"action": "scale"}}, "action 'scale' is neither add nor clamp"),
    ({"layers.1": {"bias": "zeros"}}, "must be tensors"),
    ({"layers.1": {"steering_coefficient": float("nan")}}, "non-finite"),
    ({"layers.9": {}}, "decoder layers 0..3"),
    ({"layers.1.mlp": {}}, "only a decoder layer's output"),
])
def test_what_a_bundle_cannot_hold_is_refused_with_the_reason(model, tmp_path, change, match):
    config = _config(model.config.hidden_size)
    for hookpoint, fields in change.items():
        config[hookpoint] = {**config.get(hookpoint, config["layers.1"]), **fields}
    torch.save(config, tmp_path / "bad.pt")
    with pytest.raises(BundleError, match=match):
        steer_config.import_steer_file(tmp_path / "bad.pt", model, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_a_file_with_pickled_code_is_refused_unread(tmp_path, model):
    class Payload:  # what weights_only=False would construct (and run) while reading
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"layers.1": {"steering_vector": Payload(), "action": "add"}}, tmp_path / "evil.pt")
    with pytest.raises(BundleError, match="weights_only=True"):
        steer_config.import_steer_file(tmp_path / "evil.pt", model, tmp_path / "bundle")


def test_the_command_imports_a_pt_file(tmp_path, capsys):
    torch.save(_config(576), tmp_path / "steer.pt")  # SmolLM2-135M's hidden size; its config alone is read
    assert cli.main(["import-vector", str(tmp_path / "steer.pt"), "--model", "smollm2-135m-instruct",
                     "--out", str(tmp_path / "b")]) == 0
    assert "bundle:" in capsys.readouterr().out and (tmp_path / "b" / "weights.safetensors").is_file()
    assert cli.main(["import-vector", str(tmp_path / "steer.pt"), "--model", "smollm2-135m-instruct",
                     "--out", str(tmp_path / "c"), "--scale", "2"]) == 1
    assert "keeps its own steering_coefficient" in capsys.readouterr().err
