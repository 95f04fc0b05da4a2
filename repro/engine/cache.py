"""The cache of every repro step: trained bundles and lm-eval evaluations under ``runs/``.

Every trained bundle and every evaluation is stored under ``runs/`` in a directory
named by the SHA-256 of its full configuration (what is computed, on which model, data
sizes, seeds, hyperparameters, and the package versions). A finished step is read back
instead of recomputed, so an interrupted script continues where it stopped; a step that
was killed midway left only a temporary directory, which the next run replaces.
``force=True`` (``--force``) recomputes.

The keys are repro/engine/cache_keys.py's: the dtype of the placement enters them, and an evaluation's
task definitions. Several hosts may share ``runs/``: a half-trained bundle is named after its
host and process and only its own host judges whether it was abandoned.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

from baselines.common import selects_on_ctrl
from mari_eval.evaluation import divergence
from mari_eval.methods import registry
from mari_eval.training import train as training
from mari_eval.injection.devices import Placement
from mari_eval.storage.files import atomic_write_json
from mari_eval.judge.server import judge_identity
from mari_eval.methods import load_bundle
from repro.engine import lm_eval_run
from repro.engine.cache_keys import config_key, documents_version, task_fingerprint, with_placement
from repro.engine.documents import documents_disagree
from repro.engine.cache_digests import (BUNDLE_FIELD, EVALUATION_FIELD, RECORD, bundle_digests, bundle_mismatch, evaluation_digest,
                                        evaluation_mismatch, refuse_if_strict)
from repro.engine.judged import judged_task
from repro.engine.profiles import Profile, describe

CONTROL_SET_METHODS = ("mari",)  # the methods whose training reads D_ctrl (mari_eval.training.train.AttributeData.ctrl)

log = logging.getLogger("repro")


class Store:
    """Bundles and evaluation results under ``root``, keyed by configuration."""

    def __init__(self, root: str | Path, force: bool = False, placement=None, max_memory: str | None = None,
                 strict: bool = False):
        self.root, self.force = Path(root), force
        self.strict = strict  # --strict-cache: a damaged step stops the run (repro/engine/cache_digests.py)
        self.placement = placement or Placement()  # of every bundle trained and every evaluation run here
        self.max_memory = max_memory  # training's budget for the frozen model's work: not in keys (same results)
        self.computed: list[str] = []  # keys computed by this process (the rest were read back)
        # Seconds each step used by this process took when it was computed (now or by an earlier
        # run): a table read back from the cache in seconds still says what it cost.
        self.step_seconds: dict[str, float] = {}
        self._fingerprints: dict[Path, str] = {}  # of the bundles evaluated, read once (a stored bundle does not change)

    def compute_seconds(self) -> float:
        return round(sum(self.step_seconds.values()), 1)

    def bundle_target(self, method: str, attribute: str, model: str, seed: int, profile: Profile,
                      hyperparameters: dict[str, Any] | None = None) -> tuple[Path, dict]:
        """(the directory a bundle of this configuration is stored in, the configuration), without
        training anything: what ``bundle`` trains or reads back, and what a plan names."""
        # The profile's settings for every method (the smoke profile's epochs) reach the methods that
        # take them (``training_fields``): not the closed-form fits (CAA, ITI, NL-ITI), prompting, or a
        # plugin without epochs. Settings the caller gives are passed on as given (and checked).
        takes = registry.method_class(method).training_fields
        hp = {**{k: v for k, v in profile.hyperparameters.items() if k in takes}, **(hyperparameters or {})}
        if method == "mari":
            hp = {"single": True, **hp}  # the one-adapter ablation (Table 2) trained beside the experts
        # Only MARI (its gate's calibration) and a baseline selecting on D_ctrl (validation=ctrl) read D_ctrl:
        # the other keys leave the control set's size out, so changing it retrains those alone.
        config = {"kind": "bundle", "method": method, "attribute": attribute, "model": model, "seed": seed,
                  "max_train": profile.max_train.get(attribute), "max_pca": profile.max_pca, "hyperparameters": hp}
        if method in CONTROL_SET_METHODS or selects_on_ctrl(hp.get("validation")):
            config["max_ctrl"] = profile.max_ctrl
        config = with_placement(config, self.placement, model)
        key = config_key(config)
        final = self.root / "bundles" / f"{method}-{attribute}-s{seed}-{key}"
        return final, config

    def is_stored(self, bundle: Path, config: dict) -> bool:
        """Whether ``bundle_target``'s bundle is stored (and this run, under --force, will not retrain it)."""
        return _cached_bundle_config(bundle, config, warn=False, strict=self.strict) is not None and (not self.force or bundle.name in self.computed)

    def bundle(self, method: str, attribute: str, model: str, seed: int, profile: Profile,
               hyperparameters: dict[str, Any] | None = None) -> Path:
        """A trained bundle directory, trained now unless this configuration is stored."""
        final, config = self.bundle_target(method, attribute, model, seed, profile, hyperparameters)
        hp = config["hyperparameters"]
        cached = _cached_bundle_config(final, config, strict=self.strict)
        if cached is not None and (not self.force or final.name in self.computed):
            return self._used_bundle(final, cached)
        if final.exists() and not final.is_dir() or final.is_symlink():  # before hours of training, not after
            raise SystemExit(f"{final} is not a bundle directory but a {'link' if final.is_symlink() else 'file'}: "
                             "something other than mari-eval put it in the cache; move it away and run again")
        # Trained into a directory of this process's own, then renamed: a killed run leaves no
        # half bundle under the final name, and two runs training the same bundle never share
        # one. The per-epoch checkpoints are keyed by the configuration, so a killed run's
        # epochs are resumed by the next run (mari_eval.storage.checkpoint).
        tmp = partial_dir(final)
        _remove_abandoned(final.parent.glob(f"{final.name}.partial-*"))
        log.info("training %s on %s (%s, seed %d, %s)", method, attribute, model, seed, describe(self.placement))
        training.train(method, attribute, model, seed, tmp, max_train=config["max_train"], max_ctrl=config.get("max_ctrl"),
              max_pca=profile.max_pca, hyperparameters=hp, checkpoints=final.with_name(final.name + ".checkpoint"),
              placement=self.placement, max_memory=self.max_memory)
        atomic_write_json(tmp / RECORD, {**config, "placement_used": asdict(self.placement),
                                         BUNDLE_FIELD: bundle_digests(tmp)})  # checked on every read back
        if self.force or _cached_bundle_config(final, config, warn=False) is None:  # a stale or damaged bundle is replaced
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "bundle.json").is_file():
                raise
            shutil.rmtree(tmp)  # another run finished the same bundle first; the same configuration gives the same bundle
        self.computed.append(final.name)
        self._fingerprints.pop(final, None)  # trained again: read its fingerprint afresh
        return self._used_bundle(final, _cached_bundle_config(final, config, strict=self.strict) or {})

    def imported(self, name: str, source: Path, copy: bool = True) -> tuple[Path, str]:
        """(the directory under bundles/, its method) of a bundle made elsewhere, a table's row by
        ``--extra-bundle NAME=DIR`` (an imported control vector, a plugin's bundle): checked as
        ``lm_eval --model mari`` checks it, and copied once under bundles/ by its content
        (``extra-<name>-<fingerprint>``), where evaluations and executors find it as any other
        row's bundle. ``copy=False``: the directory it would have (a plan writes nothing)."""
        bundle = load_bundle(source)
        fingerprint = bundle.fingerprint()
        final = self.root / "bundles" / f"extra-{name}-{fingerprint}"
        if copy and not (final / "bundle.json").is_file():
            tmp = partial_dir(final)
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            shutil.rmtree(final, ignore_errors=True)  # an incomplete copy
            os.replace(tmp, final)
        self._fingerprints[final] = fingerprint  # the copy is the source byte for byte (named by it): not read again
        return final, bundle.method

    def _used_bundle(self, final: Path, config: dict) -> Path:
        seconds = config.get("train_seconds")
        self.step_seconds[final.name] = float(seconds) if isinstance(seconds, (int, float)) else 0.0
        return final

    def _evaluation_paths(self, model: str, tasks: list[str], limit: int | None, bundle: Path | None,
                          model_args: str, gen_tokens: int | None, split_seed: int) -> tuple[dict, dict]:
        """({task: its file under evaluations/}, {task: its configuration}) of an evaluation."""
        fingerprint = None
        if bundle is not None:
            if bundle not in self._fingerprints:
                self._fingerprints[bundle] = load_bundle(bundle).fingerprint()
            fingerprint = self._fingerprints[bundle]
        paths, configs = {}, {}
        judge = judge_identity() if any(map(judged_task, tasks)) else None  # reads the judge prompt file
        for task in tasks:
            configs[task] = with_placement(
                {"kind": "evaluation", "model": model, "task": task, "limit": limit, "bundle": fingerprint,
                 "model_args": model_args, "gen_tokens": gen_tokens, "documents": documents_version(task),
                 "tasks": task_fingerprint(task),  # the files of the task folder it reads
                 "split_seed": split_seed if "heldout" in task else None},  # the others have no split of ours
                self.placement, model)
            if task in divergence.VERSIONS:  # measured by mari_eval/evaluation/divergence.py, not by a task file
                configs[task]["measure"] = divergence.VERSIONS[task]
            if judged_task(task):  # another judge's verdicts are another evaluation (repro/engine/judged.py)
                configs[task]["judge"] = judge
            paths[task] = self.root / "evaluations" / f"{task}-{config_key(configs[task])}.json"
        return paths, configs

    def missing(self, model: str, tasks: list[str], limit: int | None, bundle: Path | None = None,
                model_args: str = "", gen_tokens: int | None = None, split_seed: int = 0) -> list[str]:
        """The tasks of this evaluation not stored yet (or to recompute under --force): all of them
        while its bundle is not trained."""
        if bundle is not None and not (bundle / "bundle.json").is_file():
            return list(tasks)
        paths, configs = self._evaluation_paths(model, tasks, limit, bundle, model_args, gen_tokens, split_seed)
        return [t for t in tasks if self._to_compute(paths[t], _cached_evaluation(paths[t], configs[t], warn=False))]

    def _to_compute(self, path: Path, stored: dict | None) -> bool:
        """Whether an evaluation is (re)computed: not stored, or --force and not yet computed by this run."""
        return stored is None or (self.force and path.name not in self.computed)

    def evaluations(self, model: str, tasks: list[str], limit: int | None, bundle: Path | None = None,
                    model_args: str = "", gen_tokens: int | None = None, split_seed: int = 0,
                    lm=None) -> dict[str, dict]:
        """lm-eval's results per task (each cached on its own): {"metrics", "n", "seconds", "diagnostics",
        "documents"}. The tasks not stored yet are evaluated together, in one lm-eval run on one loaded
        model (``lm``: a MariLM built for this bundle and model_args, e.g. joined to a shared pass)."""
        paths, configs = self._evaluation_paths(model, tasks, limit, bundle, model_args, gen_tokens, split_seed)
        stored = {t: _cached_evaluation(paths[t], configs[t], strict=self.strict) for t in tasks}
        missing = [t for t in tasks if self._to_compute(paths[t], stored[t])]
        if missing:
            log.info("evaluating %s on %s (%s%s, %s)", model, ", ".join(missing), bundle.name if bundle else "no bundle",
                     f", {model_args}" if model_args else "", describe(self.placement))
            for task, result in lm_eval_run.evaluate(model, missing, limit, bundle, model_args, gen_tokens, split_seed,
                                         self.placement, lm).items():
                stored[task] = {"config": configs[task], "placement_used": asdict(self.placement), **result}
                stored[task] = json.loads(json.dumps(stored[task]))  # as it reads back, then digested
                stored[task][EVALUATION_FIELD] = evaluation_digest(stored[task])
                atomic_write_json(paths[task], stored[task])
                self.computed.append(paths[task].name)
        results = {t: json.loads(json.dumps(stored[t])) for t in tasks}  # as read back from the file
        for task, result in results.items():  # tasks evaluated together share their run's seconds
            self.step_seconds[paths[task].name] = result["seconds"] / len(result.get("tasks_run_together") or [task])
        return results


