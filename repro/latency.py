"""Table 4: generation cost of Base, Prompting, ITI, NL-ITI, ReFT, LoRA and MARI (SORRY-Bench-trained bundles).

    python repro/latency.py [--profile quick|standard|large|paper|smoke] [--model ID] [--prompts 10] [--tokens 128] [--dtype bfloat16]
    python repro/latency.py --methods iti,nl_iti,reft,mari   # the paper's rows alone
    python repro/latency.py --plan --profile paper  # the bundles it trains first; runs nothing

Times greedy generations of SORRY-Bench prompts, one at a time, with the benchmark's
code (repro/bench.py, one fresh process per method): first-token latency (FTL, until
the first answer token is streamed), tokens/s after it (TPS) and total latency (TTLT).
The bundles are the main table's SORRY-Bench ones (same cache under runs/; each baseline in
the main table's recipe, repro/engine/recipes.py). Writes
results/latency.{json,md,tex} with the paper's Table 4 beside ours (its hardware and
model differ: compare ratios to Base, not absolute numbers). The bundles are trained and
the timed processes load the model in the placement of --dtype/--device/--device-map.
The bundles are the steps of its plan (``--plan``; ``--executor ray`` trains them on a Ray
cluster); the timings themselves always run on this machine, one after another, so that their
ratios compare like with like.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from repro import bench
from repro.engine import cache, command_line, planning, profiles, recipes, steps
from repro.analysis import tables

ROWS = {"Base Model": None, "ITI": "iti", "NLITI": "nl_iti", "ReFT": "reft", "MARI": "mari"}  # the paper's labels
# The paper's rows and the two simple baselines (their cost, issue 39); --methods chooses others.
DEFAULT_METHODS = ("prompting", "iti", "nl_iti", "reft", "lora", "mari")


def rows_of(methods: list[str]) -> dict[str, str | None]:
    """{row label: method}: Base Model first, then ``methods`` under the paper's labels where it
    has one, else the method's own (a plugin's)."""
    paper = {method: label for label, method in ROWS.items() if method is not None}
    return {"Base Model": None, **{paper.get(m) or profiles.method_label(m): m for m in methods}}


def plan(profile: profiles.Profile, store: cache.Store, rows: dict[str, str | None] = ROWS) -> steps.Graph:
    """The bundles ``run`` times, as steps (repro/engine/planning.py); the timings are not steps."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            for method in filter(None, rows.values()):
                planning.train_step(graph, store, profile, method, "sorry_bench", model, seed,
                                    recipes.table_settings(method, profile))
    return graph


def run(profile: profiles.Profile, store: cache.Store, prompts: int, tokens: int,
        rows: dict[str, str | None] = ROWS) -> dict:
    cells: dict = {}
    timed = [(m, s, label) for m in profile.models for s in profile.seeds for label in rows]
    for model, seed, label in tqdm(timed, desc="latency", unit="method"):
        method = rows[label]
        bundle = None if method is None else recipes.table_bundle(store, method, "sorry_bench", model, seed, profile)
        args = SimpleNamespace(model=model, batch_size=1, limit=0, repeats=1, gen_prompts=prompts, gen_tokens=tokens,
                               **profiles.asdict(store.placement))  # bench's worker loads the model in this placement
        result = bench.run_one(args, "vanilla", str(bundle) if bundle else None, "gen")
        row = cells.setdefault(model, {}).setdefault(label, {})
        for column, value in (("ftl_ms", 1000 * result["first_token_s"]), ("tps", result["tokens_per_s"]),
                              ("ttlt_s", result["total_s"])):
            row.setdefault(column, {"values": [], "n": prompts})["values"].append(value)
        rate = result.get("gate_rate")  # MARI: a closed gate costs the probe, an open one the experts too
        row.setdefault("gate_rate", {"values": [], "n": prompts})["values"].append(float("nan") if rate is None else rate)
    for rows in cells.values():  # ratios to Base, the comparable part
        base = rows["Base Model"]
        for row in rows.values():
            for column in ("ftl_ms", "tps", "ttlt_s"):
                row[f"{column}_x_base"] = {"values": [v / b for v, b in zip(row[column]["values"], base[column]["values"])],
                                           "n": prompts}
    return cells


def paper_figures(model: str):
    rows = {r["method"]: dict(r) for r in tables.paper_rows("table4_latency")}
    for row in rows.values():  # the paper's ratios to its base model, for the x_base columns
        base = rows["Base Model"]
        for column in ("ftl_ms", "tps", "ttlt_s"):
            row[f"{column}_x_base"] = f"{float(row[column]) / float(base[column]):.2f}"
    return "(the paper's setup)", rows


def main(argv: list[str] | None = None) -> int:
    def sizes(parser):
        parser.add_argument("--prompts", type=command_line.at_least(1), help="SORRY-Bench prompts timed (default 10; smoke 2)")
        parser.add_argument("--tokens", type=command_line.at_least(1), help="greedy tokens per prompt (default 128; smoke 4)")
        parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                            help="rows beside the base model (default: %(default)s, the paper's): any method mari-eval "
                                 "knows, the simple baselines prompting and lora, an installed package's (docs/plugins.md)")
        planning.add_arguments(parser)

    args, profile, store, command = command_line.start(__doc__, "latency.py", argv, sizes)
    smoke = profile.name == "smoke"  # the smoke profile's sizes are defaults only: given ones are used
    prompts = args.prompts if args.prompts is not None else 2 if smoke else 10
    tokens = args.tokens if args.tokens is not None else 4 if smoke else 128
    started = time.time()
    rows = rows_of(command_line.methods_listed(args.methods, extra=()))
    title = f"latency, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, rows), title, store, profile):
        print(f"  then {len(rows) * len(profile.models) * len(profile.seeds)} timed runs of {prompts} prompts x "
              f"{tokens} tokens on this machine (not steps: timings compare on one machine)")
        return 0
    cells = run(profile, store, prompts, tokens, rows)
    intro = (f"{prompts} SORRY-Bench prompts, {tokens} greedy tokens each, one at a time; medians. "
             "FTL in ms, TPS in tokens/s after the first token, TTLT in s; x_base: ratio to our Base Model; "
             "gate_rate: fraction of the prompts on which MARI's gate opened (ours only). "
             "The paper's absolute numbers come from other hardware and models.")
    columns = ["ftl_ms", "ftl_ms_x_base", "tps", "tps_x_base", "ttlt_s", "ttlt_s_x_base", "gate_rate"]
    tables.write_tables(Path(args.out), "latency", "Table 4: inference cost", intro, cells, columns, paper_figures,
                        profile, command, time.time() - started, store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
