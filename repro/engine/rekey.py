"""Stored evaluations moved from the whole-folder task key to each task's own.

    python -m repro.engine.rekey results/budget_steps [--check]

An evaluation's key once hashed every file of the task folder (``cache_keys.tasks_fingerprint``), so that
an edit to bbq.yaml discarded every stored evaluation, TruthfulQA's and MMLU's included. It now hashes
the files its own task reads (``cache_keys.task_fingerprint``, repro/engine/task_files.py). An evaluation
stored under the old key whose recorded folder hash is the folder's hash now was computed with exactly
today's task files, so its task's files are today's too: it is rewritten under its new key (its
configuration's ``tasks`` and its digest updated, nothing else) and the old file removed. Left as they
are, and counted: evaluations already under their new key, ones computed with other task files or
under other package versions (their name is not the hash of their configuration here), and damaged ones
(the run that reads them says why). ``--check`` moves nothing and exits 1 when something would move.
``--prune`` also deletes the evaluations computed with other task files (a prompt, metric or filter
since edited), and those stored under an earlier version of what an evaluation keeps per document
(``cache_keys.documents_version``: a generation task's before its completions were kept): no run of this
checkout reads them back, and a committed cache would otherwise carry them for ever. It names each file
it deletes; ones from other package versions are kept (installing those versions reads them back).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from mari_eval.storage.files import atomic_write_json
from repro.engine.cache_digests import EVALUATION_FIELD, evaluation_digest, evaluation_mismatch
from repro.engine.cache_keys import config_key, documents_version, task_fingerprint, tasks_fingerprint


STALE = "other task files"  # what --prune deletes
SUPERSEDED = "an earlier documents version"  # ... and this


def _move(path: Path, folder_hash: str) -> tuple[str, Path | None, dict | None]:
    """(what happens to the evaluation at ``path``, its new file, its new content)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return "damaged", None, None
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("task"), str) or evaluation_mismatch(record):
        return "damaged", None, None
    task, _, key = path.stem.rpartition("-")
    if task != config["task"] or key != config_key(config):
        return "other versions or copied", None, None
    if config.get("documents") != documents_version(task):
        return SUPERSEDED, None, None
    new_hash = task_fingerprint(task)
    if config.get("tasks") == new_hash:
        return "already keyed by its task", None, None
    if config.get("tasks") != folder_hash:
        return STALE, None, None
    moved = {**record, "config": {**config, "tasks": new_hash}}
    moved[EVALUATION_FIELD] = evaluation_digest(moved)  # it had one, checked above
    return "moved", path.with_name(f"{task}-{config_key(moved['config'])}.json"), moved


def rekey(runs: Path, check: bool = False, prune: bool = False) -> Counter:
    """Move ``runs``' evaluations to their task's key, and with ``prune`` delete the stale ones (module
    docstring); how many went each way."""
    folder_hash, counts = tasks_fingerprint(), Counter()
    for path in sorted((runs / "evaluations").glob("*.json")):
        what, target, moved = _move(path, folder_hash)
        counts[what] += 1
        if check:
            continue
        if what == "moved":
            atomic_write_json(target, moved)
            path.unlink()
        elif what in (STALE, SUPERSEDED) and prune:
            print(f"deleted {path} ({'computed with other task files' if what == STALE else 'stored under ' + what})")
            path.unlink()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.engine.rekey", description=__doc__.split("\n\n")[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, help="a step cache (--runs): its evaluations/ folder is read")
    either = parser.add_mutually_exclusive_group()  # --check changes nothing, --prune deletes
    either.add_argument("--check", action="store_true", help="move nothing; exit 1 when something would move")
    either.add_argument("--prune", action="store_true",
                        help="also delete the evaluations computed with other task files or stored under an earlier "
                             "documents version (none is read back)")
    args = parser.parse_args(argv)
    if not (args.runs / "evaluations").is_dir():
        raise SystemExit(f"{args.runs}: no evaluations/ folder; give the --runs folder of a table's steps")
    counts = rekey(args.runs, args.check, args.prune)
    verb = "would move" if args.check else "moved"
    left = {what: n for what, n in counts.items() if what != "moved" and not (args.prune and what in (STALE, SUPERSEDED))}
    print(f"{args.runs}: {verb} {counts['moved']} evaluations to their task's key"
          + (f", deleted {counts[STALE]} computed with other task files" if args.prune else "")
          + (f" and {counts[SUPERSEDED]} stored under {SUPERSEDED}" if args.prune and counts[SUPERSEDED] else "")
          + "; left: " + (", ".join(f"{n} {what}" for what, n in sorted(left.items())) or "none"))
    return 1 if args.check and counts["moved"] else 0


if __name__ == "__main__":
    sys.exit(main())
