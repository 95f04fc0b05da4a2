"""Speed benchmark: lm-eval's ``--model hf`` against our vanilla pass-through, MARI and the
baselines, on the same requests, on the same machine, in one run.

    python repro/bench.py --bundle mari=DIR --bundle caa=DIR ... [--limit 100] [--gen-prompts 50]
    python repro/bench.py --from-runs standard [--limit 100] [--gen-prompts 10]

``--from-runs PROFILE`` times the repro scripts' own bundles of that profile (the first
seed): every method's TruthfulQA bundle on ``mc`` and SORRY-Bench bundle on ``gen``, and
MARI with its gate forced open as ``mari_open``; they are read from ``--runs`` (where
``main_table.py`` caches them, each baseline in the main table's recipe) or trained there
now, so the timed bundles have a recorded training command and configuration
(runs/bundles/*/repro_config.json).

Workloads:

* ``mc``: lm-eval ``truthfulqa_mc2`` (all 817 questions unless ``--limit``), through
  ``simple_evaluate``, batch size ``--batch-size`` for everyone; a 1-question warm-up
  is run first and not timed. Wall time per repeat; the median is reported.
* ``gen``: the first ``--gen-prompts`` SORRY-Bench prompts (chat template), one at a
  time, greedy, ``--gen-tokens`` tokens each (EOS is suppressed by ``min_new_tokens``):
  first-token latency (until the first answer token is streamed; for MARI that is after
  its routing window when the gate opens), total latency, and tokens/s of decoding after
  the first token. Medians over prompts and repeats. ``--gen-bundle NAME=DIR`` times
  another bundle of the same entry here (e.g. MARI trained on sorry_bench).

MARI's cost depends on how often its gate opens, so its gate rate is reported beside
its timings.

Every entry loads the model in the placement of ``--dtype``, ``--device`` and ``--device-map``
(``mari-eval train``'s flags; default: dtype auto, the checkpoint's own, on cuda when
available, else cpu), lm-eval's ``hf`` included, so all compare on the same footing.

Every (entry, workload) runs in a fresh subprocess, so its peak resident memory is its
own. Writes results/bench.json and results/bench.md with the command, the machine and
the ratios to ``hf``. Benchmarks, not tests: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from mari_eval.benchmarks.tasks import task_manager
from mari_eval.cli import add_placement_arguments
from mari_eval.injection.devices import Placement
from mari_eval.storage.files import check_writable_dir, write_results_json
from mari_eval.storage.models import resolve_model
from repro.engine import profiles, recipes
from repro.engine.cache import Store
from repro.engine.command_line import at_least, listed
from repro.analysis.tables import markdown_table
from repro.benchmark.timing import gate_rate, sorry_prompt_ids, time_generation

REPO = Path(__file__).resolve().parents[1]
# The methods --from-runs times, MARI first: MARI and the paper's four baselines (results/bench.*, as committed).
BENCH_METHODS = ("mari", "caa", "iti", "nl_iti", "reft")
WORKLOADS = ("mc", "bbq", "gen")  # truthfulqa_mc2 and lm-eval's bbq log-likelihoods; SORRY-Bench generations
TASKS = {"mc": "truthfulqa_mc2", "bbq": "bbq"}  # the log-likelihood workloads' lm-eval tasks


# ----------------------------------------------------------------------------- one measurement (subprocess)


PLACEMENT_FIELDS = ("dtype", "device", "device_map", "max_memory_per_gpu", "max_cpu_memory")


def placement_of(args):
    """The ``train.Placement`` of bench's flags (or of any namespace with its fields, e.g. latency.py's)."""
    return Placement(**{k: getattr(args, k, None) for k in PLACEMENT_FIELDS if getattr(args, k, None) is not None})


def _placement_argv(placement) -> list[str]:
    """The flags that give a worker process ``placement``."""
    argv = []
    for name in PLACEMENT_FIELDS:
        value = getattr(placement, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def batch_size_option(text: str) -> int | str:
    """--batch-size: a number of requests (at least 1) or ``auto``, as lm-eval takes them."""
    return "auto" if text == "auto" else at_least(1)(text)


batch_size_option.__name__ = "batch size (an integer >= 1 or auto)"


def _lm(entry: str, model: str, bundle: str | None, batch_size: int | str, model_args: str = "", placement=None):
    import torch  # deferred: torch is heavy; only this path needs it
    from lm_eval.api.registry import get_model  # deferred: lm-eval is heavy; only this path needs it

    placed = placement or Placement()
    # The same placement for everyone; the device named, since lm-eval's hf has its own default.
    kwargs = {**placed.model_args(), "device": placed.device or ("cuda" if torch.cuda.is_available() else "cpu")}
    if entry == "hf":
        return get_model("hf").create_from_arg_string(f"pretrained={resolve_model(model)},batch_size={batch_size}", kwargs)
    args = f"pretrained={model},batch_size={batch_size}" + (f",bundle={bundle}" if bundle else "") + (
        f",{model_args}" if model_args else "")
    return get_model("mari").create_from_arg_string(args, kwargs)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure_task(lm, task: str, limit: int | None, repeats: int) -> dict:
    from lm_eval import simple_evaluate  # deferred: lm-eval is heavy; only this path needs it
    manager = task_manager([task])
    run = lambda n: simple_evaluate(model=lm, tasks=[task], limit=n, task_manager=manager, bootstrap_iters=0)
    run(1)  # warm-up, not timed
    walls, acc = [], None
    for _ in range(repeats):
        if hasattr(lm, "records"):
            lm.records.clear()
        t = time.perf_counter()
        out = run(limit)
        walls.append(time.perf_counter() - t)
        acc = out["results"][task]["acc,none"]
    return {"wall_s": walls, "acc": acc, "questions": out["n-samples"][task]["effective"],
            "gate_rate": gate_rate(lm)}


def measure_gen(lm, prompts: int, tokens: int, repeats: int) -> dict:
    """The first ``prompts`` SORRY-Bench prompts, one at a time (``repro.benchmark.timing``)."""
    return time_generation(lm, sorry_prompt_ids(lm, prompts), tokens, repeats)


def worker(args) -> None:
    lm = _lm(args.entry, args.model, args.bundle_dir, args.batch_size, args.model_args or "", placement_of(args))
    if args.workload in TASKS:
        result = measure_task(lm, TASKS[args.workload], args.limit or None, args.repeats)
    else:
        result = measure_gen(lm, args.gen_prompts, args.gen_tokens, args.repeats)
    result["peak_rss_mib"] = _peak_rss_mib()
    print("BENCH " + json.dumps(result))


# ----------------------------------------------------------------------------- the run


def run_one(args, entry: str, bundle: str | None, workload: str) -> dict:
    """One measurement in a fresh process (its own peak memory); its BENCH line parsed."""
    command = [sys.executable, __file__, "--worker", "--entry", entry, "--workload", workload, "--model", args.model,
               "--batch-size", str(args.batch_size), "--limit", str(args.limit), "--repeats", str(args.repeats),
               "--gen-prompts", str(args.gen_prompts), "--gen-tokens", str(args.gen_tokens),
               *_placement_argv(placement_of(args))]
    if bundle:
        directory, _, model_args = bundle.partition(",")
        command += ["--bundle-dir", directory] + (["--model-args", model_args] if model_args else [])
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench {entry}/{workload} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def table(results: dict, tokens: int) -> list[str]:
    """The Markdown table of ``results`` (repro.analysis.tables.markdown_table), ratios to lm-eval's ``hf``."""
    hf = results["hf"]
    tasks = [w for w in TASKS if any(w in r for r in results.values())]
    names = {"mc": "TQA MC2", "bbq": "BBQ"}
    headers = ["entry"] + [h for w in tasks for h in (f"{names[w]} wall (s)", "x hf", "acc")] + [
        "first token (ms)", "x hf", "tokens/s", "x hf", f"{tokens}-token latency (s)", "x hf",
        "gate rate (" + " / ".join(tasks + ["gen"]) + ")", "peak RSS (MiB)"]
    rows = []
    for entry, r in results.items():
        cells = [entry]
        for w in tasks:
            if r.get(w) and hf.get(w):
                wall = statistics.median(r[w]["wall_s"])
                cells += [f"{wall:.1f}", f"{wall / statistics.median(hf[w]['wall_s']):.3f}", f"{100 * r[w]['acc']:.2f}"]
            else:
                cells += ["-"] * 3
        gen, hf_gen = r.get("gen"), hf.get("gen")
        if gen and hf_gen:
            cells += [f"{1000 * gen['first_token_s']:.0f}", f"{gen['first_token_s'] / hf_gen['first_token_s']:.2f}",
                      f"{gen['tokens_per_s']:.1f}", f"{gen['tokens_per_s'] / hf_gen['tokens_per_s']:.2f}",
                      f"{gen['total_s']:.2f}", f"{gen['total_s'] / hf_gen['total_s']:.2f}"]
        else:
            cells += ["-"] * 6
        rates = [(r.get(w) or {}).get("gate_rate") for w in tasks + ["gen"]]
        cells.append(" / ".join("-" if x is None else f"{x:.2f}" for x in rates))
        cells.append(f"{max((x or {}).get('peak_rss_mib', 0) for x in r.values()):.0f}")
        rows.append(cells)
    return markdown_table(headers, rows).split("\n")


