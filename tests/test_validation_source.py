"""One labelled-data budget (issue 55.2): ``--set validation=ctrl`` makes every baseline fit on all of
D_train and select on D_ctrl's attribute examples, the pool MARI's gate is calibrated on; the
default keeps the seeded 20% of D_train. On a tiny Llama, every baseline and recipe."""

import pytest

from baselines import caa, iti, lora, reft
from baselines.common import held_out_slice
from mari_eval.training.train import AttributeData, Example

from .tiny import chat_free_session, reloaded, tiny_model

QUESTIONS = [("Is ice cold?", ["Yes", "No", "Warm"], 0), ("Is fire cold?", ["Yes", "No", "Wet"], 1),
             ("2+2?", ["3", "5", "4"], 2), ("Sky colour?", ["Blue", "Green", "Red"], 0),
             ("Capital of France?", ["Rome", "Paris", "Oslo"], 1), ("Do fish swim?", ["No", "Never", "Yes"], 2),
             ("Is the sun a star?", ["Yes", "No", "Moon"], 0), ("Legs of a cat?", ["Two", "Four", "Six"], 1),
             ("Water boils at?", ["50 C", "10 C", "100 C"], 2), ("Is lead heavy?", ["Yes", "No", "Light"], 0),
             ("Is snow white?", ["Yes", "No", "Red"], 0), ("Do birds fly?", ["No", "Yes", "Swim"], 1),
             ("3+3?", ["5", "7", "6"], 2), ("Grass colour?", ["Green", "Blue", "Pink"], 0),
             ("Capital of Italy?", ["Oslo", "Rome", "Lima"], 1)]
# (method class, training settings): every baseline under both recipes (NL-ITI's published MLP probes
# read the same selection code as ITI's and cost more; ITI's published with cross-validated heads).
FITS = [(caa.CAA, {}), (caa.CAA, {"recipe": "published"}), (iti.ITI, {"head_fractions": [0.1], "alphas": [5.0]}),
        (iti.ITI, {"recipe": "published"}), (iti.ITI, {"recipe": "published", "head_selection": "cv"}),
        (reft.ReFT, {"epochs": 1}), (reft.ReFT, {"recipe": "published", "min_steps": 2, "layers": [1, 2]}),
        (lora.LoRA, {"epochs": 1})]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = [Example(f"q{i}", session.encode_prompt(q + "\nA:"), [session.encode_prompt(" " + c) for c in choices], gold,
                        question=q, choices=choices) for i, (q, choices, gold) in enumerate(QUESTIONS)]
    # D_train: 10 questions; D_ctrl: 4 attribute hold-outs, then a general control that must not be read.
    data = AttributeData("tiny", None, [], examples[:10], examples[10:], ["attribute"] * 4 + ["arc_easy"])
    config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}
    return session, data, config


def _settings(cls, given):
    return {**getattr(cls, "training_defaults", {}), **given} if given.get("recipe") != "published" else given


@pytest.mark.parametrize("cls, given", FITS, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_validation_on_ctrl_fits_all_of_d_train_and_selects_on_the_attribute_hold_outs(setup, tmp_path, cls, given):
    session, data, config = setup
    bundle = cls.fit(session, data, config, {**_settings(cls, given), "validation": "ctrl"}, seed=0)
    hp, diagnostics = bundle.config["hyperparameters"], bundle.config["diagnostics"]
    assert diagnostics["validation_ids"] == ["q10", "q11", "q12", "q13"]  # not the general control q14
    assert hp["validation"] == "ctrl" and hp["validation_examples"] == 4 and "validation_fraction" not in hp
    reloaded(bundle, tmp_path / "bundle")  # the record passes the bundle's schema


def test_the_default_selects_on_a_seeded_fifth_of_d_train(setup):
    session, data, config = setup
    bundle = caa.CAA.fit(session, data, config, {}, seed=0)
    assert bundle.config["diagnostics"]["validation_ids"] == [ex.id for ex in held_out_slice(data.train, 0)[1]]
    assert bundle.config["hyperparameters"]["validation_fraction"] == 0.2 and "validation" not in bundle.config["hyperparameters"]


def test_validation_on_ctrl_without_attribute_hold_outs_names_the_fix(setup):
    session, data, config = setup
    empty = AttributeData("tiny", None, [], data.train, [], [])
    with pytest.raises(ValueError, match="give --max-ctrl a positive count, or train with validation=train"):
        caa.CAA.fit(session, empty, config, {"validation": "ctrl"}, seed=0)
