"""What a cached step holds, recorded when it is written and checked when it is read back.

A bundle under ``runs/bundles/`` records the SHA-256 of each of its files (weights, bundle.json,
diagnostics: every regular file but repro_config.json itself) in its repro_config.json, beside
the configuration it was trained from. An evaluation under ``runs/evaluations/`` records the
SHA-256 of its own content (configuration, metrics, n, per-document scores: the canonical JSON
of everything but the digest). A weight changed, a byte flipped, a multiplier edited in
bundle.json, another step's files copied in, an ``n`` or a document edited: each no longer
matches, and the step is computed again with a warning naming the file (``repro.engine.cache``), or,
under ``--strict-cache``, the run stops there.

A step whose record holds no digest is damaged like the others: computed again (refused under
``--strict-cache``), never read back unverified. Every mari-eval since digests were added (92eba31,
2026-11-28) writes them, and nothing else in a record tells one stored before then from one whose
digest was deleted: its key (the file's name) hashes the same configuration and versions either way
(mari-eval has been 0.1.0 throughout), and any other field could be deleted as the digest was. Every
step of the committed cache, results/budget_steps/, records its digests.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from mari_eval.storage.files import file_sha256

log = logging.getLogger("repro")

BUNDLE_FIELD = "files"  # in repro_config.json: {file name: sha256}
EVALUATION_FIELD = "digest"  # in an evaluation's JSON: the sha256 of the rest
RECORD = "repro_config.json"  # the record itself, not digested


class CacheIntegrityError(SystemExit):
    """A cached step does not match what it recorded, under --strict-cache: the run stops with the
    message (exit status 1), as an argument error does."""


def bundle_digests(folder: Path) -> dict[str, str]:
    """{path relative to ``folder``: sha256} of every regular file of a bundle but its record."""
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != RECORD}


NO_DIGEST = ("records no digest, which every mari-eval since 2026-11-28 writes: removed, or written by "
             "something else (a step stored before then cannot be told from one whose digest was deleted)")


def bundle_mismatch(folder: Path, expected: Any) -> str | None:
    """What in ``folder`` differs from ``expected``, the digests its record holds (its BUNDLE_FIELD;
    None: all the same; a sentence naming the file otherwise, or saying that none are recorded)."""
    if not isinstance(expected, dict) or not expected:
        return f"{RECORD} {NO_DIGEST} (its {BUNDLE_FIELD!r}: {{file: sha256}})"
    found = bundle_digests(folder)
    for name in sorted(set(expected) | set(found)):
        if name not in found:
            return f"{name} is missing (recorded at training)"
        if name not in expected:
            return f"{name} was not there at training"
        if found[name] != expected[name]:
            return f"{name} differs from the file trained (sha256 {found[name][:12]}, recorded {str(expected[name])[:12]})"
    return None


def evaluation_digest(result: dict[str, Any]) -> str:
    """The sha256 of an evaluation's canonical JSON without its digest field."""
    body = {k: v for k, v in result.items() if k != EVALUATION_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


def evaluation_mismatch(result: dict[str, Any]) -> str | None:
    """Why a stored evaluation's content is not what was written (None: it is)."""
    recorded = result.get(EVALUATION_FIELD)
    if not isinstance(recorded, str):
        return f"it {NO_DIGEST} (its {EVALUATION_FIELD!r})"
    if recorded != evaluation_digest(result):
        return "its content (metrics, n or per-document scores) differs from what was written (digest mismatch)"
    return None


def refuse_if_strict(path: Path, why: str, strict: bool) -> None:
    """Under --strict-cache, a damaged step stops the run (naming it) instead of being recomputed."""
    if strict:
        raise CacheIntegrityError(f"{path} is damaged ({why}); --strict-cache stops here: delete it to recompute it, "
                                  "or run without --strict-cache to recompute it with a warning")
