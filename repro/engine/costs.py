"""What a repro step costs before it runs: floating-point operations, GPU-seconds and GPUs (issue 40).

The estimate counts the frozen model's matrix products, 2 N FLOPs per token through a model of N
parameters (the forward pass; Kaplan et al., 2020, "Scaling Laws for Neural Language Models",
Sec. 2.1), and 6 N per token where training back-propagates through the whole model:

* evaluating a log-likelihood task under a group of rows that share one pass (repro/engine/scoring.py),
  per document: the prompt, P tokens, once for the rows that read the frozen prefix, and once more
  for each row whose method edits the prompt itself (``prompt_sites``: ReFT, LoRA, control
  vectors) or rewrites it (Prompting); and every row's option tokens, R requests of O tokens,
  times its variants (MARI: K experts, its probe and the base row, K + 2, an upper bound since a
  closed gate skips the experts; once per bundle, a later row of it adding only a variant its
  options ask for, ``row_variants``):
      2 N [P (1 + rows editing the prompt) + R O sum over rows of variants]
* the KL and cross-entropy measures on general text and benign requests (mari_eval/evaluation/divergence.py), per
  document: 2 N (P + R O) for the untouched model's reading, once for a group's rows (kept by the
  shared pass; Prompting, outside it, reads its own), and 2 N (P + R O) per row that edits (the
  untouched row reads nothing more), MARI adding its K experts over the routing window T_ent (the
  gate's choice of variant), an upper bound where a closed gate leaves a document unedited. On 2
  CPU cores the budget profile's seed-2 step (22 rows of 200 documents) took 2,087 s (2026-11-30),
  when every row still read the untouched model again: short passes one document at a time run
  slower per FLOP on a CPU than the tables' mix that ``CPU_SLOWDOWN`` averages;
* generating (SORRY-Bench, GSM8K), per document and row: 2 N (P + G), G the generated tokens
  (the profile's, else the task's 256), MARI adding its K experts over the routing window T_ent;
* training, per attribute with n examples of D_train (P, R, O of the attribute's task), D_ctrl
  and D_pca (``repro/engine/token_counts.json``):
  MARI: 2 N (P + R O) (n + ctrl + pca) to encode every set once, plus epochs x n x R O x K x 6 N / 2
  (its experts' rows back-propagate from l*, about half the layers) and the gate's calibration,
  2 N R O (K + 2) ctrl; ReFT, LoRA: epochs x n x (P + R O) x 6 N (the edit reaches the prompt, so
  every epoch re-reads it); CAA, ITI, NL-ITI: their activations, 2 N (P + R O) n x 3 (CAA's
  A/B prompts and the grid's layers); Prompting: nothing.

FLOPs become seconds at ``EFFECTIVE_FLOPS``, the rate ``--model mari`` reached on one GPU before
issue 59: on an H200 at Llama-2-7B's shape (results/gpu_bench.json, run 1) it scored 100
truthfulqa_mc2 questions in 2.8 s inside the model, i.e. 100 x (186 + 7.4 x 10.9) tokens x 2 x
6.88e9 in 2.8 s, about 1.3e14 FLOP/s. GPU-seconds are those seconds times the ratio measured /
estimated of the step's kind on a GPU (``CALIBRATION``, issue 59.4: ``python -m
repro.benchmark.cost_check`` derives it from repro/gpu_bench.py's runs and checks it across shapes):
one ratio for log-likelihood evaluation as the repro's shared pass runs it (one question at a
time), one per method for training. Generating is not
priced by FLOPs: a greedy step reads every weight for a few tokens, so a batch of
``GENERATION_BATCH`` prompts costs its prompts' FLOPs plus one measured step time per token
generated (``decode_step_s``). The time on 2 CPU cores stays FLOPs / ``EFFECTIVE_FLOPS`` times
``CPU_SLOWDOWN`` (``cpu_seconds``), the basis it was measured on. A step needs ``gpus_needed`` GPUs
of ``GPU_GIB``: the bf16 weights with 20% headroom when evaluating, and the training state and
largest step of results/memory.json for MARI's training (the largest; the baselines' are charged
the same).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from mari_eval.evaluation import divergence
from repro.engine import token_counts
from repro.engine.profiles import GENERATION_BATCH, PAPER_MODELS, REPO, Profile

EFFECTIVE_FLOPS = 1.3e14  # FLOP/s of --model mari on one GPU before issue 59 (module docstring)


@dataclass(frozen=True)
class Calibration:
    """Measured seconds over ``seconds(flops)`` per kind of step on one GPU (repro/benchmark/cost_check.py)."""

    device: str
    measured: str  # the dates of the runs
    runs: tuple[str, ...]  # results/gpu_bench_runs/ files the training ratios are the medians of
    evaluate: float  # log-likelihood evaluation one question at a time (the repro's shared pass), in the model
    train: dict[str, float]  # per method, the bundle's training (wall)
    decode_step_s: float  # one greedy step of a generation batch (a 128-token answer's total / 128)


# From repro/gpu_bench.py's runs (results/cost_check.md derives each value and checks the training ratios
# on the other shape). Training: the runs at Llama-3-8B's and Qwen2.5-7B's shapes (published
# vocabularies) after issue 59, on TruthfulQA's 100 D_train questions with gpu_bench's small settings,
# so a method's fixed costs (ITI's probes, MARI's PCA and gate calibration) weigh more than in a
# profile's training: the ratios scale them with the FLOPs. LoRA was not run: it takes ReFT's ratio
# (both back-propagate through the model over every prompt). Evaluation: the steps that scored one
# question at a time (Llama-2-7B's shape, 2026-11-27), as the repro's shared pass scores; no GPU has
# timed the shared pass itself, whose rows of several methods share a question's passes. A greedy step:
# the base model's 128-token answers, one prompt at a time (a batch of 16 is assumed to step as fast).
CALIBRATION = Calibration(
    device="NVIDIA H200", measured="2026-11-27 and 2026-11-30", runs=("run5.json", "run6.json", "run7.json"),
    evaluate=3.19, train={"caa": 1.42, "iti": 5.01, "nl_iti": 4.6, "reft": 1.24, "mari": 9.26, "lora": 1.24},
    decode_step_s=0.0308)
# How many times longer the same steps take on 2 CPU cores (this suite's test machine), measured on two
# main tables run from an empty runs/ there (README, 2026-11-28): the quick profile's, priced at 4.83
# GPU-seconds, took 4,088 s (x 846); the standard profile's, 16.24 GPU-seconds, 12,540 s (x 772). Their
# mean; the estimate of a run on such a machine is its GPU-seconds times this, one step after another.
CPU_SLOWDOWN = 809.0
GPU_GIB = 80.0  # one H100 / A100-80GB
HEADROOM = 1.2  # weights x this when evaluating (activations, caches, CUDA's own)
DEFAULT_GENERATION = 256  # the generation tasks' max_gen_toks when the profile does not shorten them
# Parameters of the embedded models (their config.json, counted on the meta device).
EMBEDDED_PARAMETERS = {"smollm2-135m-instruct": 134_515_008, "gemma-3-270m": 268_098_176}
# Rows of a group whose method edits or rewrites the prompt: the prompt is read again for each.
PROMPT_READERS = {"reft", "lora", "prompting", "control_vector"}
MMLU_SUBJECTS = 57
MARI_K = 4
MARI_WINDOW = 8  # T_ent


@lru_cache(maxsize=1)
def _memory() -> dict:
    return json.loads((REPO / "results" / "memory.json").read_text())["models"]


def paper_name(model: str) -> str | None:
    return next((name for name, hub in PAPER_MODELS.items() if hub == model), None)


def parameters(model: str) -> int:
    """N of a model the profiles name: results/memory.json for the paper's, the table above for the
    embedded ones; any other is refused with the fix."""
    name = paper_name(model)
    if name is not None:
        return int(_memory()[name]["parameters"])
    if model in EMBEDDED_PARAMETERS:
        return EMBEDDED_PARAMETERS[model]
    raise ValueError(f"no parameter count for {model!r}: the plan knows the paper's models and the embedded ones; add "
                     "its count to repro/engine/costs.py's EMBEDDED_PARAMETERS (sum of p.numel() of the model's parameters)")


def gpus_needed(model: str, training: bool) -> int:
    """GPUs of ``GPU_GIB`` a step on ``model`` needs: one unless its memory does not fit one."""
    name = paper_name(model)
    if name is None:
        return 1
    row = _memory()[name]
    need = row["weights_bytes"] * HEADROOM
    if training:
        need = row["weights_bytes"] + max(a["now_bytes"] + a.get("step_bytes", 0) for a in row["attributes"].values())
    return max(1, math.ceil(need / 2**30 / GPU_GIB))


@dataclass(frozen=True)
class TaskSize:
    """A task's documents in a step and their mean token counts (``repro/engine/token_counts.json``)."""

    documents: int
    prompt: float
    requests: float
    option: float
    generation: bool
    alone: bool = False  # every row reads the whole document by itself, and the untouched model again (divergence.TASKS)

    @classmethod
    def of(cls, task: str, limit: int | None) -> "TaskSize":
        """``task`` with ``limit`` documents (MMLU's group: per subject; one MMLU subject: the
        group's mean tokens, its mean share of the documents)."""
        counts = token_counts.load()["tasks"]
        stats = counts.get(task) or counts.get("mmlu" if task.startswith("mmlu_") else task)
        if stats is None:
            raise ValueError(f"repro/engine/token_counts.json has no counts for task {task!r}: add it to repro/engine/token_counts.py's "
                             "TASKS and run python -m repro.engine.token_counts")
        total = stats["documents"] // MMLU_SUBJECTS if task.startswith("mmlu_") else stats["documents"]
        if limit is not None:
            total = min(total, limit * (MMLU_SUBJECTS if task == "mmlu" else 1))
        return cls(total, stats["prompt_tokens"], stats["requests_per_document"], stats["option_tokens"],
                   stats["generation"], alone=task in divergence.TASKS)


