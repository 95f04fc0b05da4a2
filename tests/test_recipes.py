"""The baselines' two training recipes (issue 24): how a bundle says which it was trained with,
the validation loss each reports, and who may ask for one."""

import logging
from types import SimpleNamespace

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


def _warnings_of_fit(method: str, recipe: str | None, config: dict, monkeypatch, caplog) -> list[str]:
    """What ``Baseline.fit`` of ``method`` under ``recipe`` logs when its recipe's fit returns a bundle of
    ``config`` (the fit itself replaced): the warnings' messages."""
    cls = method_class(method)
    hyperparameters = {"recipe": recipe} if recipe else {}
    fitted = SimpleNamespace(method=method, config=config)
    monkeypatch.setattr(cls, "fit_published" if recipe == "published" else "fit_adapted", classmethod(lambda c, *args: fitted))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="baselines.common"):
        assert cls.fit(None, None, {}, dict(hyperparameters), 0) is fitted
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("method,recipe", [("caa", "adapted"), ("reft", "published"), ("lora", None)])
def test_fit_warns_when_the_kept_bundle_is_worse_than_no_edit_on_validation(method, recipe, monkeypatch, caplog):
    hyperparameters = {"recipe": recipe} if recipe else {}
    for selected, warned in ((1.3164, True), (1.1199, False), (0.87, False)):
        messages = _warnings_of_fit(method, recipe, {"hyperparameters": hyperparameters, "diagnostics": {
            SELECTION_KEY: selected, "validation_loss_base": 1.1199, "validation_ids": ["a", "b", "c"]}}, monkeypatch, caplog)
        assert bool(messages) == warned, messages
        if warned:
            assert "1.3164 is above the untouched model's 1.1199 on the same 3 validation examples" in messages[0]
            assert messages[0].startswith(f"{method} ({recipe or 'adapted'} recipe)")


@pytest.mark.parametrize("method,recipe", [("reft", "published"), ("lora", None)])
def test_fit_warns_when_the_epoch_kept_is_the_last_and_the_loss_still_fell_into_it(method, recipe, monkeypatch, caplog):
    hyperparameters = {"recipe": recipe} if recipe else {}
    history = lambda *losses: [{"epoch": i + 1, "validation_loss": v} for i, v in enumerate(losses)]
    for losses, kept, warned in (((1.52, 1.31, 1.27), 3, True),  # kept the last, still falling
                                 ((1.52, 1.27, 1.31), 2, False),  # an earlier epoch kept: validation chose
                                 ((1.52, 1.31, 1.31), 3, False),  # flat at the end
                                 ((1.52,), 1, False)):  # one epoch: nothing to compare
        messages = _warnings_of_fit(method, recipe, {"hyperparameters": {**hyperparameters, "epoch_kept": kept},
                                                     "diagnostics": {"history": history(*losses)}}, monkeypatch, caplog)
        assert bool(messages) == warned, messages
        if warned:
            assert "the epoch kept is the last of 3 and the validation loss still fell into it (1.3100, then 1.2700)" in messages[0]


def test_lora_has_one_recipe_and_its_fit_refuses_another():
    with pytest.raises(ValueError, match="LoRA has one training recipe"):
        method_class("lora").fit(None, None, {}, {"recipe": "published"}, 0)


def test_the_recipes_table_gives_vanilla_the_first_rows_examples_and_names_rows_selected_on_others():
    from repro.baseline_recipes import validation_losses

    def config(loss, base, ids):
        return {"method": "caa", "hyperparameters": {"recipe": "published"},
                "diagnostics": {"validation_loss_selected": loss, "validation_loss_base": base, "validation_ids": ids}}

    losses, differ = validation_losses({"CAA (adapted)": config(4.0, 5.0, ["a", "b"]),
                                        "CAA (published)": config(4.5, 5.0, ["b", "a"]),
                                        "ITI (adapted)": config(3.0, 6.0, ["a", "c", "d"])})
    assert losses == {"CAA (adapted)": {"value": 4.0, "n": 2}, "Vanilla": {"value": 5.0, "n": 2},
                      "CAA (published)": {"value": 4.5, "n": 2}, "ITI (adapted)": {"value": 3.0, "n": 3}}
    assert differ == ["ITI (adapted)"]  # the same examples in another order are the same examples