def _as_stored(config: dict) -> Any:
    """``config`` as it reads back from a JSON file (tuples become lists)."""
    return json.loads(json.dumps(config))


def _read_json_object(path: Path) -> tuple[dict | None, str]:
    """(the JSON object in ``path``, "") or (None, why it is not one)."""
    try:
        found = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {e}"
    return (found, "") if isinstance(found, dict) else (None, "not a JSON object")


def _cached_bundle_config(final: Path, config: dict, warn: bool = True, strict: bool = False) -> dict | None:
    """bundle.json of a stored bundle, or None when there is none, it cannot be read, or the
    bundle's repro_config.json records another configuration than ``config`` (the one its
    directory name is the hash of: a directory copied or renamed from another step's). Then the
    bundle is trained again and replaces it; a warning names the file."""
    path = final / "bundle.json"
    if not path.is_file():
        return None
    found, why = _read_json_object(path)
    if found is not None:
        path = final / RECORD
        recorded, why = _read_json_object(path)
        if recorded is not None:
            digests = recorded.pop(BUNDLE_FIELD, None)
            recorded.pop("placement_used", None)
            other = _other_configuration(recorded, config)
            mismatch = bundle_mismatch(final, digests) if other is None else None
            if other is None and mismatch is None:
                return found
            why = f"{final.name}/{RECORD} {other}" if other else f"{final.name}/{mismatch}"
    if warn:
        refuse_if_strict(final, why, strict)
        log.warning("%s is damaged (%s): the bundle is trained again and replaces it", path, why)
    return None


