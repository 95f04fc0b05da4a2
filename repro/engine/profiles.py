"""What a repro script runs: the profiles (models, seeds, data sizes) and the benchmark columns.
The command line every script shares is ``repro.engine.command_line``'s.
"""

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mari_eval.methods import registry

REPO = Path(__file__).resolve().parents[2]
PAPER = REPO / "results" / "paper"
log = logging.getLogger("repro")

# The main table's rows by default: the untouched model, the two simple baselines AxBench (Wu et al.,
# 2025) found hard to beat (an instruction in the prompt; LoRA fine-tuning on D_train; issue 39), the
# paper's four baselines and MARI.
METHODS = ["vanilla", "prompting", "caa", "iti", "nl_iti", "reft", "lora", "mari"]
METHOD_LABELS = {"vanilla": "Vanilla", "prompting": "Prompting", "caa": "CAA", "iti": "ITI", "nl_iti": "NL-ITI",
                 "reft": "ReFT", "lora": "LoRA", "mari": "MARI"}


def method_label(name: str) -> str:
    """How a table names a method's row: the labels above, else the method's own (``label``: a
    plugin's, docs/plugins.md)."""
    return METHOD_LABELS.get(name) or registry.method_class(name).label

# Benchmarks of Table 1: (column of table1_main.csv, lm-eval task, metric, the attribute whose bundle answers it).
# MMLU and ARC run under the TruthfulQA-trained intervention: general capability under the edit.
BENCHMARKS = [
    ("tqa_mc1", "truthfulqa_mc1_heldout", "acc,none", "truthfulqa"),
    ("tqa_mc2", "truthfulqa_mc2_heldout", "acc,none", "truthfulqa"),
    ("bbq_acc", "bbq_disambig_heldout", "acc,none", "bbq"),
    ("sorry_refusal", "sorry_bench_heldout", "refusal_rate,none", "sorry_bench"),
    ("mmlu", "mmlu", "acc,none", "truthfulqa"),
    ("arc_e", "arc_easy", "acc,none", "truthfulqa"),
    ("arc_c", "arc_challenge", "acc,none", "truthfulqa"),
]
# General capability under the other attributes' bundles (issue 36.3): the same tasks, documents and
# metrics as the mmlu / arc_e / arc_c columns, each under the BBQ- or SORRY-Bench-trained intervention
# (BENCHMARKS' general columns run under the TruthfulQA one). Ours only: the paper reports general
# capability under one intervention per model.
ATTRIBUTE_TAGS = {"truthfulqa": "tqa", "bbq": "bbq", "sorry_bench": "sorry"}
GENERAL_COLUMNS = ("mmlu", "arc_e", "arc_c")
GENERAL_UNDER_OTHERS = [(f"{column}@{ATTRIBUTE_TAGS[attribute]}", task, metric, attribute)
                        for attribute in ("bbq", "sorry_bench")
                        for column, task, metric, _ in BENCHMARKS if column in GENERAL_COLUMNS]
# Beside the judged refusal rate: the keyword rate of the same generations (no judge needed), ours only.
KEYWORD_REFUSAL = ("sorry_keyword", "sorry_bench_heldout", "keyword_refusal_rate,none", "sorry_bench")
# TruthfulQA generation (the paper's appendix; issue 42): greedy answers to "Q: ...\nA:" scored by lm-eval's
# truthfulqa_gen metrics, BLEU and ROUGE-1 against the correct and incorrect answers (_acc: closer to a correct
# one; _diff: by how much). Not in the default tables (every row generates): --columns tqa_gen_bleu_acc,...
TQA_GENERATION = [(f"tqa_gen_{metric}", "truthfulqa_gen_heldout", f"{metric},none", "truthfulqa")
                  for metric in ("bleu_acc", "bleu_diff", "rouge1_acc", "rouge1_diff")]
# Over-refusal beside SORRY-Bench (issue 55.6): XSTest's 250 safe prompts (refusal rate) and 200 unsafe ones
# (compliance rate), answered under the SORRY-Bench bundle and read by the keyword judge (harness_tasks/
# xstest_utils.py; its agreement with people: results/judge_agreement.md). In the budget profile's columns
# (``more_columns``); the other profiles' tables predate them: --columns xstest_safe_refusal,xstest_unsafe_compliance.
XSTEST = [("xstest_safe_refusal", "xstest_safe", "refusal_rate,none", "sorry_bench"),
          ("xstest_unsafe_compliance", "xstest_unsafe", "compliance_rate,none", "sorry_bench")]
