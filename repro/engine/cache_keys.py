"""The keys the repro cache (repro/engine/cache.py) stores steps under: a step's configuration (with the
placement's dtype, ``placement_key``; an evaluation's task definitions, ``task_fingerprint``) and
the package versions, hashed (``config_key``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
from collections import Counter
from functools import lru_cache
from pathlib import Path

from mari_eval.benchmarks.tasks import tasks_dir
from repro.engine import task_files

log = logging.getLogger("repro")

# Version of what an evaluation keeps per document (repro/engine/documents.py), part of its cache key:
# evaluations stored before documents were kept (1), or before BBQ's carried their context (2), are
# evaluated again.
DOCUMENTS_VERSION = 2
# A generation task's evaluations also keep every completion (3: repro/engine/completions.py, issue 81.4), so
# that a table can show and re-judge what a bundle said; stored before, they hold none and are generated
# again. The other tasks keep DOCUMENTS_VERSION: nothing they store changed, and their steps stay valid.
GENERATION_DOCUMENTS_VERSION = 3


KEYED_PACKAGES = ("mari-eval", "torch", "transformers", "lm_eval")  # their versions enter every key


@lru_cache(maxsize=None)
def generation_task(task: str) -> bool:
    """Whether ``task`` generates text (its YAML's ``output_type: generate_until``; repro/engine/task_files.py)."""
    return task_files.generates(tasks_dir(), task)


def documents_version(task: str) -> int:
    """The version of what an evaluation of ``task`` keeps per document, part of its key."""
    return GENERATION_DOCUMENTS_VERSION if generation_task(task) else DOCUMENTS_VERSION


def _versions() -> dict[str, str | None]:
    out = {}
    for pkg in KEYED_PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _digest(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@lru_cache(maxsize=None)
def tasks_fingerprint() -> str:
    """A hash of this suite's whole task folder (mari_eval.benchmarks.tasks.tasks_dir: the YAMLs, their
    templates, utils.py with its metrics and filters; not the README): what every evaluation's key held
    before ``task_fingerprint`` (``repro.engine.rekey`` moves evaluations stored under it)."""
    root = tasks_dir()
    return _digest(root, task_files.definition_files(root))


@lru_cache(maxsize=None)
def task_fingerprint(task: str) -> str:
    """A hash of the task folder's files an evaluation of ``task`` reads (repro/engine/task_files.py: its
    YAML, includes, group members and the modules they call), part of its key: an edited prompt, metric
    or filter is evaluated again, not read back, and an edit to another task's files leaves it valid. A
    task no file of the folder defines (lm-eval's own, covered by its version in ``config_key``; the
    KL/cross-entropy measure) reads none of them: the hash of no file."""
    root = tasks_dir()
    return _digest(root, task_files.task_files(root, task))


def config_key(config: dict) -> str:
    """The hash a step is stored under: its configuration plus the package versions."""
    text = json.dumps({"config": config, "versions": _versions()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def warn_if_stored_under_other_versions(root: str | Path) -> None:
    """Say, before any work, when no bundle stored under ``root`` was trained under this environment's
    versions of the keyed packages: their keys hash those versions, so none of them, and no evaluation of
    them, would be read back, and every step would be computed again. The warning names the versions to
    install to read them back (a committed step cache, results/budget_steps/, holds hours of work that
    only its own versions reach). Reads bundles' records (``versions`` in bundle.json) until one has this
    environment's versions; writes nothing."""
    current = _versions()
    mine = tuple(current.items())
    found: Counter = Counter()
    for record in Path(root).glob("bundles/*/bundle.json"):
        try:
            versions = json.loads(record.read_text()).get("versions")
        except (OSError, ValueError, AttributeError):
            continue  # a damaged bundle is the cache's to report, when its step is reached
        if not isinstance(versions, dict):
            continue  # made elsewhere without a record of its versions: nothing to compare
        recorded = tuple((package, versions.get(package)) for package in KEYED_PACKAGES)
        if recorded == mine:
            return  # its steps are read back: nothing to say, and no need to read the rest
        found[recorded] += 1
    if not found:
        return
    stored, count = found.most_common(1)[0]
    differ = {package: version for package, version in stored if version != current[package]}
    log.warning("%d bundle(s) under %s were trained under %s, where this environment has %s: cache keys hash these "
                "versions, so none of them will be read back and every step is computed again. To continue from them, "
                "install those versions (pip install %s), or give --runs another folder to start afresh.",
                count, root, differ, {package: current[package] for package in differ},
                " ".join(f"'{package}=={version.split('+')[0]}'" for package, version in differ.items() if version))


@lru_cache(maxsize=None)
def resolved_dtype(dtype: str, model: str) -> str:
    """The dtype ``model`` is loaded in under ``dtype``: "auto" is the checkpoint's config's
    (as transformers reads it), or stays "auto" when the config does not say or cannot be read."""
    if dtype != "auto":
        return dtype
    try:
        from transformers import AutoConfig  # deferred: transformers is heavy; only resolving dtype 'auto' needs it

        from mari_eval.storage.models import resolve_model  # deferred: with AutoConfig above

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
    moves results by rounding only (tests/test_scale.py: a device map equals one device). A host's
    torch build does enter every key, through ``_versions``: torch's version carries its local
    label ("2.13.0+cpu"), so a CPU build's steps are not read back by a CUDA build's run, nor the reverse.

    Nothing is added for float32 so that the steps cached before placements existed stay
    valid: every one of them ran in float32 (MariLM's and training's dtype until dtype auto
    became the default), and "auto" on a float32 checkpoint (the embedded models) is float32,
    so the default command keeps its keys. "auto" on a bf16 checkpoint (the paper's models)
    now computes in bf16 and gets a key of its own, so an older float32 step of such a model
    is not read back for it; "auto" that cannot be resolved is keyed as "auto".
    """
    dtype = resolved_dtype(placement.dtype, model)
    return None if dtype == "float32" else {"dtype": dtype}


def with_placement(config: dict, placement, model: str) -> dict:
    key = placement_key(placement, model)
    return config if key is None else {**config, "placement": key}
