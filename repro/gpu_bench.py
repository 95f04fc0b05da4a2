"""GPU benchmark at the paper's shapes (issue 41): lm-eval's ``hf`` against ``--model mari``, one run.

    python repro/gpu_bench.py --shape llama2_7b --tokenizer .gpu_data/tokenizer --raw OUT.json [--deadline-s 400]
    python repro/gpu_bench.py --render OUT.json [--out results]

One process builds one model of a paper model's shape with random bf16 weights on the device
(``repro.benchmark.random_model``; the real checkpoints cannot reach a lent GPU, and speed and memory do
not depend on the weights), with the embedded SmolLM2 tokenizer, then runs these steps in
order, cheapest and most needed first:

1. every method's bundle trained on TruthfulQA's D_train (100 questions) with tiny settings
   (``Settings.hyperparameters``: the time is not the point; MARI with K = 4), through that model;
   MARI's peak GPU memory of training against ``mari_eval.training.memory``'s estimate;
2. ``truthfulqa_mc2`` (100 questions) through ``lm_eval.simple_evaluate`` for lm-eval's ``hf``
   (``batch_size=auto``) and ``MariLM`` without a bundle, with MARI (gate on; gate forced open on
   every question, ``mari_open``; ``gate=false``) and with each baseline's bundle; MariLM at
   ``batch_size=auto`` and, for vanilla and MARI, at 1; then the entries together through one shared
   pass, as the repro evaluates its rows (``shared_entries``: the time costs.py's evaluation ratio reads);
3. generation: 10 SORRY-Bench prompts of 128 tokens one at a time, base model and MARI with its
   gate forced closed and open (first-token latency, tokens/s, total);
4. 5-shot MMLU on a few subjects and BBQ (100 questions), every entry at ``batch_size=auto``;
5. the remaining entries at batch size 1 on truthfulqa_mc2.

lm-eval's task index and each task group's data are built once before the evaluations that use
them (``warm/`` steps), so that no entry pays them alone; each evaluation still pays lm-eval's
own per-call work (building the requests, BBQ's ``process_docs`` over its 17,628 documents),
which ``model_s`` (the time inside the model's request methods) leaves out.

Every step's figures are appended to the raw JSON (``--raw``) as soon as it ends, so a run
stopped at a time limit keeps what it measured. A step starts only while the deadline
(``--deadline-s`` after the start) leaves room for it (as long as the longest step of its kind
so far); the others are recorded as skipped. A failing step is recorded with its error and the
run goes on (a step needing a bundle whose training failed is skipped). ``--render`` writes
results/gpu_bench.{json,md} from a raw file (``repro.benchmark.gpu_bench_report``). Benchmarks, not tests:
nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout that is not pip-installed (the GPU machine)
    sys.path.insert(0, str(REPO))

import importlib.metadata as md

from mari_eval.storage.files import write_results_json  # noqa: E402
from mari_eval.storage.numbers import flag_type  # noqa: E402
from repro.benchmark import gpu_bench_steps as steps, random_model  # noqa: E402

log = logging.getLogger("gpu_bench")


@dataclass
class Settings:
    """What one run measures; the defaults are issue 41's sizes."""

    shape: str = "llama2_7b"
    tokenizer: str = str(REPO / ".gpu_data" / "tokenizer")
    device: str = "cuda"
    dtype: str = "bfloat16"
    vocab: str = "tokenizer"  # the random model's vocabulary: the tokenizer's, or the shape's "published" one
    seed: int = 0
    max_batch_size: int = 64  # lm-eval's default cap on hf's batch_size=auto
    mari_batches: str = "tokens"  # MariLM's auto batches: sized by tokens, uncapped (issue 59.1; earlier runs: capped as hf)
    # Training (TruthfulQA D_train; None = the whole split): tiny settings, the time is not the point.
    max_train: int | None = None
    max_ctrl: int | None = 8  # D_ctrl per source (MARI's gate calibration)
    max_pca: int | None = 32  # D_pca prompts (MARI's subspace; at least its PCA rank, 16)
    hyperparameters: dict[str, dict] = field(default_factory=lambda: {
        "mari": {"K": 4, "epochs": 1},
        "caa": {"recipe": "published"},  # the main table's recipe of every baseline (repro/engine/recipes.py)
        "iti": {"recipe": "published"},
        "nl_iti": {"recipe": "published"},
        "reft": {"recipe": "published", "epochs": 1, "min_steps": 1},
    })
    methods: tuple[str, ...] = steps.METHODS
    # Evaluation.
    tqa_limit: int = 100
    mmlu_subjects: tuple[str, ...] = ("abstract_algebra", "anatomy", "astronomy")
    mmlu_limit: int = 20  # per subject
    bbq_limit: int = 100
    auto_entries: tuple[str, ...] = ("hf", "vanilla", "mari", "mari_open", "mari_gate_off", "caa", "iti", "nl_iti",
                                     "reft")
    batch_one_first: tuple[str, ...] = ("vanilla", "mari")  # at batch size 1 on truthfulqa_mc2, early
    batch_one_late: tuple[str, ...] = ("mari_gate_off", "caa", "iti", "nl_iti", "reft")  # at batch size 1, last
    # Through one shared pass, as the repro evaluates its rows (issue 59.4's evaluation ratio), on these groups.
    shared_entries: tuple[str, ...] = ("vanilla", "mari", "caa", "iti", "nl_iti", "reft")
    shared_tasks: tuple[str, ...] = ("truthfulqa_mc2",)
    tasks: tuple[str, ...] = ("truthfulqa_mc2", "mmlu", "bbq")  # the task groups evaluated (groups())
    # Generation.
    gen_prompts: int = 10
    gen_tokens: int = 128
    gen_modes: tuple[str, ...] = tuple(steps.GATE_MODES)

    def groups(self) -> dict[str, steps.TaskGroup]:
        return {"truthfulqa_mc2": steps.TaskGroup("truthfulqa_mc2", ("truthfulqa_mc2",), self.tqa_limit),
                "mmlu": steps.TaskGroup("mmlu", tuple(f"mmlu_{s}" for s in self.mmlu_subjects), self.mmlu_limit),
                "bbq": steps.TaskGroup("bbq", ("bbq",), self.bbq_limit)}


