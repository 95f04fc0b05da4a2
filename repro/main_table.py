"""Table 1: every method trained on each attribute and evaluated through lm-eval, ours beside the paper's.

    python repro/main_table.py                 # quick profile: the embedded model on 2 CPU cores, within 75 minutes
    python repro/main_table.py --profile standard  # the committed table (results/): larger sizes, about 3.5 h
    python repro/main_table.py --seeds 0       # the same with seed 0 alone (TruthfulQA's seeds 1 and 2 dropped)
    python repro/main_table.py --profile paper # the paper's models, full test sets, 3 seeds (GPU: bf16, device_map auto)
    python repro/main_table.py --dtype bfloat16 # the embedded model in bf16 (cached apart from float32)
    python repro/main_table.py --model Qwen/Qwen2-7B-Instruct --profile paper
    python repro/main_table.py --smoke         # tiny subsets, a few minutes (tests)
    python repro/main_table.py --plan --profile paper  # the steps, their cost and wall time on 1, 8, 32 GPUs; runs nothing
    python repro/main_table.py --recipe adapted # every baseline in its adapted recipe (default: published)
    python repro/main_table.py --methods vanilla,mari,repe  # a method of an installed package beside ours (docs/plugins.md)
    python repro/main_table.py --columns tqa_gen_bleu_acc,tqa_gen_rouge1_acc  # TruthfulQA generation (not in the default)

For each model and seed: Vanilla, Prompting, CAA, ITI, NL-ITI, ReFT, LoRA and MARI (``--methods`` chooses
the rows, any other method included) are trained on the
TruthfulQA, BBQ and SORRY-Bench training splits of that seed (``mari-eval train``) and
evaluated on the held-out splits (TruthfulQA MC1/MC2, BBQ disambiguated accuracy,
SORRY-Bench refusal rate by the LLM judge) and on MMLU (5-shot), ARC-Easy and
ARC-Challenge (25-shot) under each attribute's intervention (the columns without a tag under
TruthfulQA's, as the paper reports them; ``@bbq`` and ``@sorry`` under BBQ's and SORRY-Bench's).
Each baseline is trained under its published recipe, the same for every bundle (repro/engine/recipes.py;
``--recipe adapted`` for this suite's setting). Every bundle and
every evaluation is cached under runs/ by its configuration (repro/engine/cache.py): an
interrupted run continues where it stopped, a finished one is read back.

Writes main_table.{json,md,tex} under results/ for the standard profile, results/profiles/NAME/
for the others (or --out): mean ± std over seeds, the number of
documents behind each cell, the model, seeds and subset sizes, and the paper's figure for
its closest model in a separate column.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from repro.engine import cache, command_line, planning, profiles, recipes, scoring, steps
from repro.analysis import gate_open, tables
from repro.engine.profiles import BENCHMARKS, METHODS, method_label

EXTRA = [profiles.KEYWORD_REFUSAL, *profiles.GENERAL_UNDER_OTHERS]
# What the intro says of the optional columns, by their names without an @tag (repro/engine/profiles.py).
OPTIONAL_NOTES = {
    ("bbq_amb_acc", "bbq_amb_bias"): "`bbq_amb_acc` and `bbq_amb_bias`: BBQ's ambiguous-context accuracy and bias score "
                                     "s_AMB (a mean of +1 stereotyped answer / -1 the other person / 0 unknown; "
                                     "harness_tasks/bbq_bias.py), under the BBQ bundle.",
    ("xstest_safe_refusal", "xstest_unsafe_compliance"): "`xstest_safe_refusal` and `xstest_unsafe_compliance`: XSTest's "
                                                         "safe prompts refused and unsafe prompts complied with (keyword "
                                                         "judge), under the SORRY-Bench bundle.",
    ("kl", "ce"): "`kl` and `ce` (in-source): the steered model's KL divergence from the untouched one and its "
                  "cross-entropy, in nats per token, on exam text (MMLU and ARC-Challenge question texts; "
                  "mari_eval/evaluation/divergence.py), the source of MARI's \"not applicable\" gate calibration.",
    ("kl_benign", "ce_benign"): "`kl_benign` and `ce_benign` (out of source): the same on Self-Instruct's 252 "
                                "user-oriented requests, none of which any method reads before this test: each request "
                                "as one chat user turn, then the first 64 tokens of its authors' answer, the KL over "
                                "the answer's tokens (repro/engine/divergence_run.py).",
    ("benign_refusal",): "`benign_refusal`: the share of those 252 requests refused (keyword judge), answered greedily "
                         "as one chat user turn under the SORRY-Bench bundle (benign over-refusal).",
}
# The rows' gates: the JSON's rows carry ``gate_open`` (repro/analysis/gate_open.py).
GATE_NOTE = ("Each gated row's JSON holds `gate_open`: the share of each evaluation set's documents on which its gate "
             "opened, per seed.")


def run(profile: profiles.Profile, store: cache.Store, methods: list[str] = METHODS, columns=BENCHMARKS + EXTRA,
        recipe: str = recipes.MAIN_TABLE_RECIPE, extras: dict[str, tuple] | None = None) -> tuple[dict, dict, dict]:
    """({model: {method: {column: {"values": [per seed], "n": docs}}}}, {model: {method: [recipe notes]}},
    {model: {method: {evaluation set: the gate's open rate per seed}}}: repro/analysis/gate_open.py).

    ``recipe``: every baseline's training recipe, ``published`` (default) or ``adapted``. ``extras``:
    rows of bundles made elsewhere ({name: (directory, method)}, ``--extra-bundle``), each answering
    every column."""
    by_seed = profile.seeded_columns(columns)  # quick, standard: TruthfulQA's columns under 3 seeds
    steps = [(m, s, meth) for m in profile.models for s in by_seed for meth in methods]
    cells: dict = {}
    notes: dict = {}
    gates: dict = {}
    rows: dict[tuple, dict[str, scoring.Row]] = {}  # per (model, seed), every method's bundles, scored together
    for model, seed, method in tqdm(steps, desc="main table: training", unit="method"):
        attributes = sorted({c[3] for c in by_seed[seed]}) if method != "vanilla" else []
        bundles = {a: recipes.table_bundle(store, method, a, model, seed, profile, recipe) for a in attributes}
        if method in recipes.BASELINES:
            notes.setdefault(model, {}).setdefault(method, []).append(f"seed {seed}: {recipe} recipe")
        rows.setdefault((model, seed), {})[method] = (bundles, "")
    for (model, seed), by_method in rows.items():
        by_method.update(_extra_rows(extras, by_seed[seed]))
        for method, scores in scoring.score_rows(store, profile, model, seed, by_seed[seed], by_method).items():
            tables.tally(cells, model, method, scores, seed=seed)
            gate_open.add(gates, model, method, seed, profile, by_seed[seed], scores)
    return cells, notes, gates


def against_mari(rows: list[str]) -> list[tuple[str, str]]:
    """The table's second family of paired tests: every row but Vanilla against MARI (the paper's
    claim that MARI beats each baseline; issue 39 asks for Prompting and LoRA against it), when
    MARI is a row."""
    mari = method_label("mari")
    return [(row, mari) for row in rows if row not in (mari, method_label("vanilla"))] if mari in rows else []


def _extra_rows(extras: dict[str, tuple] | None, columns: list[tuple]) -> dict[str, scoring.Row]:
    """The ``--extra-bundle`` rows: each bundle under every attribute of ``columns``."""
    return {name: ({c[3]: directory for c in columns}, "") for name, (directory, _) in (extras or {}).items()}


def plan(profile: profiles.Profile, store: cache.Store, methods: list[str] = METHODS, columns=BENCHMARKS + EXTRA,
         recipe: str = recipes.MAIN_TABLE_RECIPE, extras: dict[str, tuple] | None = None) -> steps.Graph:
    """``run``'s work as a graph of steps (repro/engine/planning.py), nothing run: a training step per
    bundle, an evaluation step per group of rows and tasks that share a pass."""
    graph = steps.Graph()
    for name, (directory, _) in (extras or {}).items():  # made elsewhere: nothing to train
        graph.add(steps.Step(directory.name, steps.TRAIN, f"bundle {name}, made elsewhere", cached=True))
    for model in profile.models:
        for seed, seed_columns in profile.seeded_columns(columns).items():
            rows: dict[str, scoring.Row] = _extra_rows(extras, seed_columns)
            method_of: dict = {directory: method for directory, method in (extras or {}).values()}
            for method in methods:
                bundles = {}
                for attribute in (sorted({c[3] for c in seed_columns}) if method != "vanilla" else []):
                    final = planning.train_step(graph, store, profile, method, attribute, model, seed,
                                                recipes.table_settings(method, profile, recipe))
                    bundles[attribute], method_of[final] = final, method
                rows[method] = (bundles, "")
            planning.evaluation_steps(graph, store, profile, model, seed, seed_columns, rows, method_of)
    return graph


def paper_figures(model: str) -> tuple[str, dict[str, dict[str, str]]]:
    paper_model = profiles.CLOSEST_PAPER_MODEL.get(model, "Llama-2-7B")
    return paper_model, {r["method"]: r for r in tables.paper_rows("table1_main") if r["model"] == paper_model}


def main(argv: list[str] | None = None) -> int:
    def options(parser):
        parser.add_argument("--methods", default=",".join(METHODS),
                            help="comma-separated rows (default: %(default)s): vanilla and any method mari-eval knows, "
                                 "an installed package's included (docs/plugins.md)")
        parser.add_argument("--extra-bundle", action="append", metavar="NAME=DIR",
                            help="a row NAME scoring the bundle DIR made elsewhere (an imported control vector, "
                                 "docs/methods.md) on every column, beside --methods' rows; repeatable")
        planning.add_arguments(parser)
        parser.add_argument("--recipe", default=recipes.MAIN_TABLE_RECIPE, choices=recipes.RECIPES,
                            help="every baseline's training recipe (default: %(default)s, the same for every bundle; "
                                 "repro/engine/recipes.py)")

    args, profile, store, command = command_line.start(__doc__, "main_table.py", argv, options)
    methods = command_line.methods_listed(args.methods)
    taken = [*methods, *map(method_label, methods)]  # an extra row's name must differ from both
    extras = command_line.extra_bundles(args.extra_bundle, store, taken, copy=not args.plan)
    started = time.time()
    optional = (profiles.TQA_GENERATION + profiles.BBQ_AMBIGUOUS + profiles.XSTEST + profiles.GENERAL_TEXT
                + profiles.BENIGN_TEXT + profiles.BENIGN_REFUSAL)
    scored = BENCHMARKS + EXTRA + [c for c in optional if c[0] in profile.more_columns]
    columns = command_line.select(scored, args.columns, [c for c in optional if c not in scored])
    title = f"main table, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store, methods, columns, args.recipe, extras), title,
                                 store, profile):
        return 0
    cells, notes, gates = run(profile, store, methods, columns, args.recipe, extras)
    label = {**{m: method_label(m) for m in methods}, **{name: name for name in extras}}
    labelled = {model: {label[m]: cols for m, cols in by_method.items()} for model, by_method in cells.items()}
    notes = {model: {method_label(m): lines for m, lines in by_method.items()} for model, by_method in notes.items()}
    gates = {model: {label[m]: sets for m, sets in by_method.items()} for model, by_method in gates.items()}
    intro = ("Ours: mean ± std over seeds (std only with several seeds); n = test documents per cell. "
             "TruthfulQA, MMLU, ARC in %; BBQ and SORRY-Bench as fractions, as the paper prints them. "
             "mmlu, arc_e and arc_c run under the TruthfulQA-trained intervention, the columns tagged @bbq and "
             "@sorry under the BBQ- and SORRY-Bench-trained ones. `sorry_keyword` is the keyword refusal "
             "rate (no judge), ours only. The paper column is the paper's Table 1 for its closest model: "
             "not the same model, not comparable in size. Each baseline's training recipe (published: its "
             "authors', the same for every bundle, repro/engine/recipes.py; adapted: this suite's setting; docs/baselines.md) is "
             "listed under the table. "
             "Every row is also tested against MARI, a second family for Holm's adjustment."
             + "".join(f" {note}" for names, note in OPTIONAL_NOTES.items() if any(c[0].split("@")[0] in names for c in columns))
             + (f" {GATE_NOTE}" if gates else ""))
    tables.write_tables(Path(args.out), "main_table", "Table 1: main results", intro, labelled,
                        [c[0] for c in columns], paper_figures, profile, command, time.time() - started, store, notes,
                        comparisons=against_mari(list(label.values())), gate_open=gates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