def _other_configuration(recorded: Any, config: dict) -> str | None:
    """None when a stored step records ``config`` (the configuration its name is the hash of), else
    what differs: the first differing key, or that none is recorded."""
    expected = _as_stored(config)
    if recorded == expected:
        return None
    if isinstance(recorded, dict):
        key = next(k for k in sorted(set(recorded) | set(expected)) if recorded.get(k) != expected.get(k))
        difference = f"{key}: {recorded.get(key)!r} where {expected.get(key)!r} is expected"
    else:
        difference = "none recorded"
    return f"records another configuration than its name's ({difference}): copied or renamed from another step?"


# What every stored evaluation holds (``repro.engine.lm_eval_run.evaluate``'s record), by type.
_EVALUATION_FIELDS = {"metrics": dict, "n": int, "seconds": (int, float), "documents": dict}


def _cached_evaluation(path: Path, config: dict, warn: bool = True, strict: bool = False) -> dict | None:
    """A stored evaluation, or None when there is none or it is damaged. Then it is evaluated
    again and replaced, with a warning naming the file and the fault: it is a cache of a
    computation this run can redo, and nothing in it can be trusted once part of it is wrong
    (files are written whole, so damage comes from outside: a full disk, a copy, a hand edit).

    Damaged: not JSON; missing one of ``_EVALUATION_FIELDS``; its recorded configuration is not
    ``config`` (the one its name is the hash of: a file copied or renamed from another step's);
    or its content disagrees with its own header: a metric's per-document scores do not number
    ``n`` documents, or their mean is not the metric's figure (``documents_disagree``)."""
    if not path.is_file():
        return None
    result, why = _read_json_object(path)
    if result is not None:
        wrong = [k for k, kind in _EVALUATION_FIELDS.items()
                 if not isinstance(result.get(k), kind) or isinstance(result.get(k), bool)]
        if wrong:
            why = f"missing or malformed: {', '.join(wrong)}"
        elif (other := _other_configuration(result.get("config"), config)) is not None:
            why = f"it {other}"
        else:
            why = documents_disagree(result["documents"], result["metrics"], result["n"]) or evaluation_mismatch(result)
            if why is None:
                return result
    if warn:
        refuse_if_strict(path, why, strict)
        log.warning("%s is damaged (%s): evaluating again, the new result replaces it", path, why)
    return None


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