def variants(method: str | None) -> int:
    """Rows a method runs per option: MARI its experts, probe and base row; the others one."""
    return MARI_K + 2 if method == "mari" else 1


# A later MARI row of a bundle computes a variant of its own only for these options (another
# probe strength, the single adapter); gate, rho, labels and a forced expert reuse the bundle's.
OWN_VARIANT_OPTIONS = ("probe_alpha=", "experts=single")


def row_variants(rows: list[tuple[str | None, object, str]]) -> list[int]:
    """Variants per option each row of one shared pass computes, rows given as (method, bundle,
    model_args): ``variants`` for a bundle's first MARI row; for a later row of the same bundle only
    what its options add (``OWN_VARIANT_OPTIONS``), since the shared pass hands it the variants the
    bundle's earlier rows computed (mari_eval/evaluation/shared_pass.py: runs of one
    ``edit_fingerprint`` lend their variants). Still an upper bound: a closed gate skips the experts."""
    seen: set = set()
    counts = []
    for method, bundle, args in rows:
        if method == "mari" and bundle in seen:
            counts.append(sum(option in (args or "") for option in OWN_VARIANT_OPTIONS))
        else:
            counts.append(variants(method))
        if method == "mari":
            seen.add(bundle)
    return counts


def _routing_tokens(method: str | None) -> int:
    """Tokens MARI's K experts add to a row by decoding their T_ent-step routing window; none elsewhere."""
    return MARI_K * MARI_WINDOW if method == "mari" else 0


