"""MARI's diagnostics: expert usage, control energies (applicable vs not), gate rate and the
routing agreement of Appendix C.2, for each attribute's bundle; and, under each applicability
labelling of the control set (loss, flip, source: mari_eval.mari.gate_labels), how well energy
separates applicable from non-applicable examples (AUROC, across and within sources) and
the gate rate on every test task of the main table; and the gate's open rate on each evaluation set the
main table's MARI row reads (issue 81.1: each attribute's held-out test, and where the profile scores them
XSTest's safe and unsafe prompts, the benign requests and the KL texts in and out of source).

    python repro/diagnostics.py [--profile quick|standard|large|paper|smoke] [--model ID]
    python repro/diagnostics.py --plan --profile paper  # its steps and their cost; runs nothing

For each attribute (the main table's MARI bundles, same cache under runs/): the held-out
task evaluated with the gate (gate rate, expert usage among opened gates) and without it
(expert usage, and routing agreement: among questions that some expert answers
correctly, how often the entropy-chosen expert is one of them). The control energies
and tau_E come from the bundle itself; the gate rates per labelling come from the
evaluations of the ablation table's EG-MARI rows (same cache: run ablation_table.py first
and nothing is recomputed). Writes results/diagnostics.{json,md} and
results/diagnostics_energy.png (energy histograms per source and label, with tau_E, one
row of panels per labelling).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from mari_eval.storage.files import atomic_write, write_results_json
from mari_eval.mari.equations import energy_threshold
from mari_eval.mari.gate_labels import LABELINGS
from mari_eval.methods import load_bundle
from repro.engine import cache, command_line, planning, profiles, scoring, steps
from repro.analysis import gate_open, tables
from repro.ablation_table import labels_args
from repro.engine.profiles import (BENCHMARKS, BENIGN_REFUSAL, BENIGN_TEXT, GENERAL_TEXT, GENERAL_UNDER_OTHERS,
                                   KEYWORD_REFUSAL, XSTEST)

TASKS = {"truthfulqa": ("tqa_mc2", "truthfulqa_mc2_heldout", "acc,none", "truthfulqa"),
         "bbq": ("bbq_acc", "bbq_disambig_heldout", "acc,none", "bbq"),
         "sorry_bench": KEYWORD_REFUSAL}
ATTRIBUTE_TESTS = [c for c in BENCHMARKS if c[0] in ("tqa_mc1", "tqa_mc2", "bbq_acc")] + [KEYWORD_REFUSAL]


def gate_columns(profile: profiles.Profile) -> list[tuple]:
    """The columns whose evaluation sets the gate's open rate is read on: each attribute's held-out test, and the
    over-refusal and KL columns the profile scores (``more_columns``): the main table's MARI row's evaluations."""
    return ATTRIBUTE_TESTS + [c for c in XSTEST + BENIGN_REFUSAL + GENERAL_TEXT + BENIGN_TEXT if c[0] in profile.more_columns]


def plan(profile: profiles.Profile, store: cache.Store, columns=BENCHMARKS + GENERAL_UNDER_OTHERS) -> steps.Graph:
    """``run``'s work as a graph of steps (repro/engine/planning.py): MARI's bundles; each bundle's task
    with and without its gate; every column under each labelling (the ablation's EG-MARI rows)."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            trained = {a: planning.train_step(graph, store, profile, "mari", a, model, seed)
                       for a in sorted(set(TASKS) | {c[3] for c in columns})}
            method_of = {bundle: "mari" for bundle in trained.values()}
            own = {"with gate": (trained, ""), "without gate": (trained, "gate=false")}
            planning.evaluation_steps(graph, store, profile, model, seed, list(TASKS.values()), own, method_of,
                                      "each bundle's task")
            by_labels = {name: (trained, labels_args(name)) for name in LABELINGS}
            planning.evaluation_steps(graph, store, profile, model, seed, columns, by_labels, method_of,
                                      "gate rates per labelling")
            planning.evaluation_steps(graph, store, profile, model, seed, gate_columns(profile), {"MARI": (trained, "")},
                                      method_of, "gate open per evaluation set")
    return graph


