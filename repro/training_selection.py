"""How each baseline bundle of the main table chose what it kept, read from the bundles themselves (issue 55.2).

    python repro/training_selection.py [--profile quick|standard|budget|large|paper|smoke] [--runs DIR] [--out DIR]
                                       [--recipe published|adapted|published_head_score_auto]

Trains and evaluates nothing: it reads the main table's bundles (the same cache keys as the main
table's, repro/engine/recipes.py ``table_settings``) that are stored under --runs, each checked as
the main table checks it (repro/engine/cache.py), and names those not trained yet. For every bundle
of the methods that select on held-out data (CAA, ITI, NL-ITI, ReFT, LoRA):

* the validation loss of the configuration kept and the untouched model's on the same validation
  examples (``validation_loss_selected`` and ``validation_loss_base``, baselines/common.py), and
  whether the kept one does worse than no edit there;
* ITI's and NL-ITI's heads (baselines/iti_heads.py): K, the score that ranked them (``head_score``: plain
  accuracy, the authors', unless the recipe names another; the adapted recipe's balanced accuracy), the K-th
  head's probe score (cross-validated under ``head_selection=cv``) beside the share of the probe's rows in their
  majority class and how far above what no signal scores (plain accuracy: the majority share, ``above_majority``:
  rows, binomial standard errors, and whether the probe is told apart from it; balanced accuracy or AUROC: 0.5,
  ``above_chance``), how many heads tie at the K-th score and how many of those the seeded order chose, the
  selection's warnings, and the chosen heads;
* ReFT's and LoRA's training length: the validation loss after every epoch, the epoch kept, and
  whether the epoch kept is the last with the loss still falling into it (baselines/common.py
  ``still_falling_when_stopped``: a longer run might have kept a better one).

Writes OUT/training_selection.{json,md}.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from baselines.common import still_falling_when_stopped
from repro.analysis import tables
from repro.engine import command_line, recipes
from repro.engine.cache import Store
from repro.engine.profiles import BENCHMARKS, REPO, Profile, method_label

log = logging.getLogger("repro")

METHODS = ("caa", "iti", "nl_iti", "reft", "lora")  # those that record a validation loss for what they kept


def main_table_bundles(profile: Profile, store: Store, methods: tuple[str, ...] = METHODS,
                       recipe: str = recipes.MAIN_TABLE_RECIPE) -> tuple[list[tuple[str, int, str, str, Path]], list[dict]]:
    """([(model, seed, method, attribute, bundle directory)] stored under the store, [the others, by the same fields]):
    the main table's bundles of ``METHODS`` (its baselines in ``recipe``) under every seed its columns are scored under."""
    found, missing = [], []
    for model in profile.models:
        for seed, columns in profile.seeded_columns(BENCHMARKS).items():
            for method in methods:
                for attribute in sorted({c[3] for c in columns}):
                    final, config = store.bundle_target(method, attribute, model, seed, profile,
                                                        recipes.table_settings(method, profile, recipe))
                    if store.is_stored(final, config):
                        found.append((model, seed, method, attribute, final))
                    else:
                        damaged = (final / "bundle.json").is_file()  # there, but not what its record says
                        if damaged:
                            log.warning("%s does not match its record (repro/engine/cache.py): not read; the main table "
                                        "would train it again", final)
                        missing.append({"model": model, "seed": seed, "method": method, "attribute": attribute,
                                        "damaged": damaged})
    return found, missing


# The K-th head's probe is told apart from always answering the majority class when its accuracy is at least
# this many binomial standard errors of the majority share above it (``above_majority``).
MAJORITY_Z = 2.0


def above_majority(kth_accuracy: float, majority_accuracy: float | None, rows: int | None) -> dict | None:
    """How far the K-th head's probe accuracy is above the share of the majority class over ``rows`` probe
    rows: the excess in rows and in binomial standard errors of that share, sqrt(rows m (1 - m)), and
    whether it reaches ``MAJORITY_Z``. The rows of one question are not independent (several answers
    per question), so the true standard error is larger and a head this check tells apart may still not
    be; one it does not tell apart is not. None where the bundle records no majority share or rows."""
    if majority_accuracy is None or not rows:
        return None
    excess = (kth_accuracy - majority_accuracy) * rows
    spread = math.sqrt(rows * majority_accuracy * (1 - majority_accuracy))
    z = excess / spread if spread > 0 else math.inf if excess > 0 else 0.0
    return {"excess_rows": round(excess, 1), "z": round(z, 2), "told_apart": z >= MAJORITY_Z}


