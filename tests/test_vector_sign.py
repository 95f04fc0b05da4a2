"""The optional sign check of imported vectors (mari_eval/vectors/vector_sign.py, issue 57.3): a direction whose
sign was reversed (as PCA may return it) comes back flipped, a right one is kept, split pairs are
inconclusive, and a clamp is not touched. The expected directions are the pairs' own hidden-state
differences, read here by hooks on the decoder layers of a random byte Llama."""

import logging
import subprocess

import numpy as np
import pytest
import torch

from mari_eval import cli, methods
from mari_eval.vectors import steer_config
from mari_eval.vectors.vector_sign import SignCheck

from .test_control_vector import write_gguf
from .test_batching import model, tokenizer  # noqa: F401 (its byte Llama's fixtures)

POSITIVE, NEGATIVE = "I love this, what a wonderful day!", "I hate this, what an awful day."
PAIRS = [(POSITIVE, NEGATIVE), ("What a lovely gift!", "What a dreadful gift."), ("She is so kind!", "She is so cruel.")]


def difference(model, tokenizer, pairs=PAIRS) -> dict[int, torch.Tensor]:
    """{layer: the mean over ``pairs`` of its output at the last token for the positive prompt minus that for the
    negative one} (on this byte model, pairs alike in their last byte differ alike: cosines above 0.9)."""
    def states(prompt):
        seen = []
        handles = [layer.register_forward_hook(lambda m, a, out: seen.append(out[0][0, -1] if isinstance(out, tuple)
                                                                              else out[0, -1]))
                   for layer in model.model.layers]
        try:
            with torch.no_grad():
                model(torch.tensor([tokenizer(prompt).input_ids]))
        finally:
            for handle in handles:
                handle.remove()
        return seen

    found = [{i: (p - n).float() for i, (p, n) in enumerate(zip(states(positive), states(negative)))}
             for positive, negative in pairs]
    return {layer: torch.stack([f[layer] for f in found]).mean(0) for layer in found[0]}


def _sign_check_args(pairs=PAIRS) -> list[str]:
    return [arg for pair in pairs for arg in ("--sign-check", *pair)]


def test_a_reversed_direction_comes_back_flipped_and_a_right_one_is_kept(model, tokenizer, tmp_path, capsys):
    right = {layer: 3.0 * d / d.norm() for layer, d in difference(model, tokenizer).items()}
    gguf = write_gguf(tmp_path / "pca.gguf", {1: (-right[1]).numpy(), 3: right[3].numpy()})  # layer 1 reversed
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert cli.main(["import-vector", str(gguf), "--model", str(tmp_path / "model"), "--out", str(tmp_path / "b"),
                     *_sign_check_args()]) == 0
    out = capsys.readouterr().out
    bundle = methods.load_bundle(tmp_path / "b")
    assert torch.equal(bundle.tensors["directions"], torch.stack([right[1], right[3]]))  # the original, exactly
    assert "flipped layers 1" in out and "0 of 3 pairs positive): flipped" in out and "3 of 3 pairs positive): kept" in out
    assert "(margin 0.375;" in out  # 3 / sqrt(64)
    record = bundle.config["source"]["sign_check"]
    assert record["pairs"] == [list(p) for p in PAIRS] and [r["verdict"] for r in record["layers"]] == ["flipped", "kept"]
    assert record["rule"] == {"min_pairs": 3, "margin_sds": 3.0, "agreement": 0.75}
    # without the check the file's sign stays, as before
    assert cli.main(["import-vector", str(gguf), "--model", str(tmp_path / "model"), "--out", str(tmp_path / "c")]) == 0
    assert np.allclose(methods.load_bundle(tmp_path / "c").tensors["directions"][0].numpy(), -right[1].numpy())


def test_pairs_that_disagree_are_inconclusive_and_change_nothing(model, tokenizer, tmp_path, caplog):
    right = difference(model, tokenizer)
    bundle = write_gguf(tmp_path / "v.gguf", {2: (-right[2]).numpy()})
    from mari_eval.vectors import control_vector

    path = control_vector.import_gguf(bundle, model, tmp_path / "b")
    split = [PAIRS[0], PAIRS[1], PAIRS[2][::-1]]  # two pairs say flip, one says keep: 2 of 3, under three quarters
    check = SignCheck(model, split, tokenizer=tokenizer)
    with caplog.at_level(logging.WARNING):
        report = check.apply(path)
    assert "1 of 3 pairs positive): inconclusive" in report and "nothing flipped" in report
    assert "inconclusive at layer 2" in caplog.text and "add pairs" in caplog.text
    assert torch.equal(methods.load_bundle(path).tensors["directions"][0], -right[2])