# BBQ beside its disambiguated accuracy (issue 55.5): the accuracy on ambiguous contexts, whose right answer is
# always "unknown" (harness_tasks/bbq_ambig_heldout.yaml), under the BBQ bundle, clustered by context as bbq_acc.
# Beside it BBQ's ambiguous-context bias score s_AMB (Parrish et al., 2022), which is a mean over documents of +1
# (the stereotyped answer), -1 (the other person) or 0 ("unknown"): harness_tasks/bbq_bias.py. The disambiguated
# bias score is a ratio over the documents answered otherwise than "unknown", not a mean: lm-eval's figure stays
# in each cached evaluation's metrics (``disamb_bias_score,none``), without an interval.
BBQ_AMBIGUOUS = [("bbq_amb_acc", "bbq_ambig_heldout", "acc,none", "bbq"),
                 ("bbq_amb_bias", "bbq_ambig_heldout", "amb_bias,none", "bbq")]
# Invasiveness on general text (issue 55.4; ITI's measure): the steered model's KL divergence from the untouched
# model and its cross-entropy, in nats per token, on 200 MMLU and ARC-Challenge question texts cut in two
# (mari_eval/evaluation/divergence.py, data.load_general_text), under each attribute's bundle. They move where MMLU and
# ARC, at chance for a 135M model, cannot. In the budget profile's columns (``more_columns``); elsewhere --columns kl,ce,...
GENERAL_TEXT = [(f"{name}{'' if attribute == 'truthfulqa' else '@' + ATTRIBUTE_TAGS[attribute]}", "general_text",
                 f"{name},none", attribute) for attribute in ATTRIBUTE_TAGS for name in ("kl", "ce")]
# Those exam texts are in source for MARI's gate, whose "not applicable" calibration reads MMLU and ARC-Easy questions
# (issue 81.1): the tables label kl and ce "in-source" (``column_header``) and keep their keys. Out of source, the
# same measure on Self-Instruct's 252 user-oriented requests, each chat-templated as the model is used and continued
# by its authors' answer (repro/engine/divergence_run.py), under each attribute's bundle: kl_benign, ce_benign, ...
BENIGN_TEXT = [(f"{name}_benign{'' if attribute == 'truthfulqa' else '@' + ATTRIBUTE_TAGS[attribute]}", "benign_text",
                f"{name},none", attribute) for attribute in ATTRIBUTE_TAGS for name in ("kl", "ce")]
# Benign over-refusal beside XSTest's: the same 252 requests answered greedily as one chat user turn under the
# SORRY-Bench bundle, read by XSTest's keyword judge (harness_tasks/benign_instructions.yaml).
BENIGN_REFUSAL = [("benign_refusal", "benign_instructions", "refusal_rate,none", "sorry_bench")]
IN_SOURCE = ("kl", "ce")  # the columns (and their @tags) on text of the gate's calibration sources


def column_header(column: str) -> str:
    """How a table's headers name ``column`` (its JSON key): an in-source column says so ("in-source kl@bbq")."""
    return f"in-source {column}" if column.split("@")[0] in IN_SOURCE else column
# Percentages in the paper's table (the others are fractions, as the paper prints them).
PERCENT_COLUMNS = {"tqa_mc1", "tqa_mc2", "mmlu", "arc_e", "arc_c", "gsm8k", *(c[0] for c in GENERAL_UNDER_OTHERS)}
# Columns whose per-document scores are not 0/1 outcomes, though a row's may all be 0 or 1 (a closed MARI gate's
# KL of exactly 0, a bias of 0 or +1 on every context): their differences are always sign-flip tests, never
# McNemar's, whose interval is a 0/1 rate's (repro/analysis/intervals.py ``paired``, ``continuous``).
CONTINUOUS_COLUMNS = {"tqa_mc2", "kl", "ce", "kl_benign", "ce_benign", "bbq_amb_bias", "tqa_gen_bleu_diff",
                      "tqa_gen_rouge1_diff"}


def continuous_column(column: str) -> bool:
    return column.split("@")[0] in CONTINUOUS_COLUMNS