def run(profile: profiles.Profile, store: cache.Store, columns=BENCHMARKS + GENERAL_UNDER_OTHERS) -> dict:
    out: dict = {}
    gate_rates: dict = {}
    gates: dict = {}  # the main table's MARI row's evaluations (repro/analysis/gate_open.py)
    bundle_steps = [(m, s, a) for m in profile.models for s in profile.seeds for a in TASKS]
    for model, seed, attribute in tqdm(bundle_steps, desc="diagnostics", unit="bundle"):
        bundle_dir = store.bundle("mari", attribute, model, seed, profile)
        bundle = load_bundle(bundle_dir)
        column = TASKS[attribute]
        gated = scoring.score(store, profile, model, seed, [column], {attribute: bundle_dir})[column[0]]
        ungated = scoring.score(store, profile, model, seed, [column], {attribute: bundle_dir}, "gate=false")[column[0]]
        separation = bundle.control_separation()  # the labellings this bundle holds
        labels = {name: bundle.applicable(name) for name in separation}
        taus = {name: energy_threshold(bundle.tensors["ctrl_energy"], applicable, bundle.rho)
                for name, applicable in labels.items()}
        labels = {name: applicable.tolist() for name, applicable in labels.items()}
        out.setdefault(model, {})[f"{attribute} (seed {seed})"] = {
            "task": column[1], "n": gated["n"], "rho": bundle.rho, "tau_E": taus["loss"], "tau_E_by_labels": taus,
            "ctrl_energy": bundle.tensors["ctrl_energy"].tolist(), "ctrl_sources": bundle.ctrl_sources,
            "ctrl_applicable": labels["loss"], "ctrl_labels": labels, "separation": separation,
            "with_gate": gated["diagnostics"], "without_gate": ungated["diagnostics"],
            "metric_with_gate": gated["value"], "metric_without_gate": ungated["value"],
        }
    for model in profile.models:
        for seed in profile.seeds:
            bundles = {a: store.bundle("mari", a, model, seed, profile) for a in sorted({c[3] for c in columns})}
            for name in LABELINGS:  # the ablation's EG-MARI rows: the same evaluations
                scores = scoring.score(store, profile, model, seed, columns, bundles, labels_args(name))
                tables.tally(gate_rates, model, name, {column: {"value": (r["diagnostics"] or {}).get("gate_rate"),
                                                                "n": r["n"]} for column, r in scores.items()})
            trained = {a: store.bundle("mari", a, model, seed, profile) for a in sorted({c[3] for c in gate_columns(profile)})}
            scores = scoring.score(store, profile, model, seed, gate_columns(profile), trained)
            gate_open.add(gates, model, "MARI", seed, profile, gate_columns(profile), scores)
    return {"bundles": out, "gate_rates": gate_rates, "gate_open": gates}


def markdown(result: dict, command: str, wall: float, cost: str) -> str:
    diag = result["bundles"]
    lines = ["# MARI diagnostics\n", f"Generated by `{command}` in {wall:.0f} s; {cost}.\n",
             "Applicability labels here: `loss` (the bundle's own, the paper's text); see the tables below for "
             "`flip` and `source` (mari_eval/mari/gate_labels.py).\n"]
    rows = []
    for model, bundles in diag.items():
        for name, d in bundles.items():
            on, off = d["with_gate"] or {}, d["without_gate"] or {}
            usage = lambda s: ", ".join(f"{k}: {v:.2f}" for k, v in (s.get("expert_usage") or {}).items())
            energies = [e for e, a in zip(d["ctrl_energy"], d["ctrl_applicable"]) if a], \
                       [e for e, a in zip(d["ctrl_energy"], d["ctrl_applicable"]) if not a]
            med = lambda xs: f"{sorted(xs)[len(xs) // 2]:.1f}" if xs else "-"
            rate = lambda s: "-" if s.get("gate_rate") is None else f"{s['gate_rate']:.2f}"
            agree = off.get("routing_agreement")
            agreement = "-" if agree is None else f"{agree:.2f} (n={off.get('routing_agreement_n')})"
            rows.append([model, name, f"{d['task']} ({d['n']})", rate(on), usage(on), usage(off), agreement,
                         f"{d['tau_E']:.1f}", f"{med(energies[0])} / {med(energies[1])}"])
    lines.append(tables.markdown_table(["model", "bundle", "task (n)", "gate rate", "expert usage (gate on)",
                                        "expert usage (gate off)", "routing agreement (gate off)", "tau_E",
                                        "control energy median: applicable / not"], rows))
    lines += ["\n## How well energy separates applicable from non-applicable control examples\n",
              "AUROC: the probability that an applicable D_ctrl example has a higher energy than a non-applicable "
              "one (1: energy alone separates them; 0.5: chance; - where one class is empty). tau_E: the bundle's "
              "rho-quantile of the non-applicable energies under that labelling.\n"]
    rows = []
    auroc = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for model, bundles in diag.items():
        for name, d in bundles.items():
            for labels, sep in d["separation"].items():
                n = sep["n_applicable"] + sep["n_non_applicable"]
                within = "; ".join(f"{source}: {auroc(w['auroc'])} ({w['n_applicable']}/{w['n']})"
                                   for source, w in (sep.get("within_source") or {}).items())
                rows.append([model, name, labels, f"{sep['n_applicable']} / {n}", f"{d['tau_E_by_labels'][labels]:.1f}",
                             auroc(sep["auroc"]), within])
    lines.append(tables.markdown_table(["model", "bundle", "labels", "applicable / n", "tau_E", "AUROC (all)",
                                        "AUROC within: applicable / n per source"], rows))
    columns = list(next(iter(next(iter(result["gate_rates"].values())).values())))
    lines += ["\n## Gate rate on every test task, per labelling\n",
              "The fraction of each task's documents on which the gate opened (EG-MARI at the bundle's rho; the "
              "main table's bundle for each column's attribute: TruthfulQA's for mmlu, arc_e and arc_c; BBQ's and SORRY-Bench's for the columns marked @bbq and @sorry).\n"]
    rows = []
    for model, by_labels in result["gate_rates"].items():
        for labels, rates in by_labels.items():
            cells = []
            for column in columns:
                values = [v for v in rates[column]["values"] if v is not None]
                mean = tables.mean_std(values)[0] if values else float("nan")
                cells.append(f"{tables.fmt(mean, None)} (n={rates[column]['n']})")
            rows.append([model, labels, *cells])
    lines.append(tables.markdown_table(["model", "labels", *columns], rows))
    lines += ["\n## Gate open rate on each evaluation set\n",
              "The share of each evaluation set's documents on which the gate of the main table's MARI row opened (its "
              "bundle's own labels), per seed: TASK@TAG is the task under the TruthfulQA (tqa), BBQ or SORRY-Bench "
              "(sorry) bundle. general_text is exam text (in source for the gate's calibration), benign_text and "
              "benign_instructions Self-Instruct's requests (out of source); the KL texts record it since issue 81.\n",
              tables.markdown_table(gate_open.HEADERS, gate_open.rows(result.get("gate_open") or {}))]
    return "\n".join(lines) + "\n"