def _decoded(method: str | None, gen_tokens: int | None) -> int:
    """Tokens a row decodes per generated answer: ``gen_tokens`` (else the tasks' default) and MARI's
    routing window."""
    return (gen_tokens or DEFAULT_GENERATION) + _routing_tokens(method)


def evaluation_flops(model: str, size: TaskSize, methods: list[str | None], gen_tokens: int | None,
                     n_parameters: int | None = None, per_row: list[int] | None = None) -> float:
    """One task under a group of rows (their methods; None for the untouched model) in one shared pass;
    ``n_parameters``: N of a model the profiles do not name (a benchmark's random-weight model);
    ``per_row``: the variants each row computes (``row_variants``; default ``variants`` of its method)."""
    n = n_parameters or parameters(model)
    if size.generation:
        return 2 * n * size.documents * sum(size.prompt + _decoded(m, gen_tokens) for m in methods)
    if size.alone:
        text = size.prompt + size.requests * size.option
        untouched = 1 + sum(m == "prompting" for m in methods)  # once for the group; Prompting reads its own
        return 2 * n * size.documents * (untouched * text + sum(text + _routing_tokens(m) for m in methods if m is not None))
    readers = 1 + sum(m in PROMPT_READERS for m in methods)
    options = size.requests * size.option * sum(per_row if per_row is not None else map(variants, methods))
    return 2 * n * size.documents * (size.prompt * readers + options)