def above_chance(kth_score: float, score: str, rows: int | None, true_rows: int | None) -> dict | None:
    """How far the K-th head's balanced accuracy or AUROC is above 0.5, what a probe without signal
    scores, in standard errors of that score under no signal: balanced accuracy, 0.25 sqrt(1/n1 + 1/n0)
    (the mean of two recalls of a coin toss); AUROC, sqrt((n1 + n0 + 1) / (12 n1 n0)) (Mann-Whitney's
    null); whether it reaches ``MAJORITY_Z`` (the rows of one question are not independent, as in
    ``above_majority``). None where the bundle records no class counts or either class is empty."""
    if not rows or true_rows is None or not 0 < true_rows < rows:
        return None
    n1, n0 = true_rows, rows - true_rows
    spread = 0.25 * math.sqrt(1 / n1 + 1 / n0) if score == "balanced_accuracy" else math.sqrt((n1 + n0 + 1) / (12 * n1 * n0))
    z = (kth_score - 0.5) / spread
    return {"excess": round(kth_score - 0.5, 4), "z": round(z, 2), "told_apart": z >= MAJORITY_Z}


def head_score(diagnostics: dict, hyperparameters: dict) -> str:
    """The score that ranked a bundle's heads: recorded since issue 81.5; before it, plain accuracy in the
    published recipe and balanced accuracy in the adapted one (baselines/iti_heads.py)."""
    return diagnostics.get("head_score") or ("accuracy" if hyperparameters.get("recipe") == "published" else "balanced_accuracy")


def _heads(diagnostics: dict, hyperparameters: dict) -> dict | None:
    """ITI's and NL-ITI's choice of heads, as their bundles record it (baselines/iti_heads.py), with the
    K-th head's probe against what no signal scores (``above_majority``, ``above_chance``, computed here)."""
    if "boundary_accuracy" not in diagnostics:
        return None
    probe = diagnostics.get("probe_validation") or {}
    score, kth = head_score(diagnostics, hyperparameters), diagnostics["boundary_accuracy"]
    plain = score == "accuracy"
    return {"k": len(diagnostics.get("heads") or []), "selection": hyperparameters.get("head_selection"),
            "score": score, "score_setting": diagnostics.get("head_score_setting"),
            "kth_accuracy": kth, "majority_accuracy": probe.get("majority_accuracy"), "probe_rows": probe.get("rows"),
            "kth_above_majority": above_majority(kth, probe.get("majority_accuracy"), probe.get("rows")) if plain else None,
            "kth_above_chance": None if plain else above_chance(kth, score, probe.get("rows"), probe.get("true_rows")),
            "tied_at_kth": diagnostics.get("heads_tied_at_boundary"),
            "tied_chosen": diagnostics.get("tied_heads_chosen"), "warnings": list(diagnostics.get("selection_warnings") or []),
            "chosen": [{"layer": h["layer"], "head": h["head"], "accuracy": h["validation_accuracy"]}
                       for h in diagnostics.get("chosen_heads") or []]}


def _epochs(diagnostics: dict, hyperparameters: dict) -> dict | None:
    """ReFT's and LoRA's validation loss after every epoch and the epoch they kept."""
    history = diagnostics.get("history")
    if not isinstance(history, list) or "epoch_kept" not in hyperparameters:
        return None
    losses = [float(h["validation_loss"]) for h in history if h.get("validation_loss") is not None]
    return {"epochs": len(history), "epoch_kept": int(hyperparameters["epoch_kept"]), "validation_loss_by_epoch": losses,
            "selection": hyperparameters.get("epoch_selection") or ("best" if hyperparameters.get("recipe") != "published" else "last"),
            "still_falling_at_last": still_falling_when_stopped(hyperparameters, diagnostics) is not None}


