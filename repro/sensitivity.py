"""Sensitivity to K (number of experts), rho (gate quantile) under each applicability labelling,
and alpha_probe (the probe's strength), retrained and at inference: tables and line plots.

    python repro/sensitivity.py [--profile quick|standard|large|paper|smoke] [--model ID] [--ks 1,2,3,4,5,6]
        [--rhos 0.7,0.8,0.9] [--labellings loss,flip,source] [--alphas 0.1,0.3,1]
        [--probe-alphas 0.1,0.3,1]
    python repro/sensitivity.py --plan  # its steps, which are cached, their cost; runs nothing

Rows that train a bundle each: K (MARI trained on TruthfulQA with K = 1..6 experts, everything
else as the main table, evaluated with its gate) and ``alpha_probe=X`` (--alphas: the probe
trained and used at strength X, h + X delta_phi(h), eq:probe_update, eq:cal_objective; issue
22.3), so each X has its own probe. Rows that evaluate the default bundle (K = 4, alpha_probe = 1)
without retraining: rho (tau_E recomputed at each rho from the control energies non-applicable
under each labelling, ``rho=...,labels=...``; mari_eval/mari/gate_labels.py) and ``probe_alpha=X
(fixed probe)`` (--probe-alphas, issue 36.7c: the one probe trained at 1, injected at strength
X by the gate, tau_E recomputed from the D_ctrl energies at X that training stored,
``probe_alpha=X``; what the paper's first-order claim about a "small" probe update,
eq:energy_nonapp_compact_main, speaks of). Every value is shown, chosen on nothing. A Vanilla
row (the base model) is the reference of every paired test. Columns: held-out TruthfulQA
MC1/MC2 and MMLU (5-shot, under the TruthfulQA intervention), the fraction of TruthfulQA and
MMLU documents on which the gate opened, and how well the row's energy separates applicable
from non-applicable D_ctrl examples (AUROC over the whole control set, under the loss and the
source labels; a fixed-probe row's from the stored energies at its X). The paper shows these
as figures only (no numbers to put beside ours). Besides each row's difference from Vanilla, the rows are compared
in pairs (``comparisons``): each K against K = 1 and against the K before it, each rho against the
one before it under the same labelling.
Writes results/sensitivity.{json,md,tex} and results/sensitivity_k.png,
results/sensitivity_rho.png, results/sensitivity_alpha.png (a panel per score, and one
for the gate rates; retrained and fixed-probe lines side by side).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from mari_eval.mari import DEFAULTS as MARI_DEFAULTS
from mari_eval.mari.fit import probe_alpha_grid
from mari_eval.mari.gate_labels import LABELINGS
from mari_eval.methods import load_bundle
from repro.engine import cache, command_line, planning, profiles, scoring, steps
from repro.analysis import tables
from repro.engine.profiles import BENCHMARKS

COLUMNS = [c for c in BENCHMARKS if c[0] in ("tqa_mc1", "tqa_mc2", "mmlu")]
GATE_COLUMNS = {"gate_tqa": "tqa_mc1", "gate_mmlu": "mmlu"}  # how often the gate opened there
AUROC_COLUMNS = {"auroc_loss": "loss", "auroc_source": "source"}  # energy vs applicability on D_ctrl


def rho_label(rho: float, labels: str) -> str:
    return f"rho={rho}, labels={labels}"


def probe_label(alpha: float) -> str:
    return f"probe_alpha={alpha} (fixed probe)"


def comparisons(ks: list[int], rhos: list[float], labellings: list[str]) -> list[tuple[str, str]]:
    """The paired tests of the paper's two readings (Section 6, Hyperparameter Analysis): several
    experts against one (each K against K = 1) and whether an added expert still helps (each K
    against the one before it); and whether the gate is insensitive to rho (each rho against the
    one before it, under each labelling). Holm's correction runs over these alone."""
    ks, rhos = sorted(ks), sorted(rhos)
    pairs = [(f"K={k}", "K=1") for k in ks if k != 1 and 1 in ks]
    pairs += [(f"K={k}", f"K={j}") for j, k in zip(ks, ks[1:]) if j != 1]
    pairs += [(rho_label(r, labels), rho_label(q, labels)) for labels in labellings for q, r in zip(rhos, rhos[1:])]
    return pairs


def _options(model_args: str) -> dict[str, str]:
    """A row's evaluation options (``rho=0.8,labels=source``) as ``Intervention.configure_from`` takes them."""
    return dict(part.split("=", 1) for part in model_args.split(",") if part)


