"""The energy gate's applicability labels (loss, flip, source) and how well energy separates them."""

import math

import pytest
import torch

from mari_eval import methods
from mari_eval.mari import gate_labels
from mari_eval.mari import equations as mari_equations

from .tiny import tiny_mari


def test_auroc_is_the_probability_that_an_applicable_example_has_the_higher_energy():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (40,), generator=g).float()  # many ties
    labels = torch.rand(40, generator=g) < 0.4
    assert gate_labels.auroc(scores, labels) == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()))
    assert gate_labels.auroc(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([1, 1, 0])) == 1.0
    assert gate_labels.auroc(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0, 0, 1])) == 0.0
    assert gate_labels.auroc(torch.tensor([2.0, 2.0]), torch.tensor([1, 0])) == 0.5
    assert gate_labels.auroc(torch.tensor([2.0, 3.0]), torch.tensor([1, 1])) is None  # one class only


def test_flip_means_wrong_to_right_and_a_twice_as_likely_target():
    # Multiple choice [base, edited] x 3 options, gold 1.
    wrong_to_right = torch.tensor([[0.0, -1.0, -2.0], [-2.0, 0.0, -1.0]])
    assert gate_labels.flip_label(wrong_to_right, 1, edited_row=1, base_row=0)
    assert not gate_labels.flip_label(wrong_to_right.flip(0), 1, edited_row=1, base_row=0)  # right to wrong
    right_to_right = torch.tensor([[-1.0, 0.0, -2.0], [-3.0, 0.0, -2.0]])
    assert not gate_labels.flip_label(right_to_right, 1, edited_row=1, base_row=0)
    # ... although its loss drops: the loss label says applicable, flip does not.
    losses = torch.nn.functional.cross_entropy(right_to_right, torch.tensor([1, 1]), reduction="none")
    assert gate_labels.loss_label(losses, edited_row=1, base_row=0)
    # Generation: the target's log-likelihood must rise by more than log 2.
    target = torch.tensor([[-5.0], [-5.0 + math.log(2) + 1e-3]])
    assert gate_labels.flip_label(target, None, edited_row=1, base_row=0)
    assert not gate_labels.flip_label(torch.tensor([[-5.0], [-4.5]]), None, edited_row=1, base_row=0)


def _labelled_bundle():
    n = 20
    bundle = tiny_mari(K=3, energies=torch.arange(n, dtype=torch.float32))
    bundle.tensors["ctrl_flip"] = (torch.arange(n) % 4 == 0).to(torch.uint8)
    bundle.tensors["ctrl_flip_single"] = (torch.arange(n) % 5 == 0).to(torch.uint8)
    bundle.config["gate"] = {"ctrl_sources": ["attribute"] * 8 + ["arc_easy"] * 12}
    bundle.configure()
    return bundle


def test_labels_rethreshold_the_gate_without_retraining():
    bundle = _labelled_bundle()
    energy = bundle.tensors["ctrl_energy"]
    assert bundle.labels == "loss"  # the bundle's own (mari.DEFAULTS)
    expected = {
        "loss": mari_equations.energy_threshold(energy, bundle.tensors["ctrl_applicable"], 0.9),
        "flip": mari_equations.energy_threshold(energy, bundle.tensors["ctrl_flip"], 0.9),
        # source: the non-applicable examples are the 12 ARC-Easy ones (energies 8..19)
        "source": float(torch.quantile(torch.arange(8, 20, dtype=torch.float64), 0.9)),
    }
    for labels, tau in expected.items():
        bundle.configure(labels=labels)
        assert bundle.labels == labels and bundle.tau == pytest.approx(tau)
    assert len(set(expected.values())) == 3  # three different gates
    bundle.configure(labels="flip", experts="single")
    assert bundle.tau == pytest.approx(mari_equations.energy_threshold(energy, bundle.tensors["ctrl_flip_single"], 0.9))
    with pytest.raises(ValueError, match="labels='outcome': use one of loss, flip, source"):
        bundle.configure(labels="outcome")


def test_a_bundle_without_flip_labels_or_sources_refuses_them_by_name():
    bundle = tiny_mari(K=3)  # as trained before the flip labels and the sources were recorded
    with pytest.raises(ValueError, match="labels=flip: this bundle holds no flip labels .* retrain it"):
        bundle.configure(labels="flip")
    with pytest.raises(ValueError, match="labels=source: this bundle does not record the sources"):
        bundle.configure(labels="source")
    bundle.configure()
    assert set(bundle.summarize([])["control_separation"]) == {"loss"}


def test_diagnostics_give_the_separation_under_every_labelling_within_and_across_sources():
    bundle = _labelled_bundle()
    separation = bundle.summarize([])["control_separation"]
    assert set(separation) == {"loss", "flip", "source"}
    assert separation["source"]["auroc"] == 0.0  # the attribute examples have the lowest energies here
    assert separation["source"]["within_source"]["attribute"]["auroc"] is None  # one class within a source
    flip = separation["flip"]
    assert (flip["n_applicable"], flip["n_non_applicable"]) == (5, 15)
    assert flip["within_source"]["arc_easy"] == {
        "n_applicable": 3, "n": 12,
        "auroc": gate_labels.auroc(torch.arange(8, 20.0), (torch.arange(8, 20) % 4 == 0))}


def test_labels_is_an_evaluation_option_and_a_training_setting():
    assert "labels" in methods.option_names()
    hp = methods.method_class("mari").training_hyperparameters({"labels": "source"})
    assert hp["labels"] == "source"
    with pytest.raises(ValueError, match="labels"):
        methods.method_class("mari").training_hyperparameters({"labels": "outcome"})