def bundle_record(bundle: dict) -> dict:
    """What one bundle's bundle.json says of how it was selected."""
    diagnostics, hyperparameters = bundle.get("diagnostics") or {}, bundle.get("hyperparameters") or {}
    kept, untouched = diagnostics.get("validation_loss_selected"), diagnostics.get("validation_loss_base")
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (kept, untouched))
    return {"recipe": hyperparameters.get("recipe") or "adapted", "validation": hyperparameters.get("validation"),
            "validation_examples": len(diagnostics.get("validation_ids") or []),
            "loss_kept": kept, "loss_untouched": untouched, "worse_than_untouched": bool(finite and kept > untouched),
            "train_seconds": bundle.get("train_seconds"), "site": bundle.get("site"),
            "heads": _heads(diagnostics, hyperparameters), "epochs": _epochs(diagnostics, hyperparameters)}


def run(profile: Profile, store: Store, recipe: str = recipes.MAIN_TABLE_RECIPE) -> dict:
    found, missing = main_table_bundles(profile, store, recipe=recipe)
    rows = []
    for model, seed, method, attribute, directory in found:
        bundle = json.loads((directory / "bundle.json").read_text())
        rows.append({"model": model, "method": method, "attribute": attribute, "seed": seed, "bundle": directory.name,
                     **bundle_record(bundle)})
    return {"bundles": rows, "not_trained": missing}


def _over_majority(check: dict | None) -> str:
    if check is None:
        return "n/a"
    return f"{check['excess_rows']:+.0f} rows, z {check['z']:.2f}" + ("" if check["told_apart"] else ": not told apart")


def _over_bar(heads: dict) -> str:
    """The K-th head's probe over what no signal scores: the majority class (plain accuracy) or 0.5."""
    chance = heads.get("kth_above_chance")
    if chance is None:
        return _over_majority(heads.get("kth_above_majority"))
    return f"{chance['excess']:+.4f} over 0.5, z {chance['z']:.2f}" + ("" if chance["told_apart"] else ": not told apart")


def _score_name(heads: dict) -> str:
    setting = heads.get("score_setting")
    return heads["score"] + (f" ({setting})" if setting and setting != heads["score"] else "")


def _loss(value) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:.4f}"