def _row_bundle(bundle, model_args: str):
    """``bundle`` loaded and configured as the row with ``model_args`` evaluates it. A bundle the repro
    cache kept from before what the row needs was stored (the energies at other probe strengths of
    ``probe_alpha=``) is refused now, before any evaluation, naming the bundle and the fix."""
    loaded = load_bundle(bundle)
    try:
        loaded.configure_from(_options(model_args))
    except ValueError as e:
        if "retrain" not in str(e):  # a bad value, not an older bundle (whose refusals say to retrain it)
            raise SystemExit(f"sensitivity.py: {e}") from None
        skip = ", or leave the fixed-probe rows out with --probe-alphas ''" if "probe_alpha" in model_args else ""
        raise SystemExit(f"sensitivity.py: {e}. The cached bundle {bundle} predates what this row needs: delete that "
                         f"directory (the next run retrains it){skip}") from None
    return loaded


def points(profile: profiles.Profile, ks: list[int], rhos: list[float], labellings: list[str], alphas: list[float],
           probe_alphas: list[float] = ()) -> list[tuple[str, dict, str]]:
    """Each point of the sweep: (row label, the hyperparameters it trains with where they differ from
    the default bundle's, the lm-eval model_args it evaluates with)."""
    out = [(f"K={k}", {"K": k}, "") for k in ks]
    out += [(rho_label(r, labels), {}, f"rho={r}" + ("" if labels == "loss" else f",labels={labels}"))
            for labels in labellings for r in rhos]
    out += [(f"alpha_probe={a}", {"alpha_probe": a}, "") for a in alphas]
    defaults = {**MARI_DEFAULTS, **profile.hyperparameters}
    # The default bundle's probe at other strengths: at its trained one, the default evaluation itself.
    out += [(probe_label(a), {}, "" if a == defaults["alpha_probe"] else f"probe_alpha={a}") for a in probe_alphas]
    # A value equal to the default is the main table's bundle: left out of the cache key.
    return [(label, {k: v for k, v in trained.items() if v != defaults[k]}, args) for label, trained, args in out]


