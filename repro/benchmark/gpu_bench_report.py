"""results/gpu_bench.{json,md} from raw files of repro/gpu_bench.py (issue 41).

    python repro/gpu_bench.py --render RAW.json [RAW2.json ...] [--out results]

Several raw files (runs on the same kind of device, e.g. a second run for the task groups a
deadline cut from the first) are read as one record (``merge``): every step keeps its run's
number, each evaluation is compared with lm-eval's ``hf`` of its own run, and a step skipped in
one run but done in another counts as done.

Every figure comes from the raw file: wall times per (entry, task) and their ratios to lm-eval's
``hf`` on the same documents, training time per method, the peak training memory of MARI and ReFT against the
memory model's estimate, generation figures and their ratios to the base model beside the
paper's Table 4 ratios (results/paper/table4_latency.csv), and issue 41's goals, each computed
from the measured numbers. The JSON is the raw record plus ``derived`` (the tables' rows), strict
JSON (a missing figure is null).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mari_eval.storage.files import atomic_write, write_results_json
from mari_eval.training.memory import format_size
from repro.analysis.tables import markdown_table, paper_rows

BASELINES = ("caa", "iti", "nl_iti", "reft")
TASK_ORDER = ("truthfulqa_mc2", "mmlu", "bbq")
# Issue 41, item 3: the goals, on a GPU at the 7B shape (ratios of wall time to lm-eval's hf, same documents).
VANILLA_GOAL, MARI_GOAL, BASELINE_GOAL, FIRST_TOKEN_GOAL, MEMORY_TOLERANCE = 0.5, 1.0, 0.7, 2.0, 0.10


def _done(raw: dict, prefix: str) -> list[dict]:
    return [s for s in raw["steps"] if s["status"] == "done" and s["step"].startswith(prefix)]


def _ratio(a, b) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def merge(raws: list[dict]) -> dict:
    """Several runs' raw records as one: the first run's description, every run's command and
    timing under ``runs``, every step tagged with its run (1, 2...), and the steps not done in
    one run but done in another dropped from the not-done ones."""
    runs = [{"run": i, "command": r["command"], "started": r["started"], "total_s": r.get("total_s"),
             "deadline_s": r.get("deadline_s"), "device": r["device"]} for i, r in enumerate(raws, 1)]
    if len({r["device"] for r in runs}) > 1:
        raise ValueError(f"runs on different devices cannot share one table: {sorted({r['device'] for r in runs})}")
    steps = [{**step, "run": i} for i, r in enumerate(raws, 1) for step in r["steps"]]
    done = {step["step"] for step in steps if step["status"] == "done"}
    last_try = {step["step"]: id(step) for step in steps}  # a step not done in several runs: its last try
    steps = [step for step in steps
             if step["status"] == "done" or (step["step"] not in done and last_try[step["step"]] == id(step))]
    return {**raws[0], "runs": runs, "steps": steps}


def evaluations(raw: dict) -> list[dict]:
    """One row per evaluation step done, with its ratios to hf on the same task in the same run."""
    steps = _done(raw, "eval/")
    hf = {(s.get("run"), s["task"]): s for s in steps if s["entry"] == "hf"}
    rows = []
    for s in steps:
        ref = hf.get((s.get("run"), s["task"]), {})
        rows.append({"run": s.get("run"), "task": s["task"], "entry": s["entry"], "batch_size": s["batch_size"],
                     "batch_used": batch_used(s),
                     "wall_s": s["wall_s"], "x_hf": _ratio(s["wall_s"], ref.get("wall_s")),
                     "model_s": s["model_s"], "model_x_hf": _ratio(s["model_s"], ref.get("model_s")),
                     "batch_detect_s": s.get("batch_detect_s"), "metric": s["metric"], "metric_mean": s["metric_mean"],
                     "documents": sum(s["documents"].values()), "gate_rate": s.get("gate_rate"),
                     "peak_allocated_bytes": s.get("peak_allocated_bytes")})
    order = {t: i for i, t in enumerate(TASK_ORDER)}
    return sorted(rows, key=lambda r: order.get(r["task"], len(order)))


def batch_used(step: dict) -> str:
    """What an evaluation ran with: HFLM's detected batch size, or MariLM's largest batch (questions,
    requests) and its number of batches."""
    detected = step.get("batch_sizes_detected") or {}
    if detected:
        return ", ".join(str(v) for v in detected.values())
    calls = step.get("mari_batches") or []
    if calls:
        return "; ".join(f"{c['batches']} batches, largest {c['largest_batch_questions']} q / "
                         f"{c['largest_batch_requests']} req" for c in calls)
    return str(step.get("batch_size_per_gpu"))


def fastest(rows: list[dict], entry: str, task: str) -> dict | None:
    """``entry``'s quickest measured configuration (batch size) on ``task``."""
    mine = [r for r in rows if r["entry"] == entry and r["task"] == task and r["x_hf"] is not None]
    return min(mine, key=lambda r: r["wall_s"]) if mine else None


