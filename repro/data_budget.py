"""How many labelled examples each row of the main table reads, counted from its bundles (issue 81.2).

    python repro/data_budget.py --profile budget --runs results/budget_steps --out results/profiles/budget

Trains and evaluates nothing: it reads the main table's stored bundles (repro/training_selection.py
``main_table_bundles``) and counts, per method, attribute and seed, from each bundle's record:

* ``train``: labelled D_train examples the method fits on (``splits.train_used``; Prompting fits nothing:
  its instruction is fixed per attribute);
* ``ctrl_selection``: labelled held-out examples the method *chooses* with (``validation_examples`` of
  D_ctrl or D_train's validation slice), counted only where the record shows a choice made on them: an
  epoch kept by validation loss (ReFT with ``epoch_selection=best``, LoRA), heads chosen on validation
  (ITI/NL-ITI ``head_selection=validation``); a validation loss computed and only reported is ``ctrl_reported``;
* ``ctrl_calibration``: MARI's gate calibration set (``gate.n_ctrl``, by source: held-out attribute
  examples, ARC-Easy, MMLU, and with ``gate_requests`` Self-Instruct seed tasks), labelled under the
  ``loss`` and ``flip`` readings, whose labels come from each example's gold answer;
* ``pca``: MARI's unlabelled D_pca prompts (the gate's subspace), counted apart.

Writes OUT/data_budget.{json,md}, whose Markdown ends with the budget sentence written from the counts.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from repro.analysis import tables
from repro.engine import command_line
from repro.engine.cache import Store
from repro.engine.profiles import Profile, method_label
from repro.training_selection import main_table_bundles

METHODS = ("prompting", "caa", "iti", "nl_iti", "reft", "lora", "mari")
FITS_NOTHING = {"prompting"}  # an instruction fixed per attribute (baselines/prompting.py)


def selects_on_validation(method: str, hyperparameters: dict, diagnostics: dict) -> bool:
    """Whether the bundle's record shows a choice made on its validation examples (see the module docstring)."""
    if method in ("iti", "nl_iti"):
        return hyperparameters.get("head_selection") == "validation"
    if method in ("reft", "lora"):
        epochs = len(diagnostics.get("history") or [])
        return epochs > 1 and hyperparameters.get("epoch_selection", "best") == "best" and "epoch_kept" in hyperparameters
    return False


def count(method: str, bundle: dict) -> dict:
    """The labelled (and unlabelled) examples one bundle read, by role."""
    splits, hp = bundle.get("splits") or {}, bundle.get("hyperparameters") or {}
    diagnostics, gate = bundle.get("diagnostics") or {}, bundle.get("gate") or {}
    validation = int(hp.get("validation_examples") or len(diagnostics.get("validation_ids") or []))
    selects = selects_on_validation(method, hp, diagnostics)
    sources = Counter(gate.get("ctrl_sources") or [])
    return {"train": 0 if method in FITS_NOTHING else len(splits.get("train_used") or splits.get("train") or []),
            "ctrl_selection": validation if selects else 0, "ctrl_reported": 0 if selects else validation,
            "validation_from": hp.get("validation") or ("D_train" if validation else None),
            "ctrl_calibration": int(gate.get("n_ctrl") or 0) if method == "mari" else 0,
            "ctrl_calibration_sources": dict(sources) if method == "mari" else {},
            "pca": (int(splits.get("max_pca") or len(splits.get("pca") or [])) if method == "mari" else 0)}


def run(profile: Profile, store: Store) -> dict:
    found, missing = main_table_bundles(profile, store, METHODS)
    rows = []
    for model, seed, method, attribute, path in found:
        bundle = json.loads((path / "bundle.json").read_text())
        rows.append({"model": model, "seed": seed, "method": method, "attribute": attribute, "bundle": path.name,
                     **count(method, bundle)})
    return {"rows": rows, "missing": missing}


def _labelled(row: dict) -> int:
    return row["train"] + row["ctrl_selection"] + row["ctrl_calibration"]


def sentence(rows: list[dict]) -> str:
    """The budget sentence, from the counts: per method the labelled examples read per bundle (range over
    attributes and seeds), what of them came from held-out data, and MARI's unlabelled prompts."""
    parts = []
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        low, high = min(map(_labelled, mine)), max(map(_labelled, mine))
        held = sorted({r["ctrl_selection"] + r["ctrl_calibration"] for r in mine})
        span = f"{low}" if low == high else f"{low}-{high}"
        text = f"{method_label(method)} {span} labelled examples per bundle"
        if any(held):
            text += f" ({'/'.join(map(str, held))} of them held out, for {'calibration' if method == 'mari' else 'selection'})"
        if method == "mari":
            text += f" and {'/'.join(map(str, sorted({r['pca'] for r in mine})))} unlabelled D_pca prompts"
        parts.append(text)
    return ("Labelled examples each method reads (repro/data_budget.py, counted from the main table's bundles): "
            + "; ".join(parts) + ". The budget is not one for every method: only MARI reads labelled general-capability "
            "examples (its gate's calibration), and only methods that choose an epoch or heads on held-out data read "
            "its attribute examples to select.")


def markdown(record: dict) -> str:
    headers = ["method", "attribute", "seed", "train", "held-out, selection", "held-out, reported only",
               "calibration (by source)", "D_pca (unlabelled)", "labelled in all"]
    body = [[method_label(r["method"]), r["attribute"], str(r["seed"]), str(r["train"]), str(r["ctrl_selection"]),
             str(r["ctrl_reported"]),
             f"{r['ctrl_calibration']} ({', '.join(f'{k} {v}' for k, v in r['ctrl_calibration_sources'].items())})"
             if r["ctrl_calibration"] else "0", str(r["pca"]), str(_labelled(r))] for r in record["rows"]]
    missing = "".join(f"\nNot trained yet: {m}" for m in record["missing"])
    return (f"# Labelled examples each row reads\n\nGenerated by `{record['command']}` from the bundles' records "
            f"(profile {record['profile']}).\n\n" + tables.markdown_table(headers, body) + "\n" + missing
            + "\n\n" + record["sentence"] + "\n")


def main(argv: list[str] | None = None) -> int:
    args, profile, store, command = command_line.start(__doc__, "data_budget.py", argv)
    started = time.time()
    record = {"command": command, "profile": profile.name, **run(profile, store)}
    record["sentence"] = sentence(record["rows"])
    record["seconds"] = round(time.time() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables.write_record(out / "data_budget", record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
