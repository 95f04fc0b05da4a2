"""Table 2: MARI's ablations, ours beside the paper's.

    python repro/ablation_table.py [--profile quick|standard|large|paper|smoke] [--model ID] [--seeds 0,1,2]
    python repro/ablation_table.py --plan --profile paper  # its steps and their cost; runs nothing

Rows: Vanilla; w/o Energy Gating (the routed experts on every input, ``gate=false``);
w/o Multi-Adapter (the single adapter trained beside the experts, gated with its own
threshold, ``experts=single``); EG-MARI (the full method, its gate calibrated on the
``loss`` applicability labels, the paper's text); and EG-MARI with tau_E recalibrated on the
``flip`` and ``source`` labels (``labels=``, no retraining; the paper is ambiguous about which
examples are non-applicable: see mari_eval/mari/gate_labels.py). Columns: every column of the
main table, MMLU and ARC under each attribute's bundle. Besides every row's difference from
Vanilla, EG-MARI is compared with the single adapter on the same documents
(``COMPARISONS``). The MARI bundles are the main table's (same cache under runs/), so running
both trains each bundle once. Writes results/ablation_table.{json,md,tex}. The paper reports
Table 2 for Llama-3-8B, Qwen2.5-14B and -32B.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from repro.engine import cache, command_line, planning, profiles, scoring, steps
from repro.analysis import gate_open, tables
from repro.engine.profiles import BENCHMARKS, GENERAL_UNDER_OTHERS, KEYWORD_REFUSAL, XSTEST

# The keyword rate needs no judge: the SORRY-Bench column a reader can use. MMLU and ARC also run
# under the BBQ and SORRY-Bench bundles (GENERAL_UNDER_OTHERS); XSTest's over-refusal under the SORRY-Bench
# one, where the calibrations differ most (issue 81.2).
COLUMNS = BENCHMARKS + [KEYWORD_REFUSAL] + GENERAL_UNDER_OTHERS + XSTEST


def labels_args(labels: str) -> str:
    """The model args of EG-MARI with its gate calibrated on ``labels`` (the bundle's own, loss: none)."""
    return "" if labels == "loss" else f"labels={labels}"


VARIANTS = {  # row label (the paper's, then ours) -> MariLM model_args; None: the base model
    "Vanilla": None,
    "w/o Energy Gating": "gate=false",
    "w/o Multi-Adapter": "experts=single",
    "EG-MARI": labels_args("loss"),
    "EG-MARI (labels=flip)": labels_args("flip"),
    "EG-MARI (labels=source)": labels_args("source"),
}
# A gate calibration that can tell requests apart (issue 81.2; ours, not the paper's): EG-MARI whose D_ctrl
# adds REQUESTS of Self-Instruct's human-written seed tasks beside ARC-Easy and MMLU as general controls
# (MARI's gate_requests; training.examples.REQUEST_SOURCE). Its own bundles, trained with that setting; the
# experts and probe train as the default bundle's (same seed; D_ctrl is read by the calibration alone).
REQUESTS = 100
REQUEST_ROWS = {"EG-MARI (requests in D_ctrl)": ""}


# The paper's claim that several experts beat one, tested directly (issue 36.7): EG-MARI against the
# single adapter on the same documents (K = 1 against K = 4 is in repro/sensitivity.py).
COMPARISONS = [("EG-MARI", "w/o Multi-Adapter"), ("EG-MARI (requests in D_ctrl)", "EG-MARI")]


def _rows(trained: dict, requests: dict) -> dict:
    """Every row: its bundle per attribute ({}: the base model) and its model args."""
    rows = {label: ({} if args is None else trained, args or "") for label, args in VARIANTS.items()}
    return {**rows, **{label: (requests, args) for label, args in REQUEST_ROWS.items()}}


def plan(profile: profiles.Profile, store: cache.Store, columns=COLUMNS) -> steps.Graph:
    """``run``'s work as a graph of steps (repro/engine/planning.py): MARI's bundles, then the rows' evaluations."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            attributes = sorted({c[3] for c in columns})
            trained = {a: planning.train_step(graph, store, profile, "mari", a, model, seed) for a in attributes}
            requests = {a: planning.train_step(graph, store, profile, "mari", a, model, seed, {"gate_requests": REQUESTS})
                        for a in attributes}
            planning.evaluation_steps(graph, store, profile, model, seed, columns, _rows(trained, requests),
                                      {bundle: "mari" for bundle in [*trained.values(), *requests.values()]})
    return graph


def run(profile: profiles.Profile, store: cache.Store, columns=COLUMNS) -> tuple[dict, dict]:
    """(the table's cells, each gated row's open rate per evaluation set and seed: repro/analysis/gate_open.py)."""
    cells: dict = {}
    gates: dict = {}
    for model, seed in tqdm([(m, s) for m in profile.models for s in profile.seeds], desc="ablation", unit="seed"):
        attributes = sorted({c[3] for c in columns})
        trained = {a: store.bundle("mari", a, model, seed, profile) for a in attributes}
        requests = {a: store.bundle("mari", a, model, seed, profile, {"gate_requests": REQUESTS}) for a in attributes}
        for label, scores in scoring.score_rows(store, profile, model, seed, columns, _rows(trained, requests)).items():
            tables.tally(cells, model, label, scores, seed=seed)
            gate_open.add(gates, model, label, seed, profile, columns, scores)
    return cells, gates


def paper_figures(model: str):
    """The paper's Table 2 rows for the paper model closest to ``model`` that it ablates (Llama-3-8B,
    Qwen2.5-14B, Qwen2.5-32B)."""
    rows = tables.paper_rows("table2_ablation")
    closest = profiles.CLOSEST_PAPER_MODEL.get(model)
    paper_model = closest if any(r["model"] == closest for r in rows) else "Llama-3-8B"
    return paper_model, {r["variant"]: r for r in rows if r["model"] == paper_model}


def main(argv: list[str] | None = None) -> int:
    args, profile, store, command = command_line.start(__doc__, "ablation_table.py", argv, planning.add_arguments)
    started = time.time()
    columns = command_line.select(COLUMNS, args.columns)
    title = f"ablation table, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, columns), title, store, profile):
        return 0
    cells, gates = run(profile, store, columns)
    intro = ("Ours: mean ± std over seeds; n = test documents per cell. The paper ablates Llama-3-8B and "
             "Qwen2.5-14B/32B; its column is Llama-3-8B here: a different, far larger model.")
    tables.write_tables(Path(args.out), "ablation_table", "Table 2: ablations", intro, cells,
                        [c[0] for c in columns], paper_figures, profile, command, time.time() - started, store,
                        comparisons=COMPARISONS, gate_open=gates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