@dataclass(frozen=True)
class Step:
    """One measurement: its name, its kind (for the deadline's estimate) and what it runs."""

    name: str
    kind: str
    run: Callable[[], dict]
    needs: tuple[str, ...] = ()  # methods whose bundles it needs


def plan(settings: Settings, bench: steps.Bench) -> list[Step]:
    """Every step of a run, in the order they run."""
    out = [Step(f"train/{m}", "train", lambda m=m: steps.train(
        bench, m, settings.hyperparameters.get(m, {}), settings.seed, settings.max_train, settings.max_ctrl,
        settings.max_pca)) for m in settings.methods]
    groups = settings.groups()

    def evaluation(entry: str, group: str, batch) -> Step:
        e = steps.ENTRIES[entry]
        return Step(f"eval/{group}/{entry}/bs{batch}", f"eval:{group}",
                    lambda: steps.evaluate(bench, e, groups[group], batch), (e.method,) if e.method else ())

    out.append(Step("warm/task_index", "warm", lambda: steps.task_index(bench)))

    def warm(group: str) -> Step:
        return Step(f"warm/{group}", "warm", lambda: steps.warm(bench, groups[group]))

    tqa = "truthfulqa_mc2" in settings.tasks
    if tqa:
        out += [warm("truthfulqa_mc2")] + [evaluation(e, "truthfulqa_mc2", "auto") for e in settings.auto_entries]
        out += [evaluation(e, "truthfulqa_mc2", 1) for e in settings.batch_one_first]
    for group in settings.shared_tasks:
        if settings.shared_entries:
            entries = [steps.ENTRIES[e] for e in settings.shared_entries]
            out.append(Step(f"eval-shared/{group}/{'+'.join(settings.shared_entries)}", f"eval-shared:{group}",
                            lambda group=group, entries=entries: steps.shared(bench, entries, groups[group]),
                            tuple(e.method for e in entries if e.method)))
    out += [Step(f"gen/{mode}", "gen", lambda mode=mode: steps.generate(bench, mode, settings.gen_prompts,
                                                                          settings.gen_tokens),
                 () if mode == "base" else ("mari",)) for mode in settings.gen_modes]
    for group in ("mmlu", "bbq"):
        if group in settings.tasks:
            out += [warm(group)] + [evaluation(e, group, "auto") for e in settings.auto_entries]
    if tqa:
        out += [evaluation(e, "truthfulqa_mc2", 1) for e in settings.batch_one_late]
    return out


