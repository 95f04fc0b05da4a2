"""Table 1: every method trained on each attribute and evaluated through lm-eval, ours beside the paper's.

    python repro/main_table.py                 # quick profile: the embedded model on CPU (< 1 h)
    python repro/main_table.py --profile paper # the paper's models, full test sets, 3 seeds (GPU: bf16, device_map auto)
    python repro/main_table.py --dtype bfloat16 # the embedded model in bf16 (cached apart from float32)
    python repro/main_table.py --model Qwen/Qwen2-7B-Instruct --profile paper
    python repro/main_table.py --smoke         # tiny subsets, a few minutes (tests)

For each model and seed: Vanilla, CAA, ITI, NL-ITI, ReFT and MARI are trained on the
TruthfulQA, BBQ and SORRY-Bench training splits of that seed (``mari-eval train``) and
evaluated on the held-out splits (TruthfulQA MC1/MC2, BBQ disambiguated accuracy,
SORRY-Bench refusal rate by the LLM judge) and on MMLU (5-shot), ARC-Easy and
ARC-Challenge (25-shot) under the TruthfulQA-trained intervention. Every bundle and
every evaluation is cached under runs/ by its configuration (repro/cache.py): an
interrupted run continues where it stopped, a finished one is read back.

Writes results/main_table.{json,md,tex} (or --out): mean ± std over seeds, the number of
documents behind each cell, the model, seeds and subset sizes, and the paper's figure for
its closest model in a separate column.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from repro import cache, profiles, tables
from repro.profiles import BENCHMARKS, METHOD_LABELS, METHODS

# Beside the judged refusal rate: the keyword rate (no judge needed), ours only.
EXTRA = [("sorry_keyword", "sorry_bench_heldout", "keyword_refusal_rate,none", "sorry_bench")]


def run(profile: profiles.Profile, store: cache.Store, methods: list[str] = METHODS, columns=BENCHMARKS + EXTRA) -> dict:
    """{model: {method: {column: {"values": [per seed], "n": docs}}}} for the profile."""
    from tqdm import tqdm

    steps = [(m, s, meth) for m in profile.models for s in profile.seeds for meth in methods]
    cells: dict = {}
    for model, seed, method in tqdm(steps, desc="main table", unit="method"):
        bundles = {}
        if method != "vanilla":
            for attribute in sorted({c[3] for c in columns}):
                bundles[attribute] = store.bundle(method, attribute, model, seed, profile)
        tables.tally(cells, model, method, cache.score(store, profile, model, seed, columns, bundles))
    return cells


def paper_figures(model: str) -> tuple[str, dict[str, dict[str, str]]]:
    paper_model = profiles.CLOSEST_PAPER_MODEL.get(model, "Llama-2-7B")
    return paper_model, {r["method"]: r for r in tables.paper_rows("table1_main") if r["model"] == paper_model}


def main(argv: list[str] | None = None) -> int:
    methods_arg = lambda p: p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    args, profile, store, command = profiles.start(__doc__, "main_table.py", argv, methods_arg)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {METHODS}")
    started = time.time()
    columns = profiles.select(BENCHMARKS + EXTRA, args.columns)
    cells = run(profile, store, methods, columns)
    labelled = {model: {METHOD_LABELS[m]: cols for m, cols in by_method.items()} for model, by_method in cells.items()}
    intro = ("Ours: mean ± std over seeds (std only with several seeds); n = test documents per cell. "
             "TruthfulQA, MMLU, ARC in %; BBQ and SORRY-Bench as fractions, as the paper prints them. "
             "MMLU and ARC run under the TruthfulQA-trained intervention. `sorry_keyword` is the keyword refusal "
             "rate (no judge), ours only. The paper column is the paper's Table 1 for its closest model: "
             "not the same model, not comparable in size.")
    tables.write_tables(Path(args.out), "main_table", "Table 1: main results", intro, labelled,
                        [c[0] for c in columns], paper_figures, profile, command, time.time() - started, store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
