"""What the repro scripts share: profiles, cached training and evaluation steps, the
paper's tables, and atomic writers for results/.

Every trained bundle and every evaluation is stored under ``runs/`` in a directory
named by the SHA-256 of its full configuration (what is computed, on which model, data
sizes, seeds, hyperparameters, and the package versions). A finished step is read back
instead of recomputed, so an interrupted script continues where it stopped; a step that
was killed midway left only a temporary directory, which the next run replaces.
``force=True`` (``--force``) recomputes.

Every script takes ``mari-eval train``'s placement flags (``--dtype``, ``--device``,
``--device-map``, ``--max-memory-per-gpu``, ``--max-cpu-memory``): one ``Placement`` for
the bundles it trains and the evaluations it runs. The dtype enters the cache keys
(``placement_key``). Several hosts may share ``runs/``: a half-trained bundle is named
after its host and process and only its own host judges whether it was abandoned.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from mari_eval.files import atomic_write, atomic_write_json

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "results" / "paper"
log = logging.getLogger("repro")

METHODS = ["vanilla", "caa", "iti", "nl_iti", "reft", "mari"]
METHOD_LABELS = {"vanilla": "Vanilla", "caa": "CAA", "iti": "ITI", "nl_iti": "NL-ITI", "reft": "ReFT", "mari": "MARI"}

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
# Percentages in the paper's table (the others are fractions, as the paper prints them).
PERCENT_COLUMNS = {"tqa_mc1", "tqa_mc2", "mmlu", "arc_e", "arc_c", "gsm8k"}
COLUMN_DIGITS = {"bbq_acc": 3, "sorry_refusal": 3, "sorry_keyword": 3}


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

    def task(self, name: str) -> str:
        return self.tasks.get(name, name)


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

PROFILES = {
    # Every script end to end in a few minutes (tests).
    "smoke": Profile("smoke", ["smollm2-135m-instruct"], [0], {"truthfulqa": 4, "bbq": 4, "sorry_bench": 4}, 2,
                     {"truthfulqa_mc1_heldout": 2, "truthfulqa_mc2_heldout": 2, "bbq_disambig_heldout": 2,
                      "sorry_bench_heldout": 2, "mmlu": 1, "arc_easy": 2, "arc_challenge": 2, "gsm8k": 1},
                     {"epochs": 1}, max_pca=24, gen_tokens={"sorry_bench_heldout": 8, "gsm8k": 8},
                     tasks={"mmlu": "mmlu_abstract_algebra"}),
    # The embedded model on 2 CPU cores within the hour: seeded subsets, first-N test documents.
    "quick": Profile("quick", ["smollm2-135m-instruct"], [0], {"truthfulqa": 24, "bbq": 24, "sorry_bench": 24}, 16,
                     {"truthfulqa_mc1_heldout": 30, "truthfulqa_mc2_heldout": 30, "bbq_disambig_heldout": 30,
                      "sorry_bench_heldout": 8, "mmlu": 1, "arc_easy": 10, "arc_challenge": 10, "gsm8k": 20},
                     max_pca=128, gen_tokens={"sorry_bench_heldout": 48, "gsm8k": 128}),
    # The paper's setting on GPU machines: its models, full test sets, 3 seeds; in bf16 spread over the GPUs.
    "paper": Profile("paper", list(PAPER_MODELS.values()), [0, 1, 2], {"truthfulqa": None, "bbq": None, "sorry_bench": None},
                     None, {}, cuda_placement={"dtype": "bfloat16", "device_map": "auto"}),
}
PLACEMENT_HELP = """\
The frozen model's placement, for the bundles a script trains and the evaluations it runs
(the flags of `mari-eval train`). --profile paper on a machine with CUDA defaults to
--dtype bfloat16 --device-map auto: an explicit --dtype replaces its dtype, an explicit
--device or --device-map its device map. Otherwise: dtype auto (the checkpoint's own;
float32 for the embedded models), cuda when available, else cpu. The resolved dtype is
part of every cached step's key under --runs (bf16 and float32 are cached apart)."""