def expected_seconds(kind: str, longest: dict[str, float]) -> float:
    """How long a step of ``kind`` is expected to take: the longest of its kind so far, else (the first
    evaluation of a task group) the longest evaluation so far, else nothing known."""
    if kind in longest:
        return longest[kind]
    if kind.startswith("eval:"):
        return max((v for k, v in longest.items() if k.startswith("eval:")), default=0.0)
    return 0.0


def environment(settings: Settings, model, shape, tokenizer) -> dict:
    """Device, versions, model shape and dtype: what every figure was measured on."""
    import torch  # deferred: torch is heavy; only this path needs it

    versions = {}
    for package in ("torch", "transformers", "lm_eval", "datasets", "accelerate", "huggingface_hub", "tokenizers",
                    "pyarrow", "numpy"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    cuda = torch.cuda.is_available() and settings.device.startswith("cuda")
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
        "versions": versions, "python": platform.python_version(), "machine": platform.platform(),
        "shape": {"key": shape.key, "name": shape.name, "source": shape.source, "config": shape.config,
                  "published_parameters": shape.published_parameters},
        "model": {"name": model.name_or_path, "dtype": str(model.dtype).removeprefix("torch."),
                  "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": model.config.vocab_size,
                  "weights_bytes": steps.weights_bytes(model), "num_layers": model.config.num_hidden_layers,
                  "tokenizer": f"{settings.tokenizer} ({len(tokenizer)} tokens)"},
    }