def markdown(record: dict, command: str) -> str:
    rows, missing = record["bundles"], record["not_trained"]
    worse = [r for r in rows if r["worse_than_untouched"]]
    by_method = {}
    for r in rows:
        counts = by_method.setdefault(method_label(r["method"]), [0, 0])
        counts[0] += r["worse_than_untouched"]
        counts[1] += 1
    lines = [f"# How each baseline bundle chose what it kept (profile {record['profile']})", "",
             f"Generated by `{command}` from the bundles stored under `{record['runs']}` ({len(rows)} bundles; "
             f"{len(missing)} of the main table's not trained yet). Read from each bundle's record: nothing is trained "
             "or evaluated here, and no test document is involved. Losses are the task loss on the bundle's validation "
             "examples (n), the configuration kept against the untouched model on the same examples "
             "(baselines/common.py); each seed has its own examples.", "",
             f"Kept configuration worse than no edit on validation: {len(worse)} of {len(rows)} bundles"
             + (" (" + ", ".join(f"{m} {w} of {n}" for m, (w, n) in by_method.items()) + ")" if rows else "") + ".", "",
             "## Validation loss of what was kept", ""]
    lines.append(tables.markdown_table(
        ["method", "attribute", "seed", "recipe", "validation (n)", "untouched", "kept", "kept - untouched", ""],
        [[method_label(r["method"]), r["attribute"], str(r["seed"]), r["recipe"], f"{r['validation']} ({r['validation_examples']})",
          _loss(r["loss_untouched"]), _loss(r["loss_kept"]),
          "n/a" if not isinstance(r["loss_kept"], (int, float)) or not isinstance(r["loss_untouched"], (int, float))
          else f"{r['loss_kept'] - r['loss_untouched']:+.4f}", "worse than no edit" if r["worse_than_untouched"] else ""]
         for r in rows]))
    heads = [r for r in rows if r["heads"]]
    if heads:
        lines += ["", "## ITI's and NL-ITI's heads", "",
                  "K heads by their probes' score (`score`: plain accuracy, the authors', unless the recipe's head_score "
                  "names another, its setting in brackets; cross-validated over D_train grouped by question under `cv`); "
                  "the K-th head's score beside the share of the probe's rows in their majority class, and how far above "
                  "what no signal scores (plain accuracy: the majority share, in rows and binomial standard errors z of it; "
                  "balanced accuracy or AUROC: 0.5, in standard errors of the score under no signal; 'not told apart' below "
                  f"z = {MAJORITY_Z:g}, a generous bound: rows of one question are not independent); heads tied at the K-th "
                  "score, and how many of them the seeded order chose; chosen heads as layer.head (score).", ""]
        checked = [r for r in heads if r["heads"].get("kth_above_majority") or r["heads"].get("kth_above_chance")]
        near = [r for r in checked if not (r["heads"].get("kth_above_majority") or r["heads"]["kth_above_chance"])["told_apart"]]
        lines += ["K-th head's probe not told apart from always answering the majority class (plain accuracy) or from 0.5 "
                  f"(balanced accuracy, AUROC): {len(near)} of {len(checked)} bundles"
                  + (" (" + ", ".join(f"{method_label(r['method'])} {r['attribute']} seed {r['seed']}" for r in near) + ")"
                     if near else "") + ".", ""]
        lines.append(tables.markdown_table(
            ["method", "attribute", "seed", "selection", "score", "K", "K-th score", "majority class", "rows",
             "K-th over its bar", "tied at K-th (chosen)", "warnings", "chosen heads"],
            [[method_label(r["method"]), r["attribute"], str(r["seed"]), str(h["selection"]), _score_name(h), str(h["k"]),
              f"{h['kth_accuracy']:.4f}", "n/a" if h["majority_accuracy"] is None else f"{h['majority_accuracy']:.4f}",
              str(h["probe_rows"]), _over_bar(h),
              f"{h['tied_at_kth']} ({h['tied_chosen']})", "; ".join(h["warnings"]) or "none",
              ", ".join(f"{c['layer']}.{c['head']} ({c['accuracy']:.3f})" for c in h["chosen"])]
             for r in heads for h in [r["heads"]]]))
    epochs = [r for r in rows if r["epochs"]]
    if epochs:
        lines += ["", "## ReFT's and LoRA's training length", "",
                  "The validation loss after every epoch, the kept epoch's in bold; 'still falling': the epoch kept is the "
                  "last and the loss still fell into it, so a longer run might have kept a better one.", ""]
        lines.append(tables.markdown_table(
            ["method", "attribute", "seed", "selection", "epochs", "kept", "validation loss by epoch", ""],
            [[method_label(r["method"]), r["attribute"], str(r["seed"]), e["selection"], str(e["epochs"]), str(e["epoch_kept"]),
              ", ".join(f"**{v:.4f}**" if i + 1 == e["epoch_kept"] else f"{v:.4f}" for i, v in enumerate(e["validation_loss_by_epoch"])),
              "still falling" if e["still_falling_at_last"] else ""]
             for r in epochs for e in [r["epochs"]]]))
    if missing:
        lines += ["", "## Not trained yet", ""]
        groups: dict[tuple, list[str]] = {}
        for m in missing:
            groups.setdefault((m["model"], m["seed"]), []).append(
                f"{method_label(m['method'])} {m['attribute']}" + (" (stored but damaged: not read)" if m["damaged"] else ""))
        every = len(METHODS) * len({m["attribute"] for m in [*missing, *rows]})
        lines += [f"- {model}, seed {seed}: " + ("every bundle" if len(names) == every else ", ".join(names))
                  for (model, seed), names in groups.items()]
    return "\n".join(lines) + "\n"


def _arguments(parser) -> None:
    parser.add_argument("--recipe", default=recipes.MAIN_TABLE_RECIPE, choices=recipes.RECIPES,
                        help="the baselines' recipe whose main-table bundles to read (default: %(default)s; "
                             "repro/engine/recipes.py)")


def main(argv: list[str] | None = None) -> int:
    args, profile, store, command = command_line.start(__doc__, "training_selection.py", argv, _arguments)
    started = time.time()
    runs = Path(args.runs).resolve()
    record = {"command": command, "profile": profile.name, "seeds": profile.seeds, "max_train": profile.max_train,
              "max_ctrl": profile.max_ctrl, "runs": str(runs.relative_to(REPO) if runs.is_relative_to(REPO) else runs),
              **({"recipe": args.recipe} if args.recipe != recipes.MAIN_TABLE_RECIPE else {}), **run(profile, store, args.recipe)}
    record["wall_time_s"] = round(time.time() - started, 1)
    tables.write_record(Path(args.out) / "training_selection", record, markdown(record, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