def generation(raw: dict, paper: dict[str, float]) -> list[dict]:
    """One row per generation step done, with its ratios to the base model of its own run."""
    done = _done(raw, "gen/")
    base = {s.get("run"): s for s in done if s["mode"] == "base"}
    rows = []
    for s in done:
        row = {"run": s.get("run"), "mode": s["mode"], "first_token_s": s["first_token_s"],
               "tokens_per_s": s["tokens_per_s"], "total_s": s["total_s"], "gate_rate": s.get("gate_rate"),
               "tokens_produced": s.get("tokens_produced"), "prompts": s["prompts"], "tokens": s["tokens"]}
        for key in ("first_token_s", "tokens_per_s", "total_s"):
            row[f"{key}_x_base"] = _ratio(s[key], base.get(s.get("run"), {}).get(key))
            row[f"{key}_paper_x_base"] = paper.get(key) if s["mode"] != "base" else 1.0
        rows.append(row)
    return rows


def paper_ratios() -> dict[str, float]:
    """The paper's Table 4 ratios of MARI to its base model (first token, tokens/s, total latency)."""
    rows = {r["method"]: r for r in paper_rows("table4_latency")}
    base, mari = rows["Base Model"], rows["MARI"]
    return {ours: float(mari[theirs]) / float(base[theirs])
            for ours, theirs in (("first_token_s", "ftl_ms"), ("tokens_per_s", "tps"), ("total_s", "ttlt_s"))}


def _goal(goal: str, target: str, figures: list[tuple[str, float | None]], ok) -> dict:
    measured = [(label, value) for label, value in figures if value is not None and math.isfinite(value)]
    reached = "not measured" if not measured else "yes" if all(ok(v) for _, v in measured) else "no"
    return {"goal": goal, "target": target, "reached": reached,
            "figure": "; ".join(f"{label} {value:.2f}" for label, value in measured) or "-"}


def goals(rows: list[dict], gen: list[dict], memories: list[dict]) -> list[dict]:
    """Issue 41's goals, each from the measured figures (ratios of wall time to hf, per task measured)."""
    tasks = [t for t in TASK_ORDER if any(r["task"] == t for r in rows)]

    def per_task(entries: tuple[str, ...]) -> list[tuple[str, float | None]]:
        out = []
        for task in tasks:
            best = [fastest(rows, e, task) for e in entries]
            worst = max((b for b in best if b), key=lambda b: b["x_hf"], default=None)
            label = task if worst is None else f"{task} ({worst['entry']}, bs {worst['batch_size']})"
            out.append((label, None if worst is None else worst["x_hf"]))
        return out

    def first_token(mode: str) -> list[tuple[str, float | None]]:
        return [(f"x base (run {g['run']})", g["first_token_s_x_base"]) for g in gen if g["mode"] == mode]

    return [
        _goal("vanilla (MariLM, no bundle) wall time vs hf", f"<= {VANILLA_GOAL}x", per_task(("vanilla",)),
              lambda v: v <= VANILLA_GOAL),
        _goal("MARI, gate on (calibrated threshold) vs hf", f"<= {MARI_GOAL}x", per_task(("mari",)),
              lambda v: v <= MARI_GOAL),
        _goal("MARI, gate open on every question vs hf (stricter reading)", f"<= {MARI_GOAL}x",
              per_task(("mari_open",)), lambda v: v <= MARI_GOAL),
        _goal("every baseline (worst of CAA, ITI, NL-ITI, ReFT) vs hf", f"<= {BASELINE_GOAL}x", per_task(BASELINES),
              lambda v: v <= BASELINE_GOAL),
        _goal("MARI first-token latency, gate open, vs base", f"<= {FIRST_TOKEN_GOAL}x", first_token("mari_gate_open"),
              lambda v: v <= FIRST_TOKEN_GOAL),
        _goal("the same, routing over T_ent = 1 greedy step (T_ent=1) instead of the bundle's 8",
              f"<= {FIRST_TOKEN_GOAL}x", first_token("mari_gate_open_t1"), lambda v: v <= FIRST_TOKEN_GOAL),
        _goal("training (MARI, ReFT, LoRA): peak GPU memory / estimate", f"within {MEMORY_TOLERANCE:.0%}",
              [(f"ratio ({m['method']}, run {m['run']}, batch {m.get('batch_size') or m.get('batch')})", m.get("peak_over_estimate"))
               for m in memories],
              lambda v: abs(v - 1) <= MEMORY_TOLERANCE),
    ]