def test_a_direction_within_the_margin_is_inconclusive_though_every_pair_projects_below_zero(model, tokenizer, tmp_path):
    # Issue 83.3: the sign once followed the pairs' projections however small. Here every pair's cosine with the
    # direction is about -0.1 (each pair negative, the old rule's flip), inside the margin 3 / sqrt(64) = 0.375.
    right = difference(model, tokenizer)[2]
    other = torch.randn(64, generator=torch.Generator().manual_seed(0))
    check = SignCheck(model, PAIRS, tokenizer=tokenizer)
    for d in check.differences[:, 2]:  # orthogonal to every pair's difference
        other -= (other @ d) / (d @ d) * d
    weak = other / other.norm() - 0.1 * right / right.norm()
    from mari_eval.vectors import control_vector

    path = control_vector.import_gguf(write_gguf(tmp_path / "v.gguf", {2: weak.numpy()}), model, tmp_path / "b")
    (result,) = check.verdicts({2: weak})
    assert result.positive_pairs == 0 and -0.2 < result.mean_cosine < 0 and result.verdict == "inconclusive"
    assert "nothing flipped" in check.apply(path)
    assert torch.equal(methods.load_bundle(path).tensors["directions"][0], weak)


def test_a_steering_configs_add_rows_are_checked_by_what_they_add_and_a_clamp_is_skipped(model, tokenizer, tmp_path):
    right = difference(model, tokenizer)
    config = {"layers.1": {"steering_vector": right[1].clone(), "steering_coefficient": -2.0, "action": "add"},
              "layers.2": {"steering_vector": -right[2], "steering_coefficient": 1.0, "action": "clamp",
                           "bias": torch.zeros(64)},
              "layers.3": {"steering_vector": -right[3], "steering_coefficient": 0.5, "action": "add"}}
    torch.save(config, tmp_path / "steer.pt")
    path = steer_config.import_steer_file(tmp_path / "steer.pt", model, tmp_path / "b")
    report = SignCheck(model, PAIRS, tokenizer=tokenizer).apply(path)
    vectors = methods.load_bundle(path).tensors["vectors"]
    # layer 1 adds -2 x (a right direction): what it adds points away from POSITIVE, so its vector is negated
    assert torch.equal(vectors[0], -right[1]) and torch.equal(vectors[2], right[3])
    assert torch.equal(vectors[1], -right[2]) and "layer 2: skipped: a clamp" in report
    assert "flipped layers 1, 3" in report


@pytest.mark.parametrize("pairs, refusal", [
    ([("same", "same"), *PAIRS[1:]], "pair 1: 'same' and 'same' are the same words"),
    ([*PAIRS[:2], ("I love this", "I love this ")], "pair 3: 'I love this' and 'I love this ' are the same words"),
    ([*PAIRS[:2], ("Great, thanks!", "great thanks.")], "are the same words (up to case, whitespace and punctuation)"),
    ([*PAIRS[:2], PAIRS[0]], "pair 3 repeats pair 1"),
    (PAIRS[:2], "needs at least 3 POSITIVE NEGATIVE pairs (given 2)")])
def test_bad_pairs_are_refused_before_anything_is_written(model, tmp_path, capsys, pairs, refusal):
    gguf = write_gguf(tmp_path / "v.gguf", {1: np.ones(64, dtype=np.float32)})
    model.save_pretrained(tmp_path / "model")
    assert cli.main(["import-vector", str(gguf), "--model", str(tmp_path / "model"), "--out", str(tmp_path / "b"),
                     *_sign_check_args(pairs)]) == 1
    assert refusal in capsys.readouterr().err and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="two non-empty prompts"):
        SignCheck(model, [(POSITIVE, " "), *PAIRS[1:]])


def test_the_issues_pair_is_refused_by_the_command_before_the_model_loads(tmp_path):
    # Issue 83: "I love this" / "I love this " negated layer 10 on a projection of -0.18. No model at --model:
    # the refusal comes first, and nothing is written.
    gguf = write_gguf(tmp_path / "v.gguf", {1: np.ones(64, dtype=np.float32)})
    result = subprocess.run(["mari-eval", "import-vector", str(gguf), "--model", str(tmp_path / "no-model"), "--out",
                             str(tmp_path / "b"), "--sign-check", "I love this", "I love this "],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and not (tmp_path / "b").exists()
    assert "--sign-check pair 1: 'I love this' and 'I love this ' are the same words" in result.stderr
    assert "Traceback" not in result.stderr
