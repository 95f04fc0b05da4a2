"""Control vectors trained by the ecosystem's own tools on the tiny Llama of test_control_vector (4 layers,
hidden 64, a byte tokenizer), imported as ``control_vector`` bundles and scored through lm-eval's ``mari``
class: equal (1e-4) to the untouched model with each direction added by a hand-written forward hook on its
decoder layer's output at every position, at batch sizes 1 and 4.

steering-vectors: ``train_steering_vector`` itself; repeng: ``ControlVector.train`` and ``export_gguf``
themselves. Both are installed by the Makefile without their dependencies (steering-vectors pins transformers<5;
repeng 0.4.0, its one release, numpy<2). Under NumPy 2 ``import repeng`` fails on one name: repeng/extract.py
annotates ``ControlVector.__mul__`` with ``np.float_``, which NumPy 2.0 removed, and the annotation is
evaluated at import; ``_import_repeng`` supplies the alias for the import alone. Nothing repeng runs needs
NumPy 1 (its training and export here are checked against a hand hook, its own ``ControlModel`` and the GGUF
layout test_control_vector writes).
"""

import copy

import numpy as np
import pytest
import torch

from mari_eval import methods
from mari_eval.vectors import control_vector

from .test_control_vector import (LAYERS, hooked_copy, lm_for, model, reference_loglikelihoods,  # noqa: F401
                                  scores, tokenizer, write_gguf)

# (positive, negative) pairs of different lengths, so that a batch of them is padded
TRAINING_PAIRS = [("I love this, it is wonderful.", "I hate this, it is awful."),
                  ("What a happy day!", "What a sad day!"),
                  ("The food was delicious and warm.", "The food was cold."),
                  ("She smiled at everyone she met.", "She frowned at everyone she met."),
                  ("Great news: we won.", "Bad news: we lost the match."),
                  ("Thank you so much!", "Go away.")]
# repeng's default layers: range(-1, -num_hidden_layers, -1) made non-negative (read_representations,
# repeng/extract.py), i.e. 3, 2, 1 here, in that order (the order of its directions dict and of its GGUF file)
REPENG_LAYERS = tuple(LAYERS + i for i in range(-1, -LAYERS, -1))
STEERING_LAYERS = [1, 3]
STEERING_SCALE = 8.0  # steering-vectors' mean differences are small on this model: scaled so that scores move


def assert_scores_equal_hand_hook(lm, model, tokenizer, vectors, scale) -> float:
    """The bundle's log-likelihoods equal the hand-hooked model's (1e-4) and differ from the untouched model's;
    returns the largest difference from the hooked model."""
    got = np.array(scores(lm))
    expected = np.array(reference_loglikelihoods(hooked_copy(model, vectors, scale), tokenizer))
    untouched = np.array(reference_loglikelihoods(model, tokenizer))
    assert np.allclose(got, expected, atol=1e-4), (got, expected)
    assert np.all(np.abs(got - untouched) > 1e-2)  # the vector does move every score
    return float(np.abs(got - expected).max())


# ----------------------------------------------------------------------------- repeng


def _import_repeng():
    """repeng, imported with NumPy 1's ``np.float_`` supplied for its annotations, then taken away again."""
    supplied = not hasattr(np, "float_")
    if supplied:
        np.float_ = np.float64
    try:
        import repeng
    finally:
        if supplied:
            del np.float_
    return repeng


@pytest.fixture(scope="module")
def repeng_vector(model, tokenizer):
    repeng = _import_repeng()
    dataset = [repeng.DatasetEntry(positive=p, negative=n) for p, n in TRAINING_PAIRS]
    return repeng.ControlVector.train(model, tokenizer, dataset)  # its defaults: pca_diff, layers 3, 2, 1


@pytest.fixture(scope="module")
def repeng_bundle(tmp_path_factory, model, repeng_vector):
    """The vector as repeng exports it, imported with ``import_gguf``."""
    folder = tmp_path_factory.mktemp("repeng")
    repeng_vector.export_gguf(str(folder / "vector.gguf"))
    return control_vector.import_gguf(folder / "vector.gguf", model, folder / "bundle")