def memory_stages(memory: dict) -> dict:
    """What the marks taken during a method's training say (CUDA only): the state held when its first
    training stage starts (MARI's experts, ReFT's epochs; allocated then, less what was allocated
    before training) against the memory model's M, the peak reached while preparing, and what a
    training step adds above the held state."""
    marks = {m["at"]: m for m in memory.get("marks") or []}
    first = next((at for at in marks if at.endswith(" start")), None)
    start, end = marks.get(first), marks.get(first and first[:-len("start")] + "end")
    if start is None or end is None:
        return {}
    held = start["allocated_bytes"] - memory["allocated_before_bytes"]
    step_peak = end["peak_so_far_bytes"] if end["peak_so_far_bytes"] > start["peak_so_far_bytes"] else None
    return {"held_measured_bytes": held, "held_measured_over_estimate": _ratio(held, memory["held_estimate_bytes"]),
            "prepare_peak_bytes": start["peak_so_far_bytes"],
            "training_step_above_held_bytes": None if step_peak is None else step_peak - start["allocated_bytes"]}


def derive(raw: dict) -> dict:
    rows = evaluations(raw)
    training = [{"run": s.get("run"), "method": s["method"], "wall_s": s["wall_s"], "train_examples": s["train_examples"],
                 "ctrl_examples": s["ctrl_examples"], "hyperparameters_given": s["hyperparameters_given"],
                 "peak_allocated_bytes": s["memory"]["peak_allocated_bytes"]} for s in _done(raw, "train/")]
    # The methods that backpropagate through the model record their largest step (runs before issue 59: MARI only).
    memories = [{"run": s.get("run"), "method": s["method"], "batch_size": (s.get("hyperparameters") or {}).get("batch_size"),
                 "batch": (s.get("hyperparameters") or {}).get("batch"), **s["memory"], **memory_stages(s["memory"])}
                for s in _done(raw, "train/") if s["method"] == "mari" or s["memory"].get("step_estimate_bytes")]
    memory = memories[0] if memories else None
    gen = generation(raw, paper_ratios())
    not_done = [{"run": s.get("run"), "step": s["step"], "status": s["status"], "why": s.get("reason") or s.get("error")}
                for s in raw["steps"] if s["status"] != "done"]
    hf = {(r["run"], r["task"]): r for r in rows if r["entry"] == "hf"}
    shared = [{"run": s.get("run"), "task": s["task"], "entries": s["entries"], "wall_s": s["wall_s"],
               "model_s": s["model_s"], "hf_wall_s": hf.get((s.get("run"), s["task"]), {}).get("wall_s"),
               "documents": sum(s["documents"].values()), "stats": s.get("shared_stats", {})}
              for s in _done(raw, "eval-shared/")]
    return {"evaluations": rows, "training": training, "memory": memory, "memories": memories, "generation": gen,
            "shared": shared, "goals": goals(rows, gen, memories), "not_done": not_done}


