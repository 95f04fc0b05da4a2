"""CAA's published recipe (Rimsky et al., 2024): layer 13 of 32 carried over by depth, multiplier 1,
no grid; its selection loss against an independent computation with transformers' hidden states."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from baselines import caa
from baselines.common import SELECTION_KEY, held_out_slice
from mari_eval import methods
from mari_eval.evaluation import runner
from mari_eval.evaluation.prefix_cache import encode_prefix
from mari_eval.training.train import AttributeData, Example

from .tiny import chat_free_session
from .tiny import reloaded, tiny_model

QUESTIONS = [("Is ice cold?", ["Yes", "No", "Warm"], 0), ("Is fire cold?", ["Yes", "No", "Wet"], 1),
             ("2+2?", ["3", "5", "4"], 2), ("Sky colour?", ["Blue", "Green", "Red"], 0),
             ("Capital of France?", ["Rome", "Paris", "Oslo"], 1), ("Do fish swim?", ["No", "Never", "Yes"], 2),
             ("Is the sun a star?", ["Yes", "No", "Moon"], 0), ("Legs of a cat?", ["Two", "Four", "Six"], 1),
             ("Water boils at?", ["50 C", "10 C", "100 C"], 2), ("Is lead heavy?", ["Yes", "No", "Light"], 0)]


@pytest.fixture(scope="module")
def fitted():
    model = tiny_model("llama")  # 4 layers: the published layer is round(13 * 4 / 32) = 2
    session = chat_free_session(model)
    examples = [Example(f"q{i}", session.encode_prompt(q + "\nA:"), [session.encode_prompt(" " + c) for c in choices], gold,
                        question=q, choices=choices) for i, (q, choices, gold) in enumerate(QUESTIONS)]
    data = AttributeData("tiny", None, [], examples, [], [])
    config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}
    bundle = caa.CAA.fit(session, data, config, {"recipe": "published"}, seed=0)
    return model, session, examples, bundle


def _vector(model, session, pairs, layer):
    """CAA's mean difference at the answer letter, read from transformers' output_hidden_states."""
    diffs = []
    for i, (question, positive, negative) in enumerate(pairs):
        first, second = (positive, negative) if i % 2 == 0 else (negative, positive)
        letters = ("A", "B") if i % 2 == 0 else ("B", "A")
        states = []
        for letter in letters:
            ids = torch.tensor([caa.ab_prompt(session, question, first, second, letter)])
            with torch.no_grad():
                states.append(model(input_ids=ids, output_hidden_states=True).hidden_states[layer + 1][0, -1])
        diffs.append(states[0] - states[1])
    return torch.stack(diffs).mean(0)


def _option_logprobs(model, ex, layer, shift):
    """Log-likelihood of each option with ``shift`` added after ``layer`` from the last prompt token on."""
    start = len(ex.context) - 1

    def hook(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[:, start:] += shift
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.model.layers[layer].register_forward_hook(hook)
    scores = []
    try:
        with torch.no_grad():
            for option in ex.options:
                logprobs = model(input_ids=torch.tensor([ex.context + option])).logits[0, start:-1].log_softmax(-1)
                scores.append(logprobs.gather(-1, torch.tensor(option)[:, None]).sum())
    finally:
        handle.remove()
    return torch.stack(scores)


def _steered_loss(model, examples, layer, shift):
    """Mean option cross-entropy (the task loss) under ``shift``."""
    return sum(F.cross_entropy(_option_logprobs(model, ex, layer, shift)[None], torch.tensor([ex.gold])).item()
               for ex in examples) / len(examples)


@pytest.mark.parametrize("num_layers,layer", [(32, 13), (30, 12), (40, 16), (24, 10), (16, 7), (4, 2), (1, 0)])
def test_published_layer_is_13_of_32_by_relative_depth(num_layers, layer):
    assert caa.published_layer(num_layers) == layer  # 16 layers: 6.5 rounds up to 7


def test_published_fit_records_its_fixed_settings_and_no_grid(fitted):
    _, _, examples, bundle = fitted
    hp, diag = bundle.config["hyperparameters"], bundle.config["diagnostics"]
    assert hp["recipe"] == "published" and hp["multiplier"] == 1.0 and bundle.layer == 2
    assert (hp["reference_layer"], hp["reference_num_layers"], hp["vector_normalization"]) == (13, 32, "none")
    assert "layers_tried" not in hp and "validation_loss" not in diag  # no grid was scored
    assert diag["validation_ids"] == [ex.id for ex in held_out_slice(examples, 0)[1]]
    assert set(diag) == {SELECTION_KEY, "validation_loss_base", "validation_ids"}


def test_published_vector_and_selection_loss_match_an_independent_computation(fitted):
    model, session, examples, bundle = fitted
    pairs = dict(zip((ex.id for ex in examples), caa.contrast_pairs(examples, 0)))
    fit, val = held_out_slice(examples, 0)
    # The bundle's vector: all of D_train; the selection loss: the vector of the 80% fit slice only.
    whole = _vector(model, session, list(pairs.values()), 2)
    torch.testing.assert_close(bundle.tensors["vector"], whole, atol=1e-5, rtol=1e-5)
    from_fit = _vector(model, session, [pairs[ex.id] for ex in fit], 2)
    diag = bundle.config["diagnostics"]
    assert diag[SELECTION_KEY] == pytest.approx(_steered_loss(model, val, 2, 1.0 * from_fit), rel=1e-4)
    assert diag[SELECTION_KEY] != pytest.approx(_steered_loss(model, val, 2, 1.0 * whole), rel=1e-4)
    assert diag["validation_loss_base"] == pytest.approx(_steered_loss(model, val, 2, torch.zeros(32)), rel=1e-4)


def test_published_bundle_round_trips_and_applies_the_vector_at_its_layer(fitted, tmp_path):
    model, _, examples, bundle = fitted
    loaded = reloaded(bundle, tmp_path / "caa")
    assert loaded.config["hyperparameters"]["recipe"] == "published" and loaded.layer == 2
    ex = examples[0]
    prefix = encode_prefix(model, ex.context[:-1])
    runs = [runner.score_variants(model, prefix, ex.context[-1], ex.options, b.plan(model)) for b in (bundle, loaded)]
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)
    # Evaluated through the lm-eval path, the bundle is the edit h + 1 * v after layer 2 from p* on.
    expected = _option_logprobs(model, ex, 2, bundle.tensors["vector"])
    torch.testing.assert_close(runs[0].logprobs[0], expected, atol=1e-4, rtol=1e-4)


def test_published_recipe_refuses_a_grid():
    model = tiny_model("llama")
    session = chat_free_session(model)
    with pytest.raises(ValueError, match=r"published recipe fixes the layer and the multiplier; drop --set layers "
                                         r"or train with --recipe adapted"):
        caa.CAA.fit(session, AttributeData("tiny", None, [], [], [], []), {"site": {"layer": 1}},
                    {"recipe": "published", "layers": [1]}, seed=0)


def test_a_bundle_without_recipe_still_loads_as_adapted(tmp_path):
    from baselines.common import recipe_of

    config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 2},
              "hyperparameters": {"multiplier": 3.0}}
    old = caa.CAA(config, {"vector": torch.ones(32)})
    old.save(tmp_path / "old")
    loaded = methods.load_bundle(tmp_path / "old")
    assert recipe_of(loaded.config["hyperparameters"]) == "adapted" and loaded.strength() == 3.0


@pytest.mark.needs_data
def test_published_fit_on_the_embedded_model_steers_layer_12_of_30(truthfulqa_session):  # conftest: 20 TruthfulQA questions
    session, data, config = truthfulqa_session
    data = dataclasses.replace(data, train=data.train[:10])  # 8 questions to fit, 2 to validate: the recipe on the real model
    bundle = caa.CAA.fit(session, data, config, {"recipe": "published"}, seed=0)
    hp, diag = bundle.config["hyperparameters"], bundle.config["diagnostics"]
    assert bundle.layer == 12 and hp["multiplier"] == 1.0 and bundle.tensors["vector"].shape == (576,)
    # One configuration scored: a finite selection loss, not the base model's (the vector moves it).
    assert torch.isfinite(torch.tensor(diag[SELECTION_KEY])) and diag[SELECTION_KEY] != diag["validation_loss_base"]