def profile_from_args(args) -> Profile:
    profile = PROFILES[args.profile]
    if getattr(args, "model", None):
        profile = Profile(**{**profile.__dict__, "models": [args.model]})
    if getattr(args, "seeds", None):
        profile = Profile(**{**profile.__dict__, "seeds": [int(s) for s in args.seeds.split(",")]})
    return profile


def placement_from_args(args, profile: Profile):
    """The ``train.Placement`` of a script's command line: its flags, else the profile's
    defaults on a CUDA machine (``Profile.cuda_placement``), else ``mari-eval train``'s."""
    from mari_eval.devices import Placement

    values = {"dtype": args.dtype, "device": args.device, "device_map": args.device_map,
              "max_memory_per_gpu": args.max_memory_per_gpu, "max_cpu_memory": args.max_cpu_memory}
    if profile.cuda_placement:
        import torch

        if torch.cuda.is_available():
            defaults = dict(profile.cuda_placement)
            if values["device"] is not None:  # one device named: no device map of the profile's
                defaults.pop("device_map", None)
            values.update({k: v for k, v in defaults.items() if values[k] is None})
    return Placement(**{**values, "dtype": values["dtype"] or "auto"})


def add_common_args(parser) -> None:
    from mari_eval.cli import add_placement_arguments

    parser.add_argument("--profile", choices=sorted(PROFILES), default="quick",
                        help="how much to compute (default: quick); paper also defaults to bf16 with --device-map auto "
                             "on a CUDA machine (see placement below)")
    parser.add_argument("--smoke", dest="profile", action="store_const", const="smoke", help="same as --profile smoke")
    parser.add_argument("--model", help="run this model (embedded alias or Hub id) instead of the profile's")
    parser.add_argument("--seeds", help="comma-separated seeds instead of the profile's")
    parser.add_argument("--runs", default=str(REPO / "runs"), help="where bundles and evaluations are cached")
    parser.add_argument("--out", default=str(REPO / "results"), help="where tables and plots are written")
    parser.add_argument("--force", action="store_true", help="recompute cached steps")
    parser.add_argument("--columns", help="comma-separated subset of the table's benchmark columns (e.g. tqa_mc1,bbq_acc)")
    placement = parser.add_argument_group("placement", PLACEMENT_HELP)
    add_placement_arguments(placement)
    parser.set_defaults(dtype=None)  # not given: the profile's default (placement_from_args)
    placement.add_argument("--max-memory", help="as mari-eval train's: what training may keep of the frozen model's work, "
                                                "e.g. 40GiB (beyond it caches are recomputed; results are the same)")


def select(columns: list[tuple], wanted: str | None) -> list[tuple]:
    """The benchmark columns named in ``--columns`` (all without it)."""
    if not wanted:
        return columns
    names = wanted.split(",")
    unknown = sorted(set(names) - {c[0] for c in columns})
    if unknown:
        raise SystemExit(f"--columns: unknown {unknown}; this table has {[c[0] for c in columns]}")
    return [c for c in columns if c[0] in names]


