"""The baselines' two training recipes (issue 24): how a bundle says which it was trained with,
the validation loss each reports, and who may ask for one."""

import pytest

from baselines.common import SELECTION_KEY, recipe_of, selection_loss
from mari_eval.methods import method_class


def test_a_bundle_without_a_recipe_is_adapted():
    assert recipe_of({}) == "adapted" and recipe_of({"recipe": None}) == "adapted"
    assert recipe_of({"recipe": "published"}) == "published"


def test_selection_loss_is_the_recorded_one_or_the_best_of_an_older_bundles_grid_or_epochs():
    assert selection_loss({"diagnostics": {SELECTION_KEY: 0.7, "validation_loss": {"1:2": 0.1}}}) == 0.7
    grid = {"method": "caa", "hyperparameters": {}, "diagnostics": {"validation_loss": {"4:1.0": 1.3, "4:2.0": 0.9}}}
    assert selection_loss(grid) == 0.9
    epochs = {"method": "reft", "hyperparameters": {"rank": 4},
              "diagnostics": {"history": [{"validation_loss": 2.0}, {"validation_loss": 1.5}, {"validation_loss": 1.8}]}}
    assert selection_loss(epochs) == 1.5


def test_a_published_bundle_without_its_selection_loss_is_refused():
    with pytest.raises(ValueError, match="retrain"):
        selection_loss({"method": "iti", "hyperparameters": {"recipe": "published"},
                        "diagnostics": {"validation_loss": {"4:15": 0.5}}})


@pytest.mark.parametrize("method", ["caa", "iti", "nl_iti", "reft"])
def test_every_baseline_takes_both_recipes_and_no_other(method):
    cls = method_class(method)
    for recipe in ("adapted", "published"):
        assert cls.training_hyperparameters({"recipe": recipe})["recipe"] == recipe
    with pytest.raises(ValueError, match="recipe"):
        cls.training_hyperparameters({"recipe": "original"})


def test_mari_refuses_a_recipe_naming_the_methods_that_take_one():
    with pytest.raises(ValueError, match="caa, iti, nl_iti, reft"):
        method_class("mari").training_hyperparameters({"recipe": "published"})
