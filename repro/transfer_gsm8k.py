"""Table 3: the TruthfulQA-trained MARI on GSM8K at several gate quantiles rho.

    python repro/transfer_gsm8k.py [--profile quick|standard|large|paper|smoke] [--model ID] [--rhos 0.5,0.7,0.9,1.0]
        [--labellings loss,source]
    python repro/transfer_gsm8k.py --plan --profile paper  # its steps and their cost; runs nothing

tau_E is recomputed from the TruthfulQA bundle's own control energies for each rho
(``rho=`` model arg): rho = 1.0 puts tau_E at the largest non-applicable control energy,
so the gate opens only above every one of them. Rows: Vanilla and rho in {0.5, 0.7,
0.9, 1.0}, under each applicability labelling of the control set (``labels=``, no
retraining; mari_eval/mari/gate_labels.py): ``loss`` (the paper's text; rows "rho=0.50") and
``source`` (rows "rho=0.50, labels=source"), the reading under which the paper's Table 3
(its TruthfulQA gain kept up to rho = 1.0) is reachable at all. Columns: held-out TruthfulQA MC1 and GSM8K exact match (5-shot, through
lm-eval), each with its change from Vanilla, and the fraction of each benchmark's
documents on which the gate opened. Writes results/transfer_gsm8k.{json,md,tex}.
The paper reports Table 3 for Llama-3-8B.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from mari_eval.mari.gate_labels import LABELINGS
from repro.engine import cache, command_line, planning, profiles, scoring, steps
from repro.analysis import tables
from repro.ablation_table import labels_args

RHOS = [0.5, 0.7, 0.9, 1.0]
LABELLINGS = ["loss", "source"]
COLUMNS = [("tqa_mc1", "truthfulqa_mc1_heldout", "acc,none", "truthfulqa"),
           ("gsm8k", "gsm8k", "exact_match,strict-match", "truthfulqa")]
GATE_COLUMNS = {"gate_tqa": "tqa_mc1", "gate_gsm8k": "gsm8k"}  # how often the gate opened there (ours only)


def row_label(rho: float, labels: str) -> str:
    """"rho=0.90" under the bundle's own labels (the paper's rows), "rho=0.90, labels=source" otherwise."""
    return f"rho={rho:.2f}" + ("" if labels == "loss" else f", labels={labels}")


def rows_of(bundle: Path, rhos: list[float], labellings: list[str]) -> dict[str, scoring.Row]:
    """Vanilla, then the TruthfulQA bundle at each rho under each labelling."""
    return {"Vanilla": ({}, ""), **{row_label(rho, labels): ({"truthfulqa": bundle},
                                                              ",".join(filter(None, [f"rho={rho}", labels_args(labels)])))
                                    for labels in labellings for rho in rhos}}


def plan(profile: profiles.Profile, store: cache.Store, rhos: list[float] = RHOS,
         labellings: list[str] = LABELLINGS) -> steps.Graph:
    """``run``'s work as a graph of steps (repro/engine/planning.py): the TruthfulQA bundle, then the rows' evaluations."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            bundle = planning.train_step(graph, store, profile, "mari", "truthfulqa", model, seed)
            planning.evaluation_steps(graph, store, profile, model, seed, COLUMNS, rows_of(bundle, rhos, labellings),
                                      {bundle: "mari"})
    return graph


def run(profile: profiles.Profile, store: cache.Store, rhos: list[float] = RHOS,
        labellings: list[str] = LABELLINGS) -> dict:
    cells: dict = {}
    for model, seed in tqdm([(m, s) for m in profile.models for s in profile.seeds], desc="gsm8k transfer", unit="seed"):
        rows = rows_of(store.bundle("mari", "truthfulqa", model, seed, profile), rhos, labellings)
        for label, scores in scoring.score_rows(store, profile, model, seed, COLUMNS, rows).items():
            tables.tally(cells, model, label, tables.add_gate_rates(scores, GATE_COLUMNS), seed=seed)
    for by_label in cells.values():  # the change from Vanilla, per seed
        base = by_label["Vanilla"]
        for by_column in by_label.values():
            for column in [c[0] for c in COLUMNS]:
                by_column[f"{column}_delta"] = {
                    "values": [v - b for v, b in zip(by_column[column]["values"], base[column]["values"])],
                    "n": by_column[column]["n"]}
    return cells


def paper_figures(model: str):
    return "Llama-3-8B", {r["setting"]: r for r in tables.paper_rows("table3_transfer")}


def main(argv: list[str] | None = None) -> int:
    def options(parser):
        parser.add_argument("--rhos", default=",".join(map(str, RHOS)))
        parser.add_argument("--labellings", default=",".join(LABELLINGS), help="applicability labellings of the rho sweep")
        planning.add_arguments(parser)

    args, profile, store, command = command_line.start(__doc__, "transfer_gsm8k.py", argv, options)
    labellings = command_line.listed(args.labellings, "--labellings")
    unknown = [name for name in labellings if name not in LABELINGS]
    if unknown:
        raise SystemExit(f"--labellings: {', '.join(unknown)} unknown; use some of {', '.join(LABELINGS)}")
    started = time.time()
    rhos = command_line.listed(args.rhos, "--rhos", float)
    title = f"gsm8k transfer, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, rhos, labellings), title, store, profile):
        return 0
    cells = run(profile, store, rhos, labellings)
    intro = ("Scores in %; gate columns (ours only): fraction of documents on which the gate opened. The MARI "
             "bundle is trained on TruthfulQA; GSM8K is answered under it (5-shot, greedy, strict exact match). "
             "Rows without a labels tag calibrate tau_E on the bundle's `loss` labels (the paper's text); "
             "`labels=source` rows on the control sources. "
             "The paper's Table 3 is for Llama-3-8B.")
    columns = ["tqa_mc1", "tqa_mc1_delta", "gsm8k", "gsm8k_delta"] + list(GATE_COLUMNS)
    tables.write_tables(Path(args.out), "transfer_gsm8k", "Table 3: GSM8K transfer", intro, cells, columns,
                        paper_figures, profile, command, time.time() - started, store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