def train_examples(attribute: str, profile: Profile) -> int:
    """How many examples of ``attribute``'s D_train ``profile`` trains on (its seeded subset, or all)."""
    split = token_counts.load()["splits"][attribute]
    return min(split["train"], profile.max_train.get(attribute) or split["train"])


def training_flops(model: str, method: str, attribute: str, profile: Profile, epochs: int | None,
                   n_parameters: int | None = None) -> float:
    """Training ``method`` on ``attribute`` (module docstring); ``epochs``: the method's (None: closed form);
    ``n_parameters`` as for ``evaluation_flops``."""
    counts = token_counts.load()
    split = counts["splits"][attribute]
    size = TaskSize.of(split["task"], None)
    n_train = train_examples(attribute, profile)
    n_ctrl = min(split["ctrl"], 3 * profile.max_ctrl) if profile.max_ctrl else split["ctrl"]
    n_pca = min(split["pca"], profile.max_pca or split["pca"])
    example = size.prompt + size.requests * size.option if not size.generation else size.prompt + 32
    rows = size.requests * size.option if not size.generation else 32
    n = n_parameters or parameters(model)
    if method == "prompting":
        return 0.0
    if method == "mari":
        encode = 2 * n * example * (n_train + n_ctrl + n_pca)
        experts = (epochs or 1) * n_train * rows * MARI_K * 6 * n / 2
        return encode + experts + 2 * n * rows * (MARI_K + 2) * n_ctrl
    if method in ("reft", "lora"):
        return (epochs or 1) * n_train * example * 6 * n
    return 2 * n * example * n_train * 3  # CAA, ITI, NL-ITI and any closed-form method


def seconds(flops: float) -> float:
    """``flops`` at ``EFFECTIVE_FLOPS``: the uncalibrated estimate (cost_check's 'FLOPs' column)."""
    return flops / EFFECTIVE_FLOPS


def cpu_seconds(flops: float) -> float:
    """On 2 CPU cores, one step after another (``CPU_SLOWDOWN``, measured against ``seconds``)."""
    return seconds(flops) * CPU_SLOWDOWN


def training_seconds(model: str, method: str, attribute: str, profile: Profile, epochs: int | None,
                     n_parameters: int | None = None, calibration: Calibration = CALIBRATION) -> float:
    """GPU-seconds of ``training_flops``'s step: its FLOPs' seconds times the method's measured ratio
    (1 for a method no GPU run trained)."""
    flops = training_flops(model, method, attribute, profile, epochs, n_parameters)
    return seconds(flops) * calibration.train.get(method, 1.0)


def evaluation_seconds(model: str, size: TaskSize, methods: list[str | None], gen_tokens: int | None,
                       n_parameters: int | None = None, calibration: Calibration = CALIBRATION,
                       batch: int = GENERATION_BATCH, per_row: list[int] | None = None) -> float:
    """GPU-seconds of ``evaluation_flops``'s step: a log-likelihood task's FLOPs at the measured
    evaluation ratio; a generation task's prompts likewise, plus per row and batch of ``batch``
    prompts one ``decode_step_s`` per generated token (MARI's K experts add their T_ent-step
    routing window)."""
    if not size.generation:
        return seconds(evaluation_flops(model, size, methods, gen_tokens, n_parameters, per_row)) * calibration.evaluate
    n = n_parameters or parameters(model)
    prompts = 2 * n * size.documents * size.prompt * len(methods)
    steps = sum(_decoded(m, gen_tokens) for m in methods)
    return seconds(prompts) * calibration.evaluate + math.ceil(size.documents / batch) * steps * calibration.decode_step_s