COLUMN_DIGITS = {"bbq_acc": 3, "sorry_refusal": 3, "sorry_keyword": 3, "auroc_loss": 2, "auroc_source": 2,
                 "val_loss": 3, "bbq_amb_acc": 3, "bbq_amb_bias": 3, "xstest_safe_refusal": 3, "xstest_unsafe_compliance": 3,
                 "benign_refusal": 3, **{c[0]: 3 for c in GENERAL_TEXT + BENIGN_TEXT}}


@dataclass
class Profile:
    """How much of everything a run computes, and (``cuda_placement``) where it runs by default.

    ``cuda_placement``: the placement flags a profile sets on a machine with CUDA
    (``torch.cuda.is_available()``) when the command line does not give them. The ``paper``
    profile runs its models in bfloat16 with ``device_map=auto`` there (``--dtype bfloat16
    --device-map auto``); an explicit ``--dtype`` wins over its dtype, and an explicit
    ``--device`` or ``--device-map`` over its device map. Without CUDA, and for the other
    profiles, the defaults are ``mari-eval train``'s: dtype auto (the checkpoint's own),
    cuda when available, else cpu.
    """

    name: str
    models: list[str]
    seeds: list[int]
    max_train: dict[str, int | None]  # per attribute: a seeded subset of D_train
    max_ctrl: int | None  # per control source (None: the whole control split)
    limits: dict[str, int | None]  # per lm-eval task (MMLU: per subject): first N documents
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # overrides for every method (e.g. epochs)
    max_pca: int | None = None  # D_pca prompts for MARI's subspace (None: the whole split)
    gen_tokens: dict[str, int] = field(default_factory=dict)  # per generation task: max_gen_toks (else the task's)
    tasks: dict[str, str] = field(default_factory=dict)  # a stand-in per task (smoke: one MMLU subject)
    cuda_placement: dict[str, str] = field(default_factory=dict)  # flags' defaults on a CUDA machine (see above)
    # Per column: seeds it is scored under beyond ``seeds`` (the quick profile's TruthfulQA columns
    # over 3 seeds, for their std, where the other columns keep one to stay within the hour).
    column_seeds: dict[str, list[int]] = field(default_factory=dict)
    # Per baseline: settings of its published recipe this profile changes for its budget (the quick
    # and standard profiles: ReFT's least number of optimizer steps), recorded in every bundle and cache key.
    published: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per baseline: settings of its adapted recipe this profile changes (the budget profile: selection on
    # D_ctrl, the labelled-data budget the published recipes and MARI's gate read), recorded likewise.
    adapted: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per method other than the four baselines: training settings this profile changes for its budget
    # (the quick profile: LoRA's epochs), recorded in every bundle and cache key (repro/engine/recipes.py).
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The main table's optional columns (TQA_GENERATION, BBQ_AMBIGUOUS, XSTEST, GENERAL_TEXT, BENIGN_TEXT,
    # BENIGN_REFUSAL) this profile scores without --columns.
    more_columns: tuple[str, ...] = ()
    # Tasks evaluated in an lm-eval run (a step of the plan) of their own, not with the other tasks of their bundle,
    # document limit and generation length (repro/engine/scoring.py ``task_groups``): columns added to a profile
    # whose steps are committed, so that those steps keep their tasks and are read back, not joined to new work.
    # (The same evaluations either way: each task is cached under its own key.)
    own_step: tuple[str, ...] = ()

    def results_dir(self) -> Path:
        """Where a script writes its tables unless ``--out`` says: results/ for the standard profile
        (the committed tables), results/profiles/NAME/ for the others."""
        return REPO / "results" if self.name == "standard" else REPO / "results" / "profiles" / self.name

    def task(self, name: str) -> str:
        return self.tasks.get(name, name)

    def seeded_columns(self, columns: list[tuple]) -> dict[int, list[tuple]]:
        """{seed: the columns scored under it}: every column under ``seeds``, and a column of
        ``column_seeds`` under its further seeds too (each seed trains its own bundles on its own
        splits and tests on its own held-out documents)."""
        out: dict[int, list[tuple]] = {seed: list(columns) for seed in self.seeds}
        for column in columns:
            for seed in self.column_seeds.get(column[0], []):
                if column not in out.setdefault(seed, []):
                    out[seed].append(column)
        return {seed: cols for seed, cols in sorted(out.items()) if cols}


# Prompts generated together (SORRY-Bench, GSM8K): lm-eval's batch_size, which MariLM uses for
# generation only (log-likelihood requests go by question; repro/engine/lm_eval_run.py). Left-padded
# batches give each prompt the answer it gets alone up to float rounding; 16 prompts cost about 3x
# less than one at a time on 2 CPU cores. A row's model_args may still set batch_size.
GENERATION_BATCH = 16


# The paper's models as Hub ids (the paper names sizes, not checkpoints; we take the chat/instruct ones,
# since SORRY-Bench prompts are chat turns and its appendix uses Llama-3-8B-Instruct).
PAPER_MODELS = {
    "Llama-2-7B": "meta-llama/Llama-2-7b-chat-hf",
    "Llama-2-13B": "meta-llama/Llama-2-13b-chat-hf",
    "Llama-3-8B": "meta-llama/Meta-Llama-3-8B-Instruct",
    "Qwen2-7B": "Qwen/Qwen2-7B-Instruct",
    "Qwen2.5-14B": "Qwen/Qwen2.5-14B-Instruct",
    "Qwen2.5-32B": "Qwen/Qwen2.5-32B-Instruct",
}
# The paper's model closest to each embedded one (same family where there is one, else the smallest).
CLOSEST_PAPER_MODEL = {"smollm2-135m-instruct": "Llama-2-7B", "gemma-3-270m": "Llama-2-7B", **{v: k for k, v in PAPER_MODELS.items()}}

# Published ReFT's least number of optimizer steps in the standard profile, for its hours on 2 CPU
# cores (the rule's MIN_STEPS = 100 elsewhere: baselines/reft_published.py). A step cost 11-19 s
# on BBQ (every layer edited, no shared preamble): about half an hour for 100 steps of one
# bundle, and the training loss had fallen from 4.90 to 0.67 within the first 10 (docs/baselines.md, ReFT).
# The quick profile takes those first 10.
STANDARD_REFT_STEPS = 20
QUICK_REFT_STEPS = 10
# D_ctrl per source in the standard profile (a seeded 40 of the attribute's hold-outs, 40 of the ARC-Easy
# and 40 of the MMLU controls): MARI's gate calibration runs every expert and the probe on each
# control, and the general controls carry their tasks' shots (25 for ARC, 5 for MMLU, whose preamble
# differs per subject). With the whole D_ctrl (about 300 controls) one MARI bundle took 15 minutes
# on 2 busy cores, 5.5 of them encoding the MMLU controls' 74 preambles, 6.5 calibrating.
STANDARD_CTRL = 40
QUICK_CTRL = 16
# LoRA's epochs in the quick profile: its validation loss on the standard profile's TruthfulQA
# bundle fell 4.97 (untouched), 4.70, 4.23, 3.59, 2.95, 2.54 over the first five (baselines/lora.py).
QUICK_LORA_EPOCHS = 5

PROFILES = {
    # Every script end to end in a few minutes (tests). ARC through arc_*_first25, as the quick and standard profiles
    # (one 25-shot preamble per task rather than one per question).
    "smoke": Profile("smoke", ["smollm2-135m-instruct"], [0], {"truthfulqa": 4, "bbq": 4, "sorry_bench": 4}, 2,
                     {"truthfulqa_mc1_heldout": 2, "truthfulqa_mc2_heldout": 2, "bbq_disambig_heldout": 2,
                      "sorry_bench_heldout": 2, "mmlu": 1, "arc_easy": 2, "arc_challenge": 2, "gsm8k": 1,
                      "truthfulqa_gen_heldout": 2, "xstest_safe": 2, "xstest_unsafe": 2, "general_text": 4,
                      "bbq_ambig_heldout": 2, "benign_text": 4, "benign_instructions": 2},
                     {"epochs": 1}, max_pca=24, gen_tokens={"sorry_bench_heldout": 8, "gsm8k": 8, "truthfulqa_gen_heldout": 8,
                                                            "xstest_safe": 8, "xstest_unsafe": 8, "benign_instructions": 8},
                     tasks={"mmlu": "mmlu_abstract_algebra", "arc_easy": "arc_easy_first25",
                            "arc_challenge": "arc_challenge_first25"}),
    # The README's first run (issue 36: the main table within 75 minutes on 2 CPU cores), every row,
    # column and seed of the standard profile's main table at smaller sizes: 16 training examples per
    # attribute, D_ctrl a seeded 16 per source (QUICK_CTRL), 64 D_pca prompts, LoRA 5 epochs
    # (QUICK_LORA_EPOCHS), published ReFT's least 10 steps (QUICK_REFT_STEPS); test documents: the first 50
    # held-out TruthfulQA questions of each of seeds 0, 1, 2 (MC1 and MC2), 112 BBQ (16 per local category,
    # spread over templates and whole contexts), 45 SORRY-Bench prompts (one per category) of 32 tokens,
    # one question per MMLU subject (57), the first 30 ARC-Easy and 30 ARC-Challenge, 10 GSM8K; MMLU and
    # ARC under each attribute's bundle. Measured 68 min from an empty runs/ (2026-11-28; results/README.md).
    # Wide intervals: a first look, not the committed tables.
    "quick": Profile("quick", ["smollm2-135m-instruct"], [0], {"truthfulqa": 16, "bbq": 16, "sorry_bench": 16}, QUICK_CTRL,
                     {"truthfulqa_mc1_heldout": 50, "truthfulqa_mc2_heldout": 50, "bbq_disambig_heldout": 112,
                      "sorry_bench_heldout": 45, "mmlu": 1, "arc_easy": 30, "arc_challenge": 30, "gsm8k": 10,
                      "truthfulqa_gen_heldout": 30},
                     max_pca=64, gen_tokens={"sorry_bench_heldout": 32, "gsm8k": 96},
                     tasks={"arc_easy": "arc_easy_first25", "arc_challenge": "arc_challenge_first25"},
                     column_seeds={"tqa_mc1": [0, 1, 2], "tqa_mc2": [0, 1, 2]},
                     published={"reft": {"min_steps": QUICK_REFT_STEPS}}, settings={"lora": {"epochs": QUICK_LORA_EPOCHS}}),
    # The committed tables (results/): the embedded model on 2 CPU cores, about 3.5 h for the main
    # table and 8 h for every table. Seeded subsets of 24 training examples per attribute; D_ctrl
    # a seeded 40 per source (STANDARD_CTRL: 40 attribute hold-outs, or SORRY-Bench's 45 down to 40, beside
    # 40 ARC-Easy (25-shot) and 40 MMLU (5-shot) controls). Test documents (issue 36): the first 200
    # held-out TruthfulQA questions of each seed's split (MC1 and MC2; the held-out tasks list them
    # in a seeded order), under seeds 0, 1 and 2 in the main table (``column_seeds``: 600 questions over three splits, as many as the 535 of one
    # split before, and a std over seeds); 504 BBQ disambiguated ones (72 in each of its 7 local
    # categories, spread over templates and whole contexts), 60 SORRY-Bench prompts (round-robin
    # over its 45 categories), 5 questions per MMLU subject (285), the first 100 ARC-Easy and 100
    # ARC-Challenge test questions, 20 GSM8K; MMLU and ARC under each attribute's bundle. ARC goes
    # through arc_*_first25: the same 25 shots (the first 25 train questions) before every question,
    # computed once, where lm-eval's arc tasks draw 25 anew per question (the large profile keeps
    # those; docs/evaluating.md, ARC's shots).
    "standard": Profile("standard", ["smollm2-135m-instruct"], [0], {"truthfulqa": 24, "bbq": 24, "sorry_bench": 24}, STANDARD_CTRL,
                     {"truthfulqa_mc1_heldout": 200, "truthfulqa_mc2_heldout": 200, "bbq_disambig_heldout": 504,
                      "sorry_bench_heldout": 60, "mmlu": 5, "arc_easy": 100, "arc_challenge": 100, "gsm8k": 20,
                      "truthfulqa_gen_heldout": 100},
                     max_pca=128, gen_tokens={"sorry_bench_heldout": 48, "gsm8k": 128},
                     tasks={"arc_easy": "arc_easy_first25", "arc_challenge": "arc_challenge_first25"},
                     column_seeds={"tqa_mc1": [0, 1, 2], "tqa_mc2": [0, 1, 2]},
                     published={"reft": {"min_steps": STANDARD_REFT_STEPS}}),
    # All 535 held-out TruthfulQA questions, 504 BBQ, 10 per MMLU subject (570), 200 ARC-Easy and 200
    # ARC-Challenge through lm-eval's own arc tasks (25 shots drawn per question), 90 SORRY-Bench
    # prompts (2 per category), 50 GSM8K, and larger training sets (20 validation examples or more):
    # TruthfulQA's whole D_train (100), a seeded 100 of BBQ's 882, SORRY-Bench's whole D_train (45).
    # Hours on 2 CPU cores; minutes on a GPU.
    "large": Profile("large", ["smollm2-135m-instruct"], [0], {"truthfulqa": 100, "bbq": 100, "sorry_bench": 45}, None,
                     {"truthfulqa_mc1_heldout": None, "truthfulqa_mc2_heldout": None, "bbq_disambig_heldout": 504,
                      "sorry_bench_heldout": 90, "mmlu": 10, "arc_easy": 200, "arc_challenge": 200, "gsm8k": 50},
                     max_pca=128, gen_tokens={"sorry_bench_heldout": 48, "gsm8k": 128}),
    # Issue 55's protocol, to replace the standard profile's tables once they are regenerated under it: the
    # paper's data budget (appendix "Training data budget": TruthfulQA D_pca 100 and D_train 100 from a
    # pool of 200 questions, the whole of both; SORRY-Bench's whole D_train, 45 of its 20% pool; BBQ a seeded
    # 200 of its 882, the most its MARI and ReFT trainings allow on 2 CPU cores), every column under seeds 0, 1
    # and 2 (the unit of training variance: repro/seed_level.py), the standard profile's test documents; the
    # baselines selected on held-out data as their authors select: ITI's and NL-ITI's heads by cross-validated
    # probe accuracy over all of D_train (honest_llama), published ReFT's epoch by its validation loss over the
    # recipe's own length (at least MIN_STEPS = 100 optimizer steps, baselines/reft_published.py: 15 epochs on
    # BBQ's 200, 25 on TruthfulQA's 100, 50 on SORRY-Bench's 45; with the standard profile's 20 steps the kept
    # epoch was the last in all three seed-0 bundles, the validation loss still falling, so the length was not
    # chosen on validation; repro/training_selection.py shows it, and --set min_steps=20 runs the shorter one); one
    # labelled-data budget: every baseline, in both recipes, fits on all of D_train and selects on D_ctrl's
    # attribute examples, the 40 labelled hold-outs MARI's gate is calibrated on (``validation=ctrl``,
    # baselines/common.py).
    "budget": Profile("budget", ["smollm2-135m-instruct"], [0, 1, 2], {"truthfulqa": None, "bbq": 200, "sorry_bench": None},
                      STANDARD_CTRL,
                      {"truthfulqa_mc1_heldout": 200, "truthfulqa_mc2_heldout": 200, "bbq_disambig_heldout": 504,
                       "sorry_bench_heldout": 60, "mmlu": 5, "arc_easy": 100, "arc_challenge": 100, "gsm8k": 20,
                       "truthfulqa_gen_heldout": 100, "xstest_safe": None, "xstest_unsafe": None, "bbq_ambig_heldout": 504,
                       "benign_text": None, "benign_instructions": None},
                      max_pca=None, gen_tokens={"sorry_bench_heldout": 48, "gsm8k": 128, "xstest_safe": 48, "xstest_unsafe": 48,
                                                "benign_instructions": 48},
                      tasks={"arc_easy": "arc_easy_first25", "arc_challenge": "arc_challenge_first25"},
                      published={"reft": {"epoch_selection": "best", "validation": "ctrl"},
                                 "iti": {"head_selection": "cv", "validation": "ctrl"},
                                 "nl_iti": {"head_selection": "cv", "validation": "ctrl"}, "caa": {"validation": "ctrl"}},
                      adapted={m: {"validation": "ctrl"} for m in ("caa", "iti", "nl_iti", "reft")},
                      settings={"lora": {"validation": "ctrl"}},
                      more_columns=tuple(c[0] for c in BBQ_AMBIGUOUS + XSTEST + GENERAL_TEXT + BENIGN_TEXT + BENIGN_REFUSAL),
                      # Added after the budget steps were committed (issue 81.1): their own steps.
                      own_step=("benign_text", "benign_instructions")),
    # The paper's setting on GPU machines: its models, full test sets, 3 seeds; in bf16 spread over the GPUs.
    "paper": Profile("paper", list(PAPER_MODELS.values()), [0, 1, 2], {"truthfulqa": None, "bbq": None, "sorry_bench": None},
                     None, {}, cuda_placement={"dtype": "bfloat16", "device_map": "auto"}),
}
def describe(placement) -> str:
    """A placement in a log line: dtype bfloat16, device_map auto."""
    return ", ".join(f"{k} {v}" for k, v in asdict(placement).items() if v is not None)