def plan(profile: profiles.Profile, store: cache.Store, sweep: list[tuple[str, dict, str]]) -> steps.Graph:
    """``run``'s work as a graph of steps (repro/engine/planning.py): a bundle per trained point, then one
    evaluation of every point's row per model and seed."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            rows: dict[str, scoring.Row] = {"Vanilla": ({}, "")}
            method_of = {}
            for label, trained, model_args in sweep:
                bundle = planning.train_step(graph, store, profile, "mari", "truthfulqa", model, seed, trained or None)
                rows[label], method_of[bundle] = ({"truthfulqa": bundle}, model_args), "mari"
            planning.evaluation_steps(graph, store, profile, model, seed, COLUMNS, rows, method_of)
    return graph


def run(profile: profiles.Profile, store: cache.Store, sweep: list[tuple[str, dict, str]]) -> dict:
    cells: dict = {}
    steps_ = [(m, s, *point) for m in profile.models for s in profile.seeds for point in sweep]
    rows: dict[tuple, dict[str, scoring.Row]] = {}  # per (model, seed): every point's bundle, scored together
    for model, seed, label, trained, model_args in tqdm(steps_, desc="sensitivity: training", unit="point"):
        bundle = store.bundle("mari", "truthfulqa", model, seed, profile, trained or None)
        if model_args:  # an option the cached bundle cannot serve stops the run here, before any evaluation
            _row_bundle(bundle, model_args)
        # The Vanilla row (the base model on the same documents) is the reference of the paired tests.
        rows.setdefault((model, seed), {"Vanilla": ({}, "")})[label] = ({"truthfulqa": bundle}, model_args)
    for (model, seed), by_label in rows.items():
        for label, scores in scoring.score_rows(store, profile, model, seed, COLUMNS, by_label).items():
            if label != "Vanilla":
                scores = tables.add_gate_rates(scores, GATE_COLUMNS)
                bundles, model_args = by_label[label]
                separation = _row_bundle(bundles["truthfulqa"], model_args).control_separation()
                for column, labels in AUROC_COLUMNS.items():
                    n = separation[labels]["n_applicable"] + separation[labels]["n_non_applicable"]
                    auroc = separation[labels]["auroc"]  # None where D_ctrl holds one class only
                    scores[column] = {"value": float("nan") if auroc is None else auroc, "n": n}
            tables.tally(cells, model, label, scores)
    return cells


def plot(record: dict, xlabel: str, series: dict[str, list[tuple[float, str]]], path: Path) -> None:
    """One panel per score (its 95% interval as a band) and one for the gate rates; one line per
    model and ``series`` entry ({legend: [(x, row label), ...]}). ``record``: the table as
    ``tables.write_tables`` wrote it."""
    plt = tables.pyplot()
    panels = [([column], f"{column} (%)") for column, *_rest in COLUMNS] + [(list(GATE_COLUMNS), "gate rate")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (columns, ylabel) in zip(axes, panels):
        for model, entry in record["models"].items():
            rows = {row["row"]: row["ours"] for row in entry["rows"]}
            for name, points in series.items():
                for column in columns:
                    xs, cells = [x for x, _label in points], [rows[label][column] for _x, label in points]
                    legend = ", ".join(part for part in (model, name, column if len(columns) > 1 else "") if part)
                    line, = ax.plot(xs, [c["mean"] for c in cells], marker="o", label=legend)
                    if all(c.get("ci") for c in cells):
                        ax.fill_between(xs, [c["ci"][0] for c in cells], [c["ci"][1] for c in cells],
                                        color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax in (axes[0], axes[-1]):
            ax.legend(fontsize=6)
    fig.suptitle(f"MARI sensitivity to {xlabel} (TruthfulQA-trained, seed {', '.join(map(str, record['seeds']))}; "
                 "ours, bands: 95% intervals)")
    tables.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    stored = ",".join(f"{a:g}" for a in probe_alpha_grid(MARI_DEFAULTS["alpha_probe"]))

    def options(parser):
        planning.add_arguments(parser)
        parser.add_argument("--ks", default="1,2,3,4,5,6")
        parser.add_argument("--rhos", default="0.7,0.8,0.9")
        parser.add_argument("--labellings", default=",".join(LABELINGS), help="applicability labellings of the rho sweep")
        parser.add_argument("--alphas", default="0.1,0.3,1", help="alpha_probe values (each trains a bundle)")
        parser.add_argument("--probe-alphas", default=stored,
                            help="probe_alpha values at which the default bundle's one probe is injected at inference "
                                 f"(no retraining; among the strengths training stores: {stored}; '' for none)")

    args, profile, store, command = command_line.start(__doc__, "sensitivity.py", argv, options)
    ks, rhos = command_line.listed(args.ks, "--ks", int), command_line.listed(args.rhos, "--rhos", float)
    alphas, labellings = command_line.listed(args.alphas, "--alphas", float), command_line.listed(args.labellings, "--labellings")
    probe_alphas = command_line.listed(args.probe_alphas, "--probe-alphas", float, allow_empty=True)
    unknown = [name for name in labellings if name not in LABELINGS]
    if unknown:
        raise SystemExit(f"--labellings: {', '.join(unknown)} unknown; use some of {', '.join(LABELINGS)}")
    unstored = [f"{a:g}" for a in probe_alphas if a not in probe_alpha_grid(MARI_DEFAULTS["alpha_probe"])]
    if unstored:
        raise SystemExit(f"--probe-alphas: {', '.join(unstored)} not among the strengths training stores the control "
                         f"energies at ({stored}); use some of them (--alphas retrains the probe at any strength)")
    started = time.time()
    sweep = points(profile, ks, rhos, labellings, alphas, probe_alphas)
    title = f"sensitivity, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, sweep), title, store, profile):
        return 0
    cells = run(profile, store, sweep)
    out = Path(args.out)
    record = tables.write_tables(out, "sensitivity", "Sensitivity to K, rho (per labelling) and alpha_probe (retrained; "
                        "and at inference over one fixed probe)",
                        "Scores in %; alpha_probe=X rows train a probe at X, probe_alpha=X (fixed probe) rows inject "
                        f"the default bundle's probe (trained at {MARI_DEFAULTS['alpha_probe']:g}) at X; gate columns: "
                        "fraction of documents on which the gate opened; auroc columns: the row's energy vs applicability over the bundle's whole "
                        "D_ctrl under the loss and source labels (0.5: no separation). The paper shows figures only.",
                        cells,
                        [c[0] for c in COLUMNS] + list(GATE_COLUMNS) + list(AUROC_COLUMNS), lambda model: ("(figures only)", {}),
                        profile, command, time.time() - started, store,
                        comparisons=comparisons(ks, rhos, labellings))  # issue 36.7, issue 42
    plot(record, "K", {"": [(k, f"K={k}") for k in ks]}, out / "sensitivity_k.png")
    plot(record, "rho", {f"labels={name}": [(r, rho_label(r, name)) for r in rhos] for name in labellings},
         out / "sensitivity_rho.png")
    plot(record, "alpha_probe", {"retrained": [(a, f"alpha_probe={a}") for a in alphas],
                                "fixed probe": [(a, probe_label(a)) for a in probe_alphas]},
         out / "sensitivity_alpha.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