# ----------------------------------------------------------------------------- the cache


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out = {}
    for pkg in ("mari-eval", "torch", "transformers", "lm_eval"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def config_key(config: dict) -> str:
    """The hash a step is stored under: its configuration plus the package versions."""
    text = json.dumps({"config": config, "versions": _versions()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@lru_cache(maxsize=None)
def resolved_dtype(dtype: str, model: str) -> str:
    """The dtype ``model`` is loaded in under ``dtype``: "auto" is the checkpoint's config's
    (as transformers reads it), or stays "auto" when the config does not say or cannot be read."""
    if dtype != "auto":
        return dtype
    try:
        from transformers import AutoConfig

        from mari_eval.models import resolve_model

        config = AutoConfig.from_pretrained(resolve_model(model))
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    except (OSError, ValueError, KeyError) as e:
        log.info("dtype auto of %s unresolved (%s): cached under 'auto'", model, e)
        found = None
    return "auto" if found is None else str(found).removeprefix("torch.")


def placement_key(placement, model: str) -> dict | None:
    """What a placement adds to the cache key of a step on ``model``: None (nothing) for float32.

    Only the dtype enters the key, resolved ("auto" is the checkpoint's dtype): it changes what
    is computed (a bf16 evaluation is never read back for a float32 request, nor the reverse).
    The device, the device map and the memory caps do not: they change where layers run, which
    moves results by rounding only (tests/test_scale.py: a device map equals one device), and
    keys never told CPU from GPU hosts either (``--device`` defaults to whichever the host has).

    Nothing is added for float32 so that the steps cached before placements existed stay
    valid: every one of them ran in float32 (MariLM's and training's dtype until dtype auto
    became the default), and "auto" on a float32 checkpoint (the embedded models) is float32,
    so the default command keeps its keys. "auto" on a bf16 checkpoint (the paper's models)
    now computes in bf16 and gets a key of its own, so an older float32 step of such a model
    is not read back for it; "auto" that cannot be resolved is keyed as "auto".
    """
    dtype = resolved_dtype(placement.dtype, model)
    return None if dtype == "float32" else {"dtype": dtype}


def _with_placement(config: dict, placement, model: str) -> dict:
    key = placement_key(placement, model)
    return config if key is None else {**config, "placement": key}


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: a reader (or a killed writer) never leaves a half-written file."""
    atomic_write_json(path, obj)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, text)


class Store:
    """Bundles and evaluation results under ``root``, keyed by configuration."""

    def __init__(self, root: str | Path, force: bool = False, placement=None, max_memory: str | None = None):
        from mari_eval.devices import Placement

        self.root, self.force = Path(root), force
        self.placement = placement or Placement()  # of every bundle trained and every evaluation run here
        self.max_memory = max_memory  # training's budget for the frozen model's work: not in keys (same results)
        self.computed: list[str] = []  # keys computed by this process (the rest were read back)
        # Seconds each step used by this process took when it was computed (now or by an earlier
        # run): a table read back from the cache in seconds still says what it cost.
        self.step_seconds: dict[str, float] = {}

    def compute_seconds(self) -> float:
        return round(sum(self.step_seconds.values()), 1)

    def bundle(self, method: str, attribute: str, model: str, seed: int, profile: Profile,
               hyperparameters: dict[str, Any] | None = None) -> Path:
        """A trained bundle directory, trained now unless this configuration is stored."""
        from mari_eval.train import train

        hp = {**profile.hyperparameters, **(hyperparameters or {})}
        if method in ("caa", "iti", "nl_iti"):
            hp = {k: v for k, v in hp.items() if k not in ("epochs",)}  # no epochs: closed-form fits
        if method == "mari":
            hp = {"single": True, **hp}  # the one-adapter ablation (Table 2) trained beside the experts
        config = {"kind": "bundle", "method": method, "attribute": attribute, "model": model, "seed": seed,
                  "max_train": profile.max_train.get(attribute), "max_ctrl": profile.max_ctrl, "max_pca": profile.max_pca,
                  "hyperparameters": hp}
        config = _with_placement(config, self.placement, model)
        key = config_key(config)
        final = self.root / "bundles" / f"{method}-{attribute}-s{seed}-{key}"
        cached = _cached_bundle_config(final)
        if cached is not None and (not self.force or final.name in self.computed):
            return self._used_bundle(final, cached)
        # Trained into a directory of this process's own, then renamed: a killed run leaves no
        # half bundle under the final name, and two runs training the same bundle never share
        # one. The per-epoch checkpoints are keyed by the configuration, so a killed run's
        # epochs are resumed by the next run (mari_eval.checkpoint).
        tmp = partial_dir(final)
        _remove_abandoned(final.parent.glob(f"{final.name}.partial-*"))
        log.info("training %s on %s (%s, seed %d, %s)", method, attribute, model, seed, describe(self.placement))
        train(method, attribute, model, seed, tmp, max_train=config["max_train"], max_ctrl=profile.max_ctrl,
              max_pca=profile.max_pca, hyperparameters=hp, checkpoints=final.with_name(final.name + ".checkpoint"),
              placement=self.placement, max_memory=self.max_memory)
        write_json(tmp / "repro_config.json", {**config, "placement_used": asdict(self.placement)})
        if self.force or _cached_bundle_config(final, warn=False) is None:  # a stale or damaged bundle is replaced
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "bundle.json").is_file():
                raise
            shutil.rmtree(tmp)  # another run finished the same bundle first; the same configuration gives the same bundle
        self.computed.append(final.name)
        return self._used_bundle(final, _cached_bundle_config(final) or {})

    def _used_bundle(self, final: Path, config: dict) -> Path:
        seconds = config.get("train_seconds")
        self.step_seconds[final.name] = float(seconds) if isinstance(seconds, (int, float)) else 0.0
        return final

    def evaluations(self, model: str, tasks: list[str], limit: int | None, bundle: Path | None = None,
                    model_args: str = "", gen_tokens: int | None = None, split_seed: int = 0) -> dict[str, dict]:
        """lm-eval's results per task (each cached on its own): {"metrics", "n", "seconds", "diagnostics"}.
        The tasks not stored yet are evaluated together, in one lm-eval run on one loaded model."""
        fingerprint = None
        if bundle is not None:
            from mari_eval.methods import load_bundle

            fingerprint = load_bundle(bundle).fingerprint()
        paths, configs = {}, {}
        for task in tasks:
            configs[task] = _with_placement(
                {"kind": "evaluation", "model": model, "task": task, "limit": limit, "bundle": fingerprint,
                 "model_args": model_args, "gen_tokens": gen_tokens,
                 "split_seed": split_seed if "heldout" in task else None},  # the others have no split of ours
                self.placement, model)
            paths[task] = self.root / "evaluations" / f"{task}-{config_key(configs[task])}.json"
        stored = {t: _cached_evaluation(paths[t]) for t in tasks}
        missing = [t for t in tasks if stored[t] is None or (self.force and paths[t].name not in self.computed)]
        if missing:
            log.info("evaluating %s on %s (%s%s, %s)", model, ", ".join(missing), bundle.name if bundle else "no bundle",
                     f", {model_args}" if model_args else "", describe(self.placement))
            for task, result in _evaluate(model, missing, limit, bundle, model_args, gen_tokens, split_seed,
                                          self.placement).items():
                stored[task] = {"config": configs[task], "placement_used": asdict(self.placement), **result}
                write_json(paths[task], stored[task])
                self.computed.append(paths[task].name)
        results = {t: json.loads(json.dumps(stored[t])) for t in tasks}  # as read back from the file
        for task, result in results.items():  # tasks evaluated together share their run's seconds
            self.step_seconds[paths[task].name] = result["seconds"] / len(result.get("tasks_run_together") or [task])
        return results


def _cached_bundle_config(final: Path, warn: bool = True) -> dict | None:
    """bundle.json of a stored bundle, or None when there is none or it cannot be read (then the
    bundle is trained again and replaces it; a warning names the file)."""
    path = final / "bundle.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        config, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "not a JSON object"
    if isinstance(config, dict):
        return config
    if warn:
        log.warning("%s is damaged (%s): the bundle is trained again and replaces it", path, why)
    return None


# What every stored evaluation holds (``_evaluate``'s record), by type.
_EVALUATION_FIELDS = {"metrics": dict, "n": int, "seconds": (int, float)}


def _cached_evaluation(path: Path) -> dict | None:
    """A stored evaluation, or None when there is none or it is damaged: not JSON, or missing
    one of ``_EVALUATION_FIELDS``. A damaged one is evaluated again and replaced, with a warning
    naming the file: it is a cache of a computation this run can redo, and nothing in it can
    be trusted once part of it is wrong (files are written whole, so damage comes from outside:
    a full disk, a copy, a hand edit)."""
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = f"{type(e).__name__}: {e}"
    else:
        if not isinstance(result, dict):
            why = "not a JSON object"
        else:
            wrong = [k for k, kind in _EVALUATION_FIELDS.items()
                     if not isinstance(result.get(k), kind) or isinstance(result.get(k), bool)]
            if not wrong:
                return result
            why = f"missing or malformed: {', '.join(wrong)}"
    log.warning("%s is damaged (%s): evaluating again, the new result replaces it", path, why)
    return None


def describe(placement) -> str:
    """A placement in a log line: dtype bfloat16, device_map auto."""
    return ", ".join(f"{k} {v}" for k, v in asdict(placement).items() if v is not None)


def _host() -> str:
    """This machine's name as partial directories record it (characters safe in a file name)."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "unknown_host"


def partial_dir(final: Path) -> Path:
    """Where this process trains the bundle ``final``: ``<final>.partial-<host>-<pid>``.

    The host is part of the name because several machines may share runs/: a pid says
    nothing about a process on another host, so only the host named in a partial directory
    may judge it abandoned (``_remove_abandoned``). Dashes in the host name become "_", so
    the pid is whatever follows the last dash."""
    return final.with_name(f"{final.name}.partial-{_host()}-{os.getpid()}")


_PARTIAL_OWNER = re.compile(r"(?:(?P<host>[A-Za-z0-9._]+)-)?(?P<pid>[0-9]{1,10})")


def _partial_owner(path: Path) -> tuple[str | None, int] | None:
    """(host, pid) of a partial directory; host None for the names of earlier versions
    (``<final>.partial-<pid>``, written before runs/ was shared by hosts); None for a name of
    neither form (``NAME.partial-old``; a pid that is not ASCII digits or is 0)."""
    match = _PARTIAL_OWNER.fullmatch(path.name.rsplit(".partial-", 1)[-1])
    if match is None or int(match["pid"]) == 0:
        return None
    return match["host"], int(match["pid"])


def _remove_abandoned(partials) -> None:
    """Delete the half-trained bundle directories of runs that no longer exist (killed ones).

    A partial directory is abandoned when it is this host's (its name says so, or names no
    host: the earlier versions' names) and its process is not alive here. One of another
    host is never touched, whatever its pid: that process may be training it right now."""
    for path in partials:
        owner = _partial_owner(path)
        if owner is None or not path.is_dir() or path.is_symlink():
            log.warning("%s: not a partial bundle of ours (a directory NAME.partial-HOST-PID); left alone", path)
            continue
        host, pid = owner
        if host is not None and host != _host():
            log.info("%s: a partial bundle of host %s (pid %d), not this one (%s); left alone", path.name, host, pid, _host())
            continue
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()  # our own pid: a previous process's directory, this one is about to train
        except ProcessLookupError:
            alive = False
        except PermissionError:  # another user's live process
            alive = True
        except OverflowError:  # no pid of this system (a name not written by partial_dir)
            log.warning("%s: pid %d is beyond this system's; not a partial bundle of ours, left alone", path, pid)
            continue
        if not alive:
            log.info("%s: abandoned by process %d, which is gone; removed", path.name, pid)
            shutil.rmtree(path, ignore_errors=True)


_BASE_MODELS: dict[tuple, tuple] = {}  # (model name, placement) -> (frozen model, tokenizer), loaded once per process


def _mari_lm(model: str, bundle: Path | None, model_args: str, placement=None):
    from lm_eval.utils import simple_parse_args_string

    from mari_eval.lm import MariLM
    from mari_eval.devices import Placement

    placement = placement or Placement()
    if (model, placement) not in _BASE_MODELS:  # loaded in the placement; the later MariLMs share the loaded model
        first = MariLM(pretrained=model, **placement.model_args())
        _BASE_MODELS[(model, placement)] = (first.model, first.tokenizer)
    frozen, tokenizer = _BASE_MODELS[(model, placement)]
    kwargs = simple_parse_args_string(model_args) if model_args else {}
    return MariLM(pretrained=frozen, tokenizer=tokenizer, bundle=str(bundle) if bundle else None, **kwargs)


def _task_names(out: dict, name: str) -> set[str]:
    """A task's name and, for a group (MMLU), the names of all its subtasks, at any depth."""
    return {name}.union(*(_task_names(out, sub) for sub in out.get("group_subtasks", {}).get(name, [])))


def _documents(out: dict, name: str) -> int:
    """Documents evaluated for a task or, for a group, summed over its subtasks."""
    return sum(out["n-samples"][t]["effective"] for t in _task_names(out, name) if t in out["n-samples"])


def _evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement=None) -> dict[str, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if any(t.startswith("sorry") for t in tasks):
        _ensure_judge()
    lm = _mari_lm(model, bundle, model_args, placement)
    started = time.time()
    out = simple_evaluate(
        model=lm, tasks=list(tasks), limit=limit, bootstrap_iters=0,
        gen_kwargs=f"max_gen_toks={gen_tokens}" if gen_tokens else None,
        task_manager=TaskManager(include_path=str(REPO / "harness_tasks"), metadata={"split_seed": split_seed or 0}),
    )
    seconds = round(time.time() - started, 1)
    results = {}
    for task in tasks:
        metrics = {k: v for k, v in out["results"][task].items() if isinstance(v, (int, float)) or v is None}
        diagnostics = None
        if lm.intervention is not None:  # a group's records name its subtasks
            names = _task_names(out, task)
            diagnostics = lm.intervention.summarize([r for r in lm.records if r.get("task") in names])
        results[task] = {"metrics": metrics, "n": _documents(out, task), "seconds": seconds, "tasks_run_together": list(tasks),
                         "model_dtype": str(lm.model.dtype).removeprefix("torch."),  # what it computed in
                         "diagnostics": diagnostics}
    return results


_JUDGE = contextlib.ExitStack()


def _ensure_judge() -> None:
    """SORRY-Bench tasks need a judge: the configured one (MARI_JUDGE_*), else the embedded one,
    started once for this process and stopped at its exit (mari_eval.judge.judge_environment)."""
    from mari_eval.judge import ENV_BASE_URL, ENV_MODEL, judge_environment

    if os.environ.get(ENV_BASE_URL) and os.environ.get(ENV_MODEL):
        return
    os.environ.update(_JUDGE.enter_context(judge_environment()))
    atexit.register(_JUDGE.close)


def score(store: Store, profile: Profile, model: str, seed: int, columns: list[tuple], bundles: dict[str, Path | None],
          model_args: str = "") -> dict[str, dict]:
    """{column: {"value", "n", "diagnostics"}} for ``columns`` (BENCHMARKS-like tuples), each task
    evaluated under the bundle of its attribute (none: the base model); tasks that share a bundle,
    a document limit and a generation length run together."""
    groups: dict[tuple, list[str]] = {}
    for column, task, metric, attribute in columns:
        key = (attribute, profile.limits.get(task), profile.gen_tokens.get(task))
        if profile.task(task) not in groups.setdefault(key, []):
            groups[key].append(profile.task(task))
    evaluated: dict[str, dict] = {}
    for (attribute, limit, gen_tokens), tasks in groups.items():
        evaluated.update(store.evaluations(model, tasks, limit, bundles.get(attribute), model_args, gen_tokens, seed))
    out = {}
    for column, task, metric, attribute in columns:
        result = evaluated[profile.task(task)]
        value = result["metrics"].get(metric)
        value = float("nan") if value is None else float(value) * (100 if column in PERCENT_COLUMNS else 1)
        out[column] = {"value": value, "n": result["n"], "diagnostics": result.get("diagnostics")}
    return out


# ----------------------------------------------------------------------------- the paper's tables


def paper_rows(name: str) -> list[dict[str, str]]:
    """Rows of one of the paper's tables (results/paper/<name>.csv, copied from ../shared/paper)."""
    path = PAPER / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: copy it from ../shared/paper/{name}.csv")
    with open(path) as fh:
        return list(csv.DictReader(fh))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    import statistics

    if not values:
        return float("nan"), None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(mean: float, std: float | None, digits: int = 2) -> str:
    if mean != mean:  # NaN
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)


def start(doc: str, script: str, argv: list[str] | None, extra_args=None):
    """Parse a repro script's command line: (args, profile, store, the command as it will be recorded)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    setup_logging()
    command = (f"python repro/{script} " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    profile = profile_from_args(args)
    try:
        placement = placement_from_args(args, profile)
    except ValueError as e:
        parser.error(str(e))
    return args, profile, Store(args.runs, force=args.force, placement=placement, max_memory=args.max_memory), command


def add_gate_rates(scores: dict[str, dict], columns: dict[str, str]) -> dict[str, dict]:
    """``scores`` plus a column per {new column: benchmark column}: the fraction of that
    benchmark's documents on which MARI's energy gate opened (from its evaluation's
    diagnostics; NaN where there is no gate)."""
    for gate_column, column in columns.items():
        rate = (scores[column]["diagnostics"] or {}).get("gate_rate")
        scores[gate_column] = {"value": float("nan") if rate is None else rate, "n": scores[column]["n"]}
    return scores


def tally(cells: dict, model: str, label: str, scores: dict[str, dict]) -> None:
    """Add one seed's ``score`` results to ``cells`` = {model: {row label: {column: {"values", "n"}}}}."""
    for column, result in scores.items():
        cell = cells.setdefault(model, {}).setdefault(label, {}).setdefault(column, {"values": [], "n": result["n"]})
        cell["values"].append(result["value"])


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display on CI or servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------- writing tables


def cost(store: Store) -> str:
    """What the steps behind a table cost, whether this run computed them or read them back."""
    reused = sum(1 for name in store.step_seconds if name not in store.computed)
    return (f"its {len(store.step_seconds)} training and evaluation steps took {store.compute_seconds():.0f} s of "
            f"computation ({reused} of them read back from the cache under runs/)")


def write_tables(out: Path, name: str, title: str, intro: str, cells: dict, columns: list[str], paper_lookup,
                 profile: Profile, command: str, wall: float, store: Store) -> dict:
    """results/<name>.{json,md,tex} from ``cells`` = {model: {row label: {column: {"values", "n"}}}}.

    ``paper_lookup(model) -> (paper model, {row label: {column: figure}})`` gives the paper's
    figures, shown in their own column beside ours and never mixed into them.
    """
    record = {"command": command, "profile": profile.name, "seeds": profile.seeds, "max_train": profile.max_train,
              "max_ctrl": profile.max_ctrl, "limits": profile.limits, "gen_tokens": profile.gen_tokens, "tasks": profile.tasks,
              "placement": asdict(store.placement),
              "wall_time_s": round(wall, 1), "compute_time_s": store.compute_seconds(), "computed_now": store.computed,
              "models": {}}
    md = [f"# {title}\n", f"Generated by `{command}` (profile `{profile.name}`, seeds {profile.seeds}, "
          f"{describe(store.placement)}) in {wall:.0f} s; "
          f"{cost(store)}. {intro}\n"]
    tex = ["\\begin{tabular}{l" + "c" * len(columns) + "}", "\\toprule",
           " & ".join(["Row"] + [c.replace("_", "\\_") for c in columns]) + " \\\\", "\\midrule"]
    for model, rows in cells.items():
        paper_model, paper = paper_lookup(model)
        entry = record["models"][model] = {"paper_model": paper_model, "dtype": resolved_dtype(store.placement.dtype, model),
                                           "rows": []}
        md += [f"\n## {model} ({entry['dtype']}; paper column: {paper_model})\n",
               "| row | " + " | ".join(f"{c} (ours) | {c} (paper)" for c in columns) + " |",
               "|---|" + "---|---|" * len(columns)]
        tex.append(f"\\multicolumn{{{len(columns) + 1}}}{{c}}{{\\textit{{{model}}}}} \\\\")
        for label, by_column in rows.items():
            row = {"row": label, "ours": {}, "n": {}, "paper": {}}
            md_cells, tex_cells = [], []
            for column in columns:
                cell = by_column.get(column, {"values": [], "n": 0})
                mean, std = mean_std([v for v in cell["values"] if v == v])
                figure = paper.get(label, {}).get(column)
                row["ours"][column] = {"mean": mean, "std": std, "values": cell["values"]}
                row["n"][column] = cell["n"]
                row["paper"][column] = float(figure) if figure not in (None, "") else None
                digits = 2 if column in PERCENT_COLUMNS or column not in COLUMN_DIGITS else COLUMN_DIGITS[column]
                md_cells += [f"{fmt(mean, std, digits)} (n={cell['n']})", figure or "-"]
                tex_cells.append(fmt(mean, std, digits).replace("±", "$\\pm$"))
            entry["rows"].append(row)
            md.append(f"| {label} | " + " | ".join(md_cells) + " |")
            tex.append(f"{label} & " + " & ".join(tex_cells) + " \\\\")
    tex += ["\\bottomrule", "\\end{tabular}"]
    write_json(out / f"{name}.json", record)
    write_text(out / f"{name}.md", "\n".join(md) + "\n")
    write_text(out / f"{name}.tex", "\n".join(tex) + "\n")
    print("\n".join(md))
    return record
