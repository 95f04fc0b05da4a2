"""Which training recipe of each baseline the tables use: the same for every bundle (issue 36.5).

Every baseline has two recipes (docs/baselines.md): ``adapted`` (this suite's setting, its
strength and site chosen on the validation slice of D_train) and ``published`` (its authors'
recipe, as their code and papers fix it). The main table scores ``MAIN_TABLE_RECIPE`` for every
baseline, attribute, model and seed: the comparison a reader of a steering paper expects is
against each baseline as its authors train it. It was fixed on 2026-11-26 after both recipes'
held-out TruthfulQA results had been committed (3e04444, 2cdc907), not before any result was
seen; the reason for it is the one above, not those results.

Earlier tables kept, per bundle, the recipe with the lower validation-slice loss. That choice
was made on 4-5 validation questions in the standard profile, and the adapted recipe's figure was
already the minimum of a 12-15-cell grid over the same questions, so it was biased towards
``adapted`` and close to a coin toss. ``python repro/main_table.py --recipe adapted`` scores the
other recipe, and ``repro/baseline_recipes.py`` shows both side by side with their validation
losses, which are reported, not used to choose.

A variant of the published recipe for pricing and measuring one change (issue 81.5):
``--recipe published_head_score_auto`` trains ITI and NL-ITI with ``head_score=auto`` (their heads
ranked by balanced accuracy where more than 60% of the probe rows are one class, BBQ's;
baselines/iti_heads.py) and every other baseline as ``published``. Those ITI and NL-ITI bundles
get keys of their own, so the committed ones (keyed without head_score: plain accuracy, the
authors' score) are neither read nor replaced, and only they and their evaluations are computed:
``python repro/main_table.py --profile budget --runs results/budget_steps --recipe
published_head_score_auto --out results/profiles/budget/head_score_auto`` (``--plan`` first)."""

from __future__ import annotations

from pathlib import Path

from repro.engine.cache import Store
from repro.engine.profiles import Profile

BASELINES = ("caa", "iti", "nl_iti", "reft")
TRAINING_RECIPES = ("adapted", "published")  # every baseline's two (repro/baseline_recipes.py scores both)
HEAD_SCORE_AUTO = "published_head_score_auto"  # the published recipe, ITI's and NL-ITI's heads by head_score=auto
HEAD_SCORE_METHODS = ("iti", "nl_iti")
RECIPES = (*TRAINING_RECIPES, HEAD_SCORE_AUTO)  # what a table's --recipe accepts
MAIN_TABLE_RECIPE = "published"


def recipe_bundle(store: Store, method: str, attribute: str, model: str, seed: int, profile: Profile,
                  recipe: str) -> Path:
    """The bundle of ``method`` trained with ``recipe``, with the profile's changes to that recipe
    (``Profile.adapted``, ``Profile.published``). The adapted one without changes is the bundle every
    table trained before recipes existed (the same cache key: no recipe in its hyperparameters)."""
    return store.bundle(method, attribute, model, seed, profile, recipe_settings(method, profile, recipe))


def recipe_settings(method: str, profile: Profile, recipe: str) -> dict | None:
    """The hyperparameters ``recipe`` trains ``method`` with (None: the adapted recipe's defaults)."""
    if recipe == "adapted":
        return dict(profile.adapted[method]) if method in profile.adapted else None
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    published = {"recipe": "published", **profile.published.get(method, {})}
    if recipe == HEAD_SCORE_AUTO and method in HEAD_SCORE_METHODS:
        published["head_score"] = "auto"  # a key of its own; absent (the tables' default): plain accuracy
    return published


def table_settings(method: str, profile: Profile, recipe: str = MAIN_TABLE_RECIPE) -> dict | None:
    """The hyperparameters the tables train ``method`` with: a baseline's ``recipe``, else the
    profile's settings for it (``Profile.settings``: the quick profile's LoRA epochs), else the defaults."""
    if method in BASELINES:
        return recipe_settings(method, profile, recipe)
    return dict(profile.settings[method]) if method in profile.settings else None


def table_bundle(store: Store, method: str, attribute: str, model: str, seed: int, profile: Profile,
                 recipe: str = MAIN_TABLE_RECIPE) -> Path:
    """The bundle the main table scores for ``method`` on ``attribute`` (a baseline in ``recipe``):
    the one every other table that reads "the main table's bundle" must read too."""
    return store.bundle(method, attribute, model, seed, profile, table_settings(method, profile, recipe))
