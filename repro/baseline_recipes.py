"""Appendix table: every baseline under both training recipes on TruthfulQA (issue 24.4).

    python repro/baseline_recipes.py [--profile quick|standard|large|paper|smoke] [--model ID] [--seeds 0,1,2] [--methods caa,iti,nl_iti,reft]
    python repro/baseline_recipes.py --plan --profile paper  # its steps and their cost; runs nothing

Rows: Vanilla, then CAA, ITI, NL-ITI and ReFT each trained on TruthfulQA's D_train with the
adapted recipe (this suite's setting) and with the published one (its authors'; docs/baselines.md,
Baselines). Columns: held-out TruthfulQA MC1 and MC2, and ``val_loss``, the task loss of the
configuration each recipe keeps on its validation examples (the validation slice of D_train, fitted
on the other 80%; under ``validation=ctrl``, as in the budget profile, D_ctrl's labelled hold-outs;
Vanilla: the base model's on the first row's, ``validation_losses``), reported and not used to
choose: the main table scores the published recipe of every baseline, the same for every bundle (repro/engine/recipes.py), marked under the
table. The bundles are the main
table's (same cache under runs/). Writes results/baseline_recipes.{json,md,tex}.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from baselines.common import selection_loss
from mari_eval.methods import load_bundle
from repro.engine import cache, command_line, planning, profiles, recipes, scoring, steps
from repro.analysis import tables
from repro.engine.profiles import BENCHMARKS, METHOD_LABELS

COLUMNS = [c for c in BENCHMARKS if c[0] in ("tqa_mc1", "tqa_mc2")]


def plan(profile: profiles.Profile, store: cache.Store, methods=recipes.BASELINES) -> steps.Graph:
    """``run``'s work as a graph of steps (repro/engine/planning.py): each baseline's bundle under each
    recipe, then the rows' evaluations."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            rows: dict[str, scoring.Row] = {"Vanilla": ({}, "")}
            method_of: dict = {}
            for method in methods:
                for recipe in recipes.TRAINING_RECIPES:
                    settings = recipes.recipe_settings(method, profile, recipe)
                    bundle = planning.train_step(graph, store, profile, method, "truthfulqa", model, seed, settings)
                    rows[f"{METHOD_LABELS[method]} ({recipe})"], method_of[bundle] = ({"truthfulqa": bundle}, ""), method
            planning.evaluation_steps(graph, store, profile, model, seed, COLUMNS, rows, method_of)
    return graph


def validation_losses(configs: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """Per row (its bundle's config, in table order) the validation loss of what it kept and
    its examples' count (``val_loss``), and Vanilla's: the untouched model's on the first row's
    examples, which every bundle records beside its own. Also the rows whose examples are not the
    first row's, so that no reader compares their losses with Vanilla's unwarned."""
    losses: dict[str, dict] = {}
    first: set | None = None  # the first row's validation examples
    differ = []
    for label, config in configs.items():
        examples = config["diagnostics"]["validation_ids"]
        losses[label] = {"value": selection_loss(config), "n": len(examples)}
        if first is None:
            first = set(examples)
            losses["Vanilla"] = {"value": float(config["diagnostics"]["validation_loss_base"]), "n": len(examples)}
        elif set(examples) != first:
            differ.append(label)
    return losses, differ


def run(profile: profiles.Profile, store: cache.Store, methods=recipes.BASELINES) -> tuple[dict, dict]:
    cells: dict = {}
    notes: dict = {}
    model_seeds = [(m, s) for m in profile.models for s in profile.seeds]
    for model, seed in tqdm(model_seeds, desc="baseline recipes", unit="seed"):
        rows: dict[str, scoring.Row] = {"Vanilla": ({}, "")}
        configs: dict[str, dict] = {}
        for method in methods:
            for recipe in recipes.TRAINING_RECIPES:
                bundle = recipes.recipe_bundle(store, method, "truthfulqa", model, seed, profile, recipe)
                label = f"{METHOD_LABELS[method]} ({recipe})"
                rows[label] = ({"truthfulqa": bundle}, "")
                configs[label] = load_bundle(bundle).config
                if recipe == recipes.MAIN_TABLE_RECIPE:
                    notes.setdefault(model, {}).setdefault(label, []).append(f"seed {seed}: kept for the main table")
        validation, differ = validation_losses(configs)
        for label in differ:
            notes.setdefault(model, {}).setdefault(label, []).append(
                f"seed {seed}: val_loss on other validation examples than Vanilla's (those of {next(iter(configs))})")
        for label, scores in scoring.score_rows(store, profile, model, seed, COLUMNS, rows).items():
            if label in validation:
                scores["val_loss"] = validation[label]
            tables.tally(cells, model, label, scores, seed=seed)
    return cells, notes


def main(argv: list[str] | None = None) -> int:
    def options(parser):
        parser.add_argument("--methods", default=",".join(recipes.BASELINES), help="a comma-separated subset of the baselines")
        planning.add_arguments(parser)

    args, profile, store, command = command_line.start(__doc__, "baseline_recipes.py", argv, options)
    methods = command_line.listed(args.methods, "--methods")
    unknown = sorted(set(methods) - set(recipes.BASELINES))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {','.join(recipes.BASELINES)}")
    started = time.time()
    title = f"baseline recipes, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, methods), title, store, profile):
        return 0
    cells, notes = run(profile, store, methods)
    intro = ("Held-out TruthfulQA in %; n = test documents (val_loss: the loss on the validation examples each bundle "
             "selects on, n of them: D_train's validation slice, or D_ctrl's labelled hold-outs under validation=ctrl; "
             "Vanilla's on the first row's, and a note marks any row whose examples differ). "
             "adapted: this suite's setting; published: the authors' recipe (docs/baselines.md), the main table's "
             "(the same for every bundle, not chosen per bundle by val_loss; repro/engine/recipes.py says when and why it was "
             "fixed). The paper reports neither.")
    tables.write_tables(Path(args.out), "baseline_recipes", "Baselines under both training recipes (TruthfulQA)",
                        intro, cells, [c[0] for c in COLUMNS] + ["val_loss"], lambda model: ("(not reported)", {}),
                        profile, command, time.time() - started, store, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
