"""Which training recipe of each baseline the tables use (issue 24.4): both recipes are trained,
and the one with the lower task loss on the validation slice of D_train
(``diagnostics.validation_loss_selected``, baselines/common.py) is kept, per baseline, attribute,
model and seed. No test split is read: the choice is made before any evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from repro.cache import Store
from repro.profiles import Profile

BASELINES = ("caa", "iti", "nl_iti", "reft")
RECIPES = ("adapted", "published")


@dataclass(frozen=True)
class Choice:
    """The recipe kept for one baseline bundle, and what it was chosen by."""

    recipe: str
    bundle: Path
    losses: dict[str, float]  # recipe -> validation_loss_selected


def recipe_bundle(store: Store, method: str, attribute: str, model: str, seed: int, profile: Profile,
                  recipe: str) -> Path:
    """The bundle of ``method`` trained with ``recipe``; the adapted one is the bundle every table
    trained before recipes existed (the same cache key: no recipe in its hyperparameters)."""
    return store.bundle(method, attribute, model, seed, profile, None if recipe == "adapted" else {"recipe": recipe})


def validation_loss_selected(bundle: Path) -> float:
    from baselines.common import selection_loss
    from mari_eval.methods import load_bundle

    return selection_loss(load_bundle(bundle).config)


def choose(store: Store, method: str, attribute: str, model: str, seed: int, profile: Profile) -> Choice:
    """Both recipes of ``method`` trained (or read back), the lower validation loss kept (ties: adapted)."""
    bundles = {recipe: recipe_bundle(store, method, attribute, model, seed, profile, recipe) for recipe in RECIPES}
    losses = {recipe: validation_loss_selected(path) for recipe, path in bundles.items()}
    kept = min(RECIPES, key=lambda recipe: (losses[recipe], RECIPES.index(recipe)))
    return Choice(kept, bundles[kept], losses)


def describe(choices: dict[str, Choice]) -> str:
    """'truthfulqa: adapted (0.91 vs 1.02), ...': the recipe kept per attribute and the two losses."""
    return "; ".join(f"{attribute}: {c.recipe} (validation loss adapted {c.losses['adapted']:.3f}, "
                     f"published {c.losses['published']:.3f})" for attribute, c in sorted(choices.items()))
