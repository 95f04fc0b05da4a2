"""Sensitivity to K (number of experts) and rho (gate quantile): tables and line plots.

    python repro/sensitivity.py [--profile quick|paper|smoke] [--model ID] [--ks 1,2,3,4,5,6] [--rhos 0.7,0.8,0.9]

K: MARI is trained on TruthfulQA with K = 1..6 experts (everything else as the main
table) and evaluated with its gate. rho: the K = 4 bundle evaluated with tau_E
recomputed at each rho. Columns: held-out TruthfulQA MC1/MC2 and MMLU (5-shot, under the
TruthfulQA intervention), and the fraction of TruthfulQA and MMLU documents on which the
gate opened. The paper shows these as figures only (no numbers to put beside ours).
Writes results/sensitivity.{json,md,tex} and results/sensitivity_k.png,
results/sensitivity_rho.png (a panel per score, and one for the gate rates).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from repro import cache, profiles, tables
from repro.profiles import BENCHMARKS

COLUMNS = [c for c in BENCHMARKS if c[0] in ("tqa_mc1", "tqa_mc2", "mmlu")]
GATE_COLUMNS = {"gate_tqa": "tqa_mc1", "gate_mmlu": "mmlu"}  # how often the gate opened there


def run(profile: profiles.Profile, store: cache.Store, ks: list[int], rhos: list[float]) -> dict:
    from tqdm import tqdm

    cells: dict = {}
    steps = [(m, s, "K", k) for m in profile.models for s in profile.seeds for k in ks]
    steps += [(m, s, "rho", r) for m in profile.models for s in profile.seeds for r in rhos]
    for model, seed, axis, value in tqdm(steps, desc="sensitivity", unit="point"):
        K = int(value) if axis == "K" else 4
        bundle = store.bundle("mari", "truthfulqa", model, seed, profile, {"K": K} if K != 4 else None)
        model_args = f"rho={value}" if axis == "rho" else ""
        label = f"K={K}" if axis == "K" else f"rho={value}"
        scores = cache.score(store, profile, model, seed, COLUMNS, {"truthfulqa": bundle}, model_args)
        tables.tally(cells, model, label, tables.add_gate_rates(scores, GATE_COLUMNS))
    return cells


def plot(cells: dict, axis: str, points: list, path: Path) -> None:
    plt = tables.pyplot()
    panels = [([column], f"{column} (%)") for column, *_rest in COLUMNS] + [(list(GATE_COLUMNS), "gate rate")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (columns, ylabel) in zip(axes, panels):
        for model, rows in cells.items():
            for column in columns:
                means = [tables.mean_std(rows[f"{axis}={p}"][column]["values"])[0] for p in points]
                ax.plot(points, means, marker="o", label=model if len(columns) == 1 else f"{model}: {column}")
        ax.set_xlabel(axis)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax in (axes[0], axes[-1]):
            ax.legend(fontsize=7)
    fig.suptitle(f"MARI sensitivity to {axis} (TruthfulQA-trained; ours)")
    tables.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    def points(parser):
        parser.add_argument("--ks", default="1,2,3,4,5,6")
        parser.add_argument("--rhos", default="0.7,0.8,0.9")

    args, profile, store, command = profiles.start(__doc__, "sensitivity.py", argv, points)
    ks, rhos = [int(k) for k in args.ks.split(",")], [float(r) for r in args.rhos.split(",")]
    started = time.time()
    cells = run(profile, store, ks, rhos)
    out = Path(args.out)
    tables.write_tables(out, "sensitivity", "Sensitivity to K and rho", "Scores in %; gate columns: fraction of documents on which the gate opened. The paper shows figures only.", cells,
                        [c[0] for c in COLUMNS] + list(GATE_COLUMNS), lambda model: ("(figures only)", {}), profile, command,
                        time.time() - started, store)
    plot(cells, "K", ks, out / "sensitivity_k.png")
    plot(cells, "rho", rhos, out / "sensitivity_rho.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
