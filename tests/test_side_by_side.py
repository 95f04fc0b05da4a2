"""``mari-eval generate`` (mari_eval/evaluation/side_by_side.py, issue 57.1) on a random Llama over bytes: the
streamed answer is lm-eval's own generation of the same request, the untouched answer is the base
model's whatever the bundle, and MARI's routing is shown."""

import io

import pytest
import torch
from lm_eval.api.instance import Instance

from mari_eval.evaluation import side_by_side
from mari_eval.evaluation.lm_generation import CHAT_TURN_FIELD

from .test_batching import bundles, model, tokenizer  # noqa: F401 (its byte Llama's fixtures)

PROMPT = "Tell me about the sea."
SETTINGS = side_by_side.GenerationSettings(max_new_tokens=12)


def _lm(model, tokenizer, bundle=None):
    from mari_eval.evaluation.lm import MariLM

    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundle,
                  allow_other_model=True if bundle else None)


def _lm_eval_answer(lm, prompt: str, tokens: int) -> str:
    """What lm-eval's generate_until answers for a SORRY-Bench-like request (a chat turn)."""
    request = Instance("generate_until", {CHAT_TURN_FIELD: prompt}, (prompt, {"until": [], "max_gen_toks": tokens,
                                                                              "do_sample": False}), 0)
    return lm.generate_until([request])[0]


@pytest.mark.parametrize("name", ["caa", "iti", "reft", "mari"])
def test_the_streamed_answer_is_lm_evals_generation_and_the_base_answer_the_untouched_models(model, tokenizer,
                                                                                             bundles, name):
    lm = _lm(model, tokenizer, bundles[name])
    shown = io.StringIO()
    steered = side_by_side.answer(lm, PROMPT, SETTINGS, out=shown)
    assert shown.getvalue() == steered + "\n"  # streamed piece by piece, then a newline
    assert steered == _lm_eval_answer(lm, PROMPT, SETTINGS.max_new_tokens)
    base = side_by_side.answer(lm, PROMPT, SETTINGS, steered=False)
    assert base == side_by_side.answer(_lm(model, tokenizer), PROMPT, SETTINGS, steered=False)
    ids = side_by_side.prompt_ids(lm, PROMPT, steered=False)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SETTINGS.max_new_tokens,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert base == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)
    assert lm.plan is not side_by_side.plans.VANILLA  # the method's plan restored after the base answer


def test_maris_routing_is_shown_after_its_answer(model, tokenizer, bundles):
    lm = _lm(model, tokenizer, bundles["mari"])
    side_by_side.answer(lm, PROMPT, SETTINGS)
    line = side_by_side.routing_line(lm)
    assert line.startswith("gate ") and "energy" in line and "threshold" in line
    assert side_by_side.routing_line(_lm(model, tokenizer, bundles["caa"])) is None


def test_sampling_is_seeded(model, tokenizer):
    lm = _lm(model, tokenizer)
    sampled = side_by_side.GenerationSettings(max_new_tokens=12, temperature=1.0, seed=3)
    assert side_by_side.answer(lm, PROMPT, sampled) == side_by_side.answer(lm, PROMPT, sampled)


def test_a_missing_local_bundle_is_named_before_anything_loads(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"bundle '{tmp_path}/none': no such local directory"):
        side_by_side.load(str(tmp_path / "none"), None, {})


def test_the_command_passes_its_options_on_and_refuses_them_given_twice(monkeypatch, capsys, tmp_path):
    from mari_eval import cli

    seen = {}
    monkeypatch.setattr(side_by_side, "run", lambda *args: seen.update(args=args))
    assert cli.main(["generate", "b", "hi", "--scale", "2", "--set", "T_ent=3", "--compare", "--temperature", "0.7",
                     "--max-new-tokens", "5"]) == 0
    bundle, prompt, model, given, settings, compare, dtype, device = seen["args"]
    assert (bundle, prompt, model, given, compare) == ("b", "hi", None, {"scale": "2", "T_ent": "3"}, True)
    assert settings == side_by_side.GenerationSettings(5, 0.7, 1.0, 0)
    assert cli.main(["generate", "b", "hi", "--scale", "2", "--set", "scale=3"]) == 1
    assert "scale given twice" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.main(["generate", str(tmp_path / "none"), "hi"]) == 1
    assert "no such local directory" in capsys.readouterr().err


def test_set_refuses_a_key_given_twice_in_train_and_generate(capsys):
    from mari_eval import cli

    assert cli.main(["train", "--method", "caa", "--attribute", "truthfulqa", "--out", "/tmp/never-written",
                     "--set", "layers=[3]", "--set", "layers=[4]"]) == 1
    assert "--set layers= given twice ('[3]' and '[4]')" in capsys.readouterr().err
    assert cli.main(["train", "--method", "mari", "--attribute", "truthfulqa", "--out", "/tmp/never-written",
                     "--K", "3", "--set", "K=4"]) == 1
    assert "K given twice (--K and --set K=)" in capsys.readouterr().err
    assert cli.main(["generate", "b", "hi", "--set", "T_ent=3", "--set", "T_ent=4"]) == 1
    assert "--set T_ent= given twice" in capsys.readouterr().err


@pytest.mark.parametrize("method, given, expected", [("caa", [], "published"), ("reft", [], "published"),
                                                     ("nl_iti", [], "published"),
                                                     ("caa", ["--recipe", "adapted"], "adapted"), ("mari", [], None)])
def test_train_defaults_to_the_recipe_the_tables_score_and_says_so(monkeypatch, capsys, tmp_path, method, given,
                                                                     expected):
    from mari_eval import cli

    seen = {}
    monkeypatch.setattr("mari_eval.training.train.train", lambda *a, **k: seen.update(k) or tmp_path / "b")
    assert cli.main(["train", "--method", method, "--attribute", "truthfulqa", "--out", str(tmp_path / "b"), *given]) == 0
    assert seen["hyperparameters"].get("recipe") == expected
    said = capsys.readouterr().err
    assert ("the one the tables score (--recipe adapted" in said) == (expected == "published" and not given)


def test_a_runs_diagnostics_are_logged_on_one_line(model, tokenizer, bundles, caplog):
    import logging

    from mari_eval.evaluation.lm import diagnostics_line

    lm = _lm(model, tokenizer, bundles["mari"])
    _lm_eval_answer(lm, PROMPT, 4)
    with caplog.at_level(logging.INFO, logger="lm_eval.mari_eval"):
        info = lm.get_model_info()
    line = [r.getMessage() for r in caplog.records if "diagnostics (in full" in r.getMessage()]
    assert len(line) == 1 and "gate_rate=" in line[0] and "gate_rate" in info["mari_diagnostics"]
    assert diagnostics_line({"a": 0.123456, "nested": {"x": list(range(100))}, "b": "s"}) == "a=0.1235, b=s"