def repro_bundles(profile_name: str, model: str, runs: str, placement) -> tuple[dict[str, str], dict[str, str]]:
    """The repro cache's TruthfulQA (mc) and SORRY-Bench (gen) bundles of every method, trained
    now where missing (paths relative to the working directory, as the timed processes see them)."""
    if profile_name not in profiles.PROFILES:
        raise SystemExit(f"--from-runs {profile_name!r}: choose one of {sorted(profiles.PROFILES)}")
    profile = profiles.PROFILES[profile_name]
    store = Store(runs, placement=placement)
    seed = profile.seeds[0]

    def where(method: str, attribute: str) -> str:
        return os.path.relpath(recipes.table_bundle(store, method, attribute, model, seed, profile))

    mc = {m: where(m, "truthfulqa") for m in BENCH_METHODS}  # MARI first
    gen = {m: where(m, "sorry_bench") for m in BENCH_METHODS}
    return {**mc, "mari_open": mc["mari"] + ",gate=false"}, {**gen, "mari_open": gen["mari"] + ",gate=false"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--bundle", action="append", default=[], metavar="NAME=DIR[,ARGS]",
                   help="a trained bundle to time (repeatable); ARGS: model args, e.g. mari_open=DIR,gate=false")
    p.add_argument("--gen-bundle", action="append", default=[], metavar="NAME=DIR",
                   help="the bundle NAME is timed with on the gen workload (default: its --bundle)")
    p.add_argument("--limit", type=at_least(0), default=0, help="truthfulqa_mc2 and bbq questions (0 = all)")
    p.add_argument("--gen-prompts", type=at_least(1), default=50)
    p.add_argument("--gen-tokens", type=at_least(1), default=128)
    p.add_argument("--batch-size", type=batch_size_option, default=8,
                   help="lm-eval's batch_size for every entry: requests per batch, or auto (hf: its own search; "
                        "mari: a token budget, mari_eval/evaluation/batching.py)")
    p.add_argument("--repeats", type=at_least(1), default=1)
    p.add_argument("--workloads", default="mc,gen", help="comma-separated, of: " + ", ".join(WORKLOADS)
                   + " (bbq is timed with each entry's mc bundle)")
    p.add_argument("--out", default=str(REPO / "results"))
    add_placement_arguments(p.add_argument_group(
        "placement", "Where every entry (hf included) loads the model: mari-eval train's flags."))
    # internal: one measurement in a subprocess
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--entry", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--bundle-dir", help=argparse.SUPPRESS)
    p.add_argument("--model-args", help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="remeasure entries already in the output's bench.json")
    p.add_argument("--from-runs", metavar="PROFILE", help="time the repro scripts' bundles of this profile (see above)")
    p.add_argument("--runs", default=str(REPO / "runs"), help="with --from-runs: the repro cache (default: runs/)")
    args = p.parse_args()
    try:
        placement = placement_of(args)
    except ValueError as e:
        p.error(str(e))
    if args.worker:
        worker(args)
        return 0

    try:
        workloads = listed(args.workloads, "--workloads")
    except SystemExit as e:
        p.error(str(e))
    if set(workloads) - set(WORKLOADS):  # an unknown name was timed as gen before
        p.error(f"--workloads {args.workloads!r}: unknown {sorted(set(workloads) - set(WORKLOADS))}; choose from "
                + ", ".join(WORKLOADS))
    out = Path(args.out)
    try:
        check_writable_dir(out, "--out ")  # before the timings it will hold
    except ValueError as e:
        p.error(str(e))

    def bundles(items: list[str], flag: str) -> dict[str, str]:
        out = {}
        for item in items:
            name, sep, directory = item.partition("=")
            if not sep or not Path(directory.partition(",")[0], "bundle.json").is_file():
                p.error(f"{flag} {item!r}: expected NAME=DIR with DIR/bundle.json (train one with `mari-eval train`)")
            out[name] = directory
        return out

    mc_bundles, gen_bundles = bundles(args.bundle, "--bundle"), bundles(args.gen_bundle, "--gen-bundle")
    if args.from_runs:
        cached_mc, cached_gen = repro_bundles(args.from_runs, args.model, args.runs, placement)
        mc_bundles, gen_bundles = {**cached_mc, **mc_bundles}, {**cached_gen, **gen_bundles}
    entries = {"hf": {}, "vanilla": {}}
    for name in [*mc_bundles, *gen_bundles]:
        entries[name] = {"mc": mc_bundles.get(name), "bbq": mc_bundles.get(name),
                         "gen": gen_bundles.get(name, mc_bundles.get(name))}
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python repro/bench.py " + " ".join(sys.argv[1:]),
        "model": args.model, "bundles": {k: v for k, v in entries.items() if v}, "batch_size": args.batch_size,
        "limit": args.limit or "all", "repeats": args.repeats, "machine": platform.platform(),
        "processor": platform.processor(), "cpus": os.cpu_count(), "placement": asdict(placement), "results": {},
    }
    # Measurements of an earlier run with the same settings are kept (an interrupted or extended run
    # measures only what is missing); --force remeasures.
    settings = ("model", "batch_size", "limit", "repeats", "machine")
    previous = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() and not args.force else {}
    if (any(previous.get(k) != record[k] for k in settings) or previous.get("gen") != [args.gen_prompts, args.gen_tokens]
            or previous.get("placement") != record["placement"]):  # one without a placement predates the flags
        previous = {}
    record["gen"] = [args.gen_prompts, args.gen_tokens]
    record["kept_from_earlier_run"] = []
    started = time.time()
    for entry, dirs in entries.items():
        for workload in workloads:
            if entry not in ("hf", "vanilla") and not dirs.get(workload):
                continue
            kept = previous.get("results", {}).get(entry, {}).get(workload)
            if kept is not None and previous.get("bundles", {}).get(entry, {}).get(workload) == dirs.get(workload):
                record["results"].setdefault(entry, {})[workload] = kept
                record["kept_from_earlier_run"].append(f"{entry}/{workload}")
                continue
            print(f"bench: {entry} / {workload} ...", file=sys.stderr, flush=True)
            record["results"].setdefault(entry, {})[workload] = run_one(args, entry, dirs.get(workload), workload)
            # Written after every measurement, so an interrupted run keeps what it measured.
            write_results_json(out / "bench.json", {**record, "complete": False})
    record["wall_time_s"] = round(time.time() - started, 1)
    results = record["results"]
    placed = ", ".join(f"{k} {v}" for k, v in record["placement"].items() if v is not None)
    write_results_json(out / "bench.json", {**record, "complete": True})  # strict JSON: NaN as null
    lines = ["# Speed benchmark\n",
             f"Generated by `{record['command'].strip()}` on {record['machine']} in {record['wall_time_s']:.0f} s"
             + (f" ({len(record['kept_from_earlier_run'])} measurements kept from an earlier run of it with the same "
                "settings, bench.json `kept_from_earlier_run`). " if record["kept_from_earlier_run"] else ". ") +
             f"Model `{args.model}` ({placed}); "
             + ", ".join(f"{TASKS[w]} ({record['limit']} questions)" for w in workloads if w in TASKS)
             + f" at batch size {args.batch_size} (bbq with each entry's mc bundle); "
             f"{args.gen_prompts} SORRY-Bench generations of {args.gen_tokens} tokens, one at a time. "
             f"Medians of {args.repeats} repeat(s); warm-up excluded; ratios are to lm-eval's `--model hf`.\n"]
    lines += [f"- `{name}`: " + ", ".join(f"{w} bundle `{d}`" for w, d in dirs.items() if d) for name, dirs in entries.items() if dirs]
    lines += [""] + table(results, args.gen_tokens)
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