class Recorder:
    """The raw JSON of a run, written again after every step (a killed run keeps what it measured)."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record
        self.write()

    def write(self) -> None:
        write_results_json(self.path, self.record)

    def add(self, entry: dict) -> None:
        self.record["steps"].append(entry)
        self.write()


def run(settings: Settings, raw: Path, deadline_s: float | None, command: str) -> dict:
    import torch  # deferred: torch is heavy; only this path needs it

    started = time.perf_counter()
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu for the tiny shape)")
    shape = random_model.load_shape(settings.shape)
    tokenizer = random_model.load_tokenizer(settings.tokenizer)
    build_started = time.perf_counter()
    model = random_model.build(shape, tokenizer, settings.device, getattr(torch, settings.dtype), settings.seed,
                               settings.vocab)
    if settings.device.startswith("cuda"):
        torch.cuda.synchronize()
    build_s = time.perf_counter() - build_started
    work = Path(tempfile.mkdtemp(prefix="gpu_bench_bundles_"))  # not beside --raw: a device's $OUT returns few files
    bench = steps.Bench(model, tokenizer, model.name_or_path, settings.device, settings.dtype, settings.max_batch_size,
                        work)
    recorder = Recorder(raw, {"command": command, "settings": asdict(settings), "deadline_s": deadline_s,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "bundles_dir": str(work), **environment(settings, model, shape, tokenizer),
                              "build_s": build_s, "steps": [], "complete": False})
    log.info("model %s built in %.1f s on %s", model.name_or_path, build_s, recorder.record["device"])
    longest: dict[str, float] = {}  # per kind of step, the longest so far: the deadline's estimate
    for step in plan(settings, bench):
        elapsed = time.perf_counter() - started
        missing = [m for m in step.needs if m not in bench.bundles]
        entry = {"step": step.name, "kind": step.kind, "started_s": elapsed}
        if missing:
            recorder.add({**entry, "status": "skipped", "reason": f"no {', '.join(missing)} bundle"})
            continue
        if deadline_s is not None and elapsed + expected_seconds(step.kind, longest) > deadline_s:
            recorder.add({**entry, "status": "skipped", "reason": f"deadline {deadline_s:.0f} s"})
            continue
        log.info("[%5.0f s] %s ...", elapsed, step.name)
        t0 = time.perf_counter()
        try:
            figures = step.run()
            status = {"status": "done", **figures}
        except Exception as e:  # a failing step is recorded; the others still run
            log.exception("%s failed", step.name)
            status = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        seconds = time.perf_counter() - t0
        longest[step.kind] = max(longest.get(step.kind, 0.0), seconds)
        recorder.add({**entry, "step_s": seconds, **status})
        log.info("[%5.0f s] %s %s in %.1f s", time.perf_counter() - started, step.name, status["status"], seconds)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    recorder.record.update(complete=True, total_s=time.perf_counter() - started)
    recorder.write()
    return recorder.record



def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--render", metavar="RAW", nargs="+",
                   help="write results/gpu_bench.{json,md} from these raw files (one or several runs) and stop")
    p.add_argument("--out", default=str(REPO / "results"), help="with --render: the folder written")
    p.add_argument("--raw", default=str(REPO / "runs" / "gpu_bench_raw.json"), help="the raw JSON this run writes")
    p.add_argument("--deadline-s", type=flag_type(lo=0), help="skip the steps that would start or end after this many seconds")
    p.add_argument("--settings", help="JSON object of Settings fields to change (e.g. the CPU test's tiny limits)")
    for name in ("shape", "tokenizer", "device", "dtype"):
        p.add_argument(f"--{name}", default=getattr(defaults, name))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.render:
        from repro.benchmark import gpu_bench_report  # deferred: rendering reads matplotlib; only --render needs it

        for path in gpu_bench_report.render([Path(r) for r in args.render], Path(args.out)):
            print(path)
        return 0
    changes = json.loads(args.settings) if args.settings else {}
    unknown = sorted(set(changes) - set(Settings.__dataclass_fields__))
    if unknown:
        p.error(f"--settings: unknown fields {unknown}")
    bad = sorted({*changes.get("auto_entries", ()), *changes.get("batch_one_first", ()),
                  *changes.get("batch_one_late", ()), *changes.get("shared_entries", ())} - set(steps.ENTRIES))
    if bad or {*changes.get("tasks", ()), *changes.get("shared_tasks", ())} - {"truthfulqa_mc2", "mmlu", "bbq"}:
        p.error(f"--settings: unknown entries {bad} (known: {', '.join(steps.ENTRIES)}) or tasks "
                f"{changes.get('tasks')} (known: truthfulqa_mc2, mmlu, bbq)")
    if changes.get("vocab", defaults.vocab) not in random_model.VOCABULARIES:
        p.error(f"--settings: vocab {changes['vocab']!r} (known: {', '.join(random_model.VOCABULARIES)})")
    changes = {k: tuple(v) if isinstance(getattr(defaults, k), tuple) else v for k, v in changes.items()}
    settings = Settings(**{**asdict(defaults), "shape": args.shape, "tokenizer": args.tokenizer, "device": args.device,
                           "dtype": args.dtype, **changes})
    command = "python repro/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = run(settings, Path(args.raw), args.deadline_s, command)
    done = sum(s["status"] == "done" for s in record["steps"])
    print(f"gpu_bench: {done} of {len(record['steps'])} steps done in {record['total_s']:.0f} s -> {args.raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