# One colour per (control source, applicable) in every panel.
COLORS = {("attribute", True): "tab:green", ("attribute", False): "tab:red",
          ("arc_easy", True): "tab:blue", ("arc_easy", False): "tab:orange",
          ("mmlu", True): "tab:purple", ("mmlu", False): "tab:brown"}


def plot(diag: dict, path: Path) -> None:
    """One column per bundle, one row per labelling: D_ctrl energies by source and label, and tau_E."""
    import numpy as np  # deferred: numpy is heavy; only this path needs it

    plt = tables.pyplot()
    panels = [(model, name, d) for model, bundles in diag.items() for name, d in bundles.items()]
    fig, axes = plt.subplots(len(LABELINGS), len(panels), figsize=(4 * len(panels), 3 * len(LABELINGS)), squeeze=False)
    for col, (model, name, d) in enumerate(panels):
        sources = d["ctrl_sources"] or ["all"] * len(d["ctrl_energy"])
        for row, labels in enumerate(LABELINGS):
            ax = axes[row][col]
            ax.set_title(f"{name}, labels={labels}\n{model}", fontsize=8)
            ax.set_xlabel("propagation energy E")
            if labels not in d["ctrl_labels"]:
                ax.text(0.5, 0.5, "not in this bundle", ha="center", transform=ax.transAxes)
                continue
            groups = {}
            for e, s, a in zip(d["ctrl_energy"], sources, d["ctrl_labels"][labels]):
                groups.setdefault((s, bool(a)), []).append(e)
            bins = np.histogram_bin_edges(d["ctrl_energy"], bins=24)  # one set of bins per panel
            for (source, applicable), energies in sorted(groups.items()):
                ax.hist(energies, bins=bins, alpha=0.6, color=COLORS.get((source, applicable), "grey"),
                        label=f"{source}, {'applicable' if applicable else 'non-applicable'}")
            ax.axvline(d["tau_E_by_labels"][labels], color="k", linestyle="--", label="tau_E")
            ax.legend(fontsize=6)
    tables.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args, profile, store, command = command_line.start(__doc__, "diagnostics.py", argv, planning.add_arguments)
    started = time.time()
    columns = command_line.select(BENCHMARKS + GENERAL_UNDER_OTHERS, args.columns)
    title = f"diagnostics, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, columns), title, store, profile):
        return 0
    diag = run(profile, store, columns)
    wall = time.time() - started
    out = Path(args.out)
    write_results_json(out / "diagnostics.json", {"command": command, "profile": profile.name, "seeds": profile.seeds,
                                                   "placement": profiles.asdict(store.placement),
                                                   "wall_time_s": round(wall, 1), "compute_time_s": store.compute_seconds(),
                                                   "computed_now": store.computed,
                                                   "step_seconds": dict(store.step_seconds), **diag})
    md = markdown(diag, command, wall, tables.cost(store))
    atomic_write(out / "diagnostics.md", md)
    plot(diag["bundles"], out / "diagnostics_energy.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
