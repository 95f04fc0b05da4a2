"""repro/engine/costs.py against the steps a GPU run measured, and its calibration (issue 59.4).

    python -m repro.benchmark.cost_check [--runs results/gpu_bench_runs] [--out results]

For every step of repro/gpu_bench.py's raw runs that finished, the seconds costs.py's FLOPs give
(``costs.seconds``, before calibration) and the GPU-seconds it charges (``costs.training_seconds``,
``costs.evaluation_seconds``) beside the seconds measured: training a bundle on TruthfulQA's
D_train (wall), evaluating a task under ``--model mari`` (the time inside the model's request
methods; lm-eval's ``hf`` entries are left out: costs.py prices this suite's passes), and
generating (SORRY-Bench prompts one at a time: one prompt's total). From them, ``derive`` computes
the ratios costs.py's ``CALIBRATION`` holds, each from the runs of the code the repro runs:

* training, per method: the median measured / FLOP-seconds over ``CALIBRATION.runs`` (after issue 59);
* evaluation: the median over the steps that timed the repro's own path, several entries through one
  shared pass (repro/engine/scoring.py: every question alone, its rows together), else, in runs before
  that step existed, over the steps scored one question at a time (``batch_size=1``); batched
  ``--model mari`` is reported beside it but not used;
* a greedy step: the median base-model answer's total over its tokens.

Where a kind was measured on two shapes, each shape is checked against the ratio of the other's
runs alone. The derived values must match ``CALIBRATION`` (tests/test_cost_calibration.py); the
goal is a calibrated ratio within 25% of 1 for every kind. Writes results/cost_check.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from mari_eval.storage.files import atomic_write, write_results_json
from repro.analysis.tables import markdown_table
from repro.engine import costs, profiles

REPO = Path(__file__).resolve().parents[2]
# The entries of repro/gpu_bench.py and the method whose rows they run (None: the untouched model).
ENTRY_METHOD = {"vanilla": None, "mari": "mari", "mari_open": "mari", "mari_gate_off": "mari",
                "caa": "caa", "iti": "iti", "nl_iti": "nl_iti", "reft": "reft"}
# lm-eval's tasks of the benchmark and the task whose token counts price them (repro/engine/token_counts.json).
PRICED_AS = {"truthfulqa_mc2": "truthfulqa_mc2_heldout", "bbq": "bbq_disambig_heldout"}


def _task_size(task: str, documents: int) -> costs.TaskSize:
    if task.startswith("mmlu_"):
        return costs.TaskSize.of(task, documents)
    return costs.TaskSize.of(PRICED_AS.get(task, task), documents)


def estimates(raw: dict) -> list[dict]:
    """One row per finished step of one raw run: its kind, what was measured, the seconds of its FLOPs
    (``flops_s``) and the GPU-seconds costs.py charges (``estimated_s``)."""
    settings, n, model = raw["settings"], int(raw["model"]["parameters"]), raw["model"]["name"]
    profile = dataclasses.replace(profiles.PROFILES["standard"], max_train={}, max_ctrl=settings["max_ctrl"],
                                  max_pca=settings["max_pca"])
    rows = []
    for step in raw["steps"]:
        if step["status"] != "done":
            continue
        if step["kind"] == "train":
            epochs = (step.get("hyperparameters") or {}).get("epochs")
            flops = costs.training_flops(model, step["method"], "truthfulqa", profile, epochs, n_parameters=n)
            rows.append({"step": step["step"], "kind": f"train {step['method']}", "measured_s": step["wall_s"],
                         "flops_s": costs.seconds(flops),
                         "estimated_s": costs.training_seconds(model, step["method"], "truthfulqa", profile, epochs,
                                                               n_parameters=n)})
        elif step["kind"].startswith(("eval:", "eval-shared:")) and step.get("entry") != "hf":  # hf: not costs.py's
            if step["kind"].startswith("eval:"):  # one entry
                methods = [ENTRY_METHOD.get(step["entry"], step["entry"])]
                kind = f"evaluate {step['kind'][5:]} (batch {step['batch_size']})"
            else:  # the repro's evaluation: every entry's rows in one shared pass
                methods = [ENTRY_METHOD.get(e, e) for e in step["entries"]]
                kind = f"evaluate {step['task']} (shared pass, {len(methods)} rows)"
            sizes = [_task_size(task, count) for task, count in step["documents"].items()]
            rows.append({"step": step["step"], "kind": kind, "measured_s": step["model_s"], "wall_s": step["wall_s"],
                         "flops_s": sum(costs.seconds(costs.evaluation_flops(model, z, methods, None, n_parameters=n))
                                        for z in sizes),
                         "estimated_s": sum(costs.evaluation_seconds(model, z, methods, None, n_parameters=n)
                                            for z in sizes)})
        elif step["kind"] == "gen":
            size = dataclasses.replace(costs.TaskSize.of("sorry_bench_heldout", 1), documents=1)
            methods = [None if step["mode"] == "base" else "mari"]
            rows.append({"step": step["step"], "kind": f"generate one prompt ({step['mode']})",
                         "measured_s": step["total_s"], "tokens": step["tokens"],
                         "flops_s": costs.seconds(costs.evaluation_flops(model, size, methods, step["tokens"],
                                                                         n_parameters=n)),
                         "estimated_s": costs.evaluation_seconds(model, size, methods, step["tokens"], n_parameters=n)})
    for row in rows:
        row["ratio_flops"] = row["measured_s"] / row["flops_s"] if row["flops_s"] else None
        row["ratio"] = row["measured_s"] / row["estimated_s"] if row["estimated_s"] else None
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def derive(runs: list[dict], calibration_runs: tuple[str, ...] = costs.CALIBRATION.runs) -> dict:
    """The ratios ``costs.CALIBRATION`` holds, from these runs (module docstring), with the steps each rests on."""
    train: dict[str, list[float]] = {}
    for run in runs:
        if run["run"] in calibration_runs:
            for row in run["steps"]:
                if row["kind"].startswith("train ") and row["ratio_flops"]:
                    train.setdefault(row["kind"][6:], []).append(row["ratio_flops"])
    # The repro's own path where a run timed it, else the nearest: one method, one question at a time.
    evaluations = [row["ratio_flops"] for run in runs for row in run["steps"] if "(shared pass" in row["kind"]]
    evaluate_from = "the shared pass's steps"
    if not evaluations:
        evaluations = [row["ratio_flops"] for run in runs for row in run["steps"]
                         if row["kind"].startswith("evaluate ") and row["kind"].endswith("(batch 1)")]
        evaluate_from = "every run's batch-1 steps (no run timed the shared pass)"
    batched = [row["ratio_flops"] for run in runs if run["run"] in calibration_runs for row in run["steps"]
               if row["kind"].startswith("evaluate ") and row["kind"].endswith("(batch auto)")]
    steps = [row["measured_s"] / row["tokens"] for run in runs for row in run["steps"]
             if row["kind"] == "generate one prompt (base)"]
    return {"train": {m: statistics.median(r) for m, r in sorted(train.items())},
            "train_steps": {m: len(r) for m, r in sorted(train.items())},
            "evaluate": _median(evaluations), "evaluate_steps": len(evaluations), "evaluate_from": evaluate_from,
            "evaluate_batched": _median(batched), "evaluate_batched_steps": len(batched),
            "decode_step_s": _median(steps), "decode_steps": len(steps)}


def charged(row: dict, run: str, calibration_runs: tuple[str, ...] = costs.CALIBRATION.runs) -> bool:
    """Whether costs.py charges steps of ``row``'s kind as measured in ``run``: training (after issue 59),
    evaluation one question at a time (the repro's shared pass) and generation; batched evaluation is
    how ``lm_eval --model mari`` runs, not the repro."""
    if row["kind"].startswith("train "):
        return run in calibration_runs
    return not row["kind"].endswith("(batch auto)")


def by_kind(runs: list[dict], calibration_runs: tuple[str, ...] = costs.CALIBRATION.runs) -> list[dict]:
    """Per kind of step over the runs that measured it as costs.py charges it (``charged``; batched
    evaluation from the calibration runs, for its FLOP ratio alone): the median ratios measured /
    FLOP-seconds and measured / charged."""
    kinds: dict[str, list[dict]] = {}
    for run in runs:
        for row in run["steps"]:
            mine = charged(row, run["run"], calibration_runs)
            if row["ratio"] is not None and (mine or run["run"] in calibration_runs):
                kinds.setdefault(row["kind"], []).append({**row, "charged": mine})
    return [{"kind": kind, "steps": len(r), "charged": r[0]["charged"],
             "median_ratio_flops": statistics.median(x["ratio_flops"] for x in r),
             "median_ratio": statistics.median(x["ratio"] for x in r), "min_ratio": min(x["ratio"] for x in r),
             "max_ratio": max(x["ratio"] for x in r)} for kind, r in sorted(kinds.items())]


def across_shapes(runs: list[dict], calibration_runs: tuple[str, ...] = costs.CALIBRATION.runs) -> list[dict]:
    """Each training kind and batched evaluation measured on two shapes of the calibration runs: one
    shape's median measured / FLOP-seconds against the ratio the other shape's runs alone give."""
    calibrating = [run for run in runs if run["run"] in calibration_runs]
    shapes = sorted({run["shape"] for run in calibrating})
    out = []
    for shape in shapes:
        own = derive([r for r in calibrating if r["shape"] == shape], calibration_runs)
        other = derive([r for r in calibrating if r["shape"] != shape], calibration_runs)
        pairs = [(f"train {m}", own["train"][m], other["train"].get(m)) for m in own["train"]]
        pairs.append(("evaluate (batch auto)", own["evaluate_batched"], other["evaluate_batched"]))
        out += [{"shape": shape, "kind": kind, "measured_ratio": mine, "other_shapes_ratio": theirs,
                 "measured_over_predicted": mine / theirs}
                for kind, mine, theirs in pairs if mine is not None and theirs is not None]
    return out


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _yes(ratio: float) -> str:
    return "yes" if 0.75 <= ratio <= 1.25 else "no"


def markdown(record: dict) -> str:
    c, d = record["calibration"], record["derived"]
    lines = ["# costs.py against measured GPU steps, and its calibration (issue 59.4)\n",
             f"Generated by `{record['command']}` from the raw runs of repro/gpu_bench.py: "
             + "; ".join(f"{r['run']} ({r['device']}, {r['started']}, {r['shape']}, N = {r['parameters'] / 1e9:.2f} B)"
                         for r in record["runs"]) + ".\n",
             f"FLOP-seconds: repro/engine/costs.py's FLOPs over EFFECTIVE_FLOPS = {costs.EFFECTIVE_FLOPS:.2g} FLOP/s (the "
             "estimate before issue 59). Charged: costs.py's GPU-seconds under CALIBRATION "
             f"({c['device']}, {c['measured']}). Measured: a training step's wall time; an evaluation's time inside "
             "the model's request methods; one generated answer's total time (median over prompts). The goal is a "
             "charged ratio within 25% of 1 (0.75-1.25) for every kind.\n",
             "## The calibration\n",
             markdown_table(["ratio", "costs.py CALIBRATION", "derived from the runs", "steps", "from"], [
                 *[[f"train {m}", f"{c['train'].get(m, float('nan')):.3g}", _g(v), str(d["train_steps"][m]),
                    ", ".join(record["calibration_runs"])] for m, v in d["train"].items()],
                 ["train lora", f"{c['train'].get('lora', float('nan')):.3g}", "- (ReFT's)", "0", "not measured"],
                 ["evaluate, one question at a time (the repro's shared pass)", f"{c['evaluate']:.3g}",
                  _g(d["evaluate"]), str(d["evaluate_steps"]), d["evaluate_from"]],
                 ["evaluate, batched (`lm_eval --model mari`; not charged)", "-", _g(d["evaluate_batched"]),
                  str(d["evaluate_batched_steps"]), ", ".join(record["calibration_runs"])],
                 ["a greedy step (s)", f"{c['decode_step_s']:.3g}", _g(d["decode_step_s"]), str(d["decode_steps"]),
                  "every run's base-model answers"]]),
             "",
             "## Each kind of step\n",
             "Training from the calibration runs; evaluation one question at a time and generation from every run "
             "(code issue 59 did not change); batched evaluation from the calibration runs, for its FLOP ratio "
             "only (the repro does not evaluate in batches).\n",
             markdown_table(["kind of step", "steps", "measured / FLOP-seconds (median)", "measured / charged (median)",
                             "min", "max", "within 25%"],
                            [[k["kind"], str(k["steps"]), f"{k['median_ratio_flops']:.2f}",
                              *([f"{k['median_ratio']:.2f}", f"{k['min_ratio']:.2f}", f"{k['max_ratio']:.2f}",
                                 _yes(k["median_ratio"])] if k["charged"] else ["-", "-", "-", "not charged"])]
                             for k in record["kinds"]]),
             "",
             "## Across shapes\n",
             "A kind measured on both shapes of the calibration runs: its ratio on one shape against the ratio "
             "the other shape's runs alone give (what the calibration would have predicted without it).\n",
             markdown_table(["shape", "kind", "measured / FLOP-seconds", "the other shape's", "measured / predicted",
                             "within 25%"],
                            [[x["shape"], x["kind"], f"{x['measured_ratio']:.2f}", f"{x['other_shapes_ratio']:.2f}",
                              f"{x['measured_over_predicted']:.2f}", _yes(x["measured_over_predicted"])]
                             for x in record["across_shapes"]])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(REPO / "results" / "gpu_bench_runs"), help="a folder of raw runs (run*.json)")
    parser.add_argument("--out", default=str(REPO / "results"))
    parser.add_argument("--calibration-runs", nargs="+", default=list(costs.CALIBRATION.runs),
                        help="the runs (file names under --runs) whose training and batched evaluation the ratios "
                             "are derived from (default: costs.CALIBRATION.runs)")
    args = parser.parse_args(argv)
    calibration_runs = tuple(args.calibration_runs)
    paths = sorted(Path(args.runs).glob("run*.json"))
    if not paths:
        parser.error(f"--runs {args.runs}: no run*.json there (repro/gpu_bench.py --raw writes them)")
    runs = []
    for path in paths:
        raw = json.loads(path.read_text())
        runs.append({"run": path.name, "device": raw.get("device"), "started": raw.get("started"),
                     "shape": raw["settings"]["shape"], "parameters": raw["model"]["parameters"], "steps": estimates(raw)})
    command = "python -m repro.benchmark.cost_check" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(argv or sys.argv[1:]))
    record = {"command": command, "effective_flops": costs.EFFECTIVE_FLOPS,
              "calibration": dataclasses.asdict(costs.CALIBRATION), "calibration_runs": list(calibration_runs),
              "derived": derive(runs, calibration_runs), "runs": runs, "kinds": by_kind(runs, calibration_runs),
              "across_shapes": across_shapes(runs, calibration_runs)}
    out = Path(args.out)
    write_results_json(out / "cost_check.json", record)
    atomic_write(out / "cost_check.md", markdown(record).encode())
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