def _f(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _gib(value) -> str:
    return "-" if value is None else format_size(value)


def markdown(raw: dict, derived: dict) -> str:
    shape, model, s = raw["shape"], raw["model"], raw["settings"]
    versions = raw["versions"]
    lines = [
        "# GPU benchmark at the paper's shapes (issue 41)\n",
        "Generated by `python repro/gpu_bench.py --render` from the raw records of these runs (each on a fresh "
        "process and model; every ratio compares entries of the same run):\n",
        *[f"{r['run']}. `{r['command']}` (started {r['started']}, {_f(r.get('total_s'), 0)} s, deadline "
          f"{r.get('deadline_s')} s)" for r in raw.get("runs") or merge([raw])["runs"]],
        "",
        f"- Device: {raw['device']} ({_gib(raw.get('gpu_memory_bytes'))}); torch {versions.get('torch')}, CUDA "
        f"{raw.get('cuda')}, transformers {versions.get('transformers')}, lm-eval {versions.get('lm_eval')}, datasets "
        f"{versions.get('datasets')}, Python {raw['python']}.",
        f"- Model: {shape['name']}'s shape ({shape['source']}) with random weights in {model['dtype']}, built on the "
        f"device in {_f(raw.get('build_s'), 1)} s: {model['num_layers']} layers, hidden size "
        f"{shape['config']['hidden_size']}, {model['parameters'] / 1e9:.2f} B parameters with "
        + (f"the shape's published {model['vocab_size']:,}-token vocabulary (`vocab=published`: the rows past the "
           "tokenizer's are zero, so no text reaches them)" if s.get("vocab") == "published" else
           f"the tokenizer's {model['vocab_size']}-token vocabulary")
        + f" ({_gib(model['weights_bytes'])} of weights); tokenizer {model['tokenizer']}.",
        f"- Documents: truthfulqa_mc2 first {s['tqa_limit']}; 5-shot MMLU {', '.join(s['mmlu_subjects'])} "
        f"(first {s['mmlu_limit']} each); bbq first {s['bbq_limit']}; the same documents for every entry. "
        f"Batch size `auto` is capped at {s['max_batch_size']} (lm-eval's default) for hf"
        + (" and MariLM alike." if s.get("mari_batches") != "tokens" else "; MariLM's passes are sized by tokens."),
        "- Entries: `hf` is lm-eval's HFLM; the others are `MariLM` without a bundle (vanilla) or with the bundle "
        "named (bundles trained by this run); `mari_open`: MARI with its gate's threshold forced to -inf (the gate "
        "opens on every question); `mari_gate_off`: `gate=false` (experts without the probe).",
        "",
    ]
    if shape["key"] != "llama2_7b":
        lines += [f"Issue 41's goals are set for the 7B shape; this run is at the {shape['name']} shape.", ""]
    lines += ["## Goals", "", markdown_table(["goal", "target", "reached", "figure"],
                                             [[g["goal"], g["target"], g["reached"], g["figure"]]
                                              for g in derived["goals"]]), ""]
    lines += ["## Evaluation wall time (lm_eval.simple_evaluate, end to end; 'in model': inside the model's request "
              "methods, HFLM's batch-size search included)", ""]
    headers = ["run", "task", "entry", "batch size (used)", "wall (s)", "x hf", "in model (s)", "x hf", "batch search (s)",
               "metric", "gate rate", "documents", "peak GPU"]
    lines += [markdown_table(headers, [[str(r["run"]), r["task"], r["entry"], f"{r['batch_size']} ({r['batch_used']})",
                                        _f(r["wall_s"], 1), _f(r["x_hf"]), _f(r["model_s"], 1), _f(r["model_x_hf"]),
                                        _f(r["batch_detect_s"], 1), _f(r["metric_mean"], 3), _f(r["gate_rate"]),
                                        str(r["documents"]), _gib(r["peak_allocated_bytes"])]
                                       for r in derived["evaluations"]]), ""]
    if derived.get("shared"):
        lines += ["## The repro's evaluation path: every entry through one shared pass (repro/engine/scoring.py)", "",
                  markdown_table(["run", "task", "entries", "documents", "wall (s), all entries", "in model (s)",
                                  "hf's wall (s), one entry", "question groups computed / served"],
                                 [[str(x["run"]), x["task"], ", ".join(x["entries"]), str(x["documents"]), _f(x["wall_s"], 1),
                                   _f(x["model_s"], 1), _f(x["hf_wall_s"], 1),
                                   f"{x['stats'].get('groups', 0)} / {x['stats'].get('served', 0)}"]
                                  for x in derived["shared"]]), ""]
    lines += [f"## Training on TruthfulQA's D_train (tiny settings: the time is not the point; max_ctrl "
              f"{s['max_ctrl']} per source, max_pca {s['max_pca']})", ""]
    lines += [markdown_table(["run", "method", "wall (s)", "train examples", "ctrl examples", "settings", "peak GPU"],
                             [[str(t["run"]), t["method"], _f(t["wall_s"], 1), str(t["train_examples"]), str(t["ctrl_examples"]),
                               json.dumps(t["hyperparameters_given"]), _gib(t["peak_allocated_bytes"])]
                              for t in derived["training"]]), ""]
    if derived["memories"]:
        lines += ["## Training memory against mari_eval.training.memory's estimate", "",
                  "The held state is measured when the first training stage starts (MARI's experts, ReFT's epochs) (allocated then, less what was "
                  "allocated before training); 'peak while preparing' is the peak up to then; 'a step adds' is how "
                  "far a training step's peak rose above the held state ('-': it stayed below the peak while preparing); "
                  "'a step (estimate)' is memory.step_estimate's largest step, part of the estimate since issue 59 "
                  "('-': a run recorded before it, whose estimate is weights + M alone).",
                  "",
                  markdown_table(["run", "method", "batch", "weights", "held state (estimate, M)", "held (measured)", "measured / M",
                                  "a step (estimate)", "estimate (weights + M + step)", "peak while preparing",
                                  "a step adds", "peak allocated",
                                  "peak / estimate"],
                                 [[str(m["run"]), m["method"], str(m.get("batch_size") or m.get("batch")), _gib(m["weights_bytes"]),
                                   _gib(m["held_estimate_bytes"]), _gib(m.get("held_measured_bytes")),
                                   _f(m.get("held_measured_over_estimate"), 3), _gib(m.get("step_estimate_bytes")),
                                   _gib(m["estimate_bytes"]),
                                   _gib(m.get("prepare_peak_bytes")), _gib(m.get("training_step_above_held_bytes")),
                                   _gib(m["peak_allocated_bytes"]), _f(m["peak_over_estimate"], 3)]
                                  for m in derived["memories"]]), ""]
    lines += ["## Generation (SORRY-Bench prompts, one at a time; medians; ratios to the base model of the same run; "
              "paper: Table 4's MARI / Base Model)", "",
              "`mari_gate_open_t1`: the gate open, generation routed over T_ent = 1 greedy step (`T_ent=1`) instead "
              "of the bundle's 8: the first token of a routed answer is known only when the routing window ends.", ""]
    headers = ["run", "mode", "prompts x tokens", "first token (ms)", "x base", "paper", "tokens/s", "x base", "paper", "total (s)", "x base",
               "paper", "gate rate", "tokens produced"]
    lines += [markdown_table(headers, [[str(g["run"]), g["mode"], f"{g['prompts']} x {g['tokens']}",
                                        _f(1000 * g["first_token_s"], 1), _f(g["first_token_s_x_base"]),
                                        _f(g["first_token_s_paper_x_base"]), _f(g["tokens_per_s"], 1),
                                        _f(g["tokens_per_s_x_base"]), _f(g["tokens_per_s_paper_x_base"]),
                                        _f(g["total_s"]), _f(g["total_s_x_base"]), _f(g["total_s_paper_x_base"]),
                                        _f(g["gate_rate"]), str(g["tokens_produced"])] for g in derived["generation"]]),
              ""]
    if derived["not_done"]:
        lines += ["## Steps not done (in any run; the last run's reason)", "", markdown_table(["run", "step", "status", "why"], [
            [str(n["run"]), n["step"], n["status"], (n["why"] or "")[:200]] for n in derived["not_done"]]), ""]
    return "\n".join(lines)


def render(raw_paths: list[Path], out: Path) -> list[Path]:
    """Write ``out``/gpu_bench.json and ``out``/gpu_bench.md from the raw records at ``raw_paths`` (``merge``)."""
    raw = merge([json.loads(path.read_text()) for path in raw_paths])
    derived = derive(raw)
    out.mkdir(parents=True, exist_ok=True)
    return [write_results_json(out / "gpu_bench.json", {**raw, "derived": derived}),
            atomic_write(out / "gpu_bench.md", markdown(raw, derived) + "\n")]