def test_repengs_file_imports_layer_for_layer_in_the_layout_we_read(tmp_path, repeng_vector, repeng_bundle):
    assert list(repeng_vector.directions) == list(REPENG_LAYERS) and repeng_vector.model_type == "llama"
    bundle = methods.load_bundle(repeng_bundle)
    assert bundle.layers == [1, 2, 3]  # direction.i -> after model.model.layers[i]: repeng's i, unchanged
    assert bundle.config["hyperparameters"]["strength"] == 1.0
    assert bundle.config["source"]["format"] == "gguf control vector" and bundle.config["source"]["model_hint"] == "llama"
    for row, layer in enumerate(bundle.layers):
        assert torch.equal(bundle.tensors["directions"][row], torch.from_numpy(repeng_vector.directions[layer]))
    # repeng's file is byte for byte the layout test_control_vector writes by hand
    written = write_gguf(tmp_path / "layout.gguf", repeng_vector.directions, hint="llama")
    assert (repeng_bundle.parent / "vector.gguf").read_bytes() == written.read_bytes()


@pytest.mark.parametrize("batch_size", [1, 4])
def test_repengs_vector_scores_equal_the_hand_hook(model, tokenizer, repeng_vector, repeng_bundle, batch_size):
    lm = lm_for(model, tokenizer, repeng_bundle, batch_size=batch_size)
    assert_scores_equal_hand_hook(lm, model, tokenizer, repeng_vector.directions, 1.0)


def test_repengs_vector_scores_equal_its_own_control_model(model, tokenizer, repeng_vector, repeng_bundle):
    repeng = _import_repeng()
    controlled = repeng.ControlModel(copy.deepcopy(model), list(repeng_vector.directions))  # it wraps the layers
    controlled.set_control(repeng_vector, 1.0)
    lm = lm_for(model, tokenizer, repeng_bundle, batch_size=4)
    assert np.allclose(scores(lm), reference_loglikelihoods(controlled, tokenizer), atol=1e-4)


# ----------------------------------------------------------------------------- steering-vectors


@pytest.fixture(scope="module")
def trained_steering_vector(model, tokenizer):
    from steering_vectors import train_steering_vector

    return train_steering_vector(model, tokenizer, TRAINING_PAIRS, layers=STEERING_LAYERS, layer_type="decoder_block")


@pytest.fixture(scope="module")
def steering_bundle(tmp_path_factory, model, trained_steering_vector):
    folder = tmp_path_factory.mktemp("steering")
    return control_vector.from_steering_vector(trained_steering_vector, model, folder / "bundle", scale=STEERING_SCALE)


def test_a_trained_steering_vector_imports_layer_for_layer(trained_steering_vector, steering_bundle):
    bundle = methods.load_bundle(steering_bundle)
    activations = trained_steering_vector.layer_activations
    assert sorted(activations) == STEERING_LAYERS == bundle.layers  # layer_activations[i] -> model.model.layers[i]
    assert bundle.config["hyperparameters"]["strength"] == STEERING_SCALE
    for row, layer in enumerate(bundle.layers):
        assert torch.equal(bundle.tensors["directions"][row], activations[layer].detach().float())


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_trained_steering_vector_scores_equal_the_hand_hook(model, tokenizer, trained_steering_vector,
                                                              steering_bundle, batch_size):
    vectors = {layer: t.detach() for layer, t in trained_steering_vector.layer_activations.items()}
    lm = lm_for(model, tokenizer, steering_bundle, batch_size=batch_size)
    assert_scores_equal_hand_hook(lm, model, tokenizer, vectors, STEERING_SCALE)


def test_a_trained_steering_vector_scores_equal_its_own_apply(model, tokenizer, trained_steering_vector,
                                                              steering_bundle):
    lm = lm_for(model, tokenizer, steering_bundle, batch_size=4)
    with trained_steering_vector.apply(model, multiplier=STEERING_SCALE):
        expected = reference_loglikelihoods(model, tokenizer)
    assert np.allclose(scores(lm), expected, atol=1e-4)
