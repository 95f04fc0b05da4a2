"""The verdict cache: one JSON line per judgement, so that a rerun never asks twice.

Each judgement is keyed by sha256 of (judge model, prompt text, instruction, response)
and appended to ``$MARI_JUDGE_CACHE`` (default: ``judge/judgements.jsonl`` under
mari-eval's user cache dir). Processes sharing the file take turns under ``flock``; a
line cut short by a crash is skipped on reading and judged again. A cache path that is a
directory, or that cannot be written, is an error naming the fix.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from mari_eval.judge.config import ENV_CACHE, JudgeError
from mari_eval.storage.models import cache_root

log = logging.getLogger(__name__)


def cache_key(model: str, prompt_text: str, instruction: str, response: str) -> str:
    payload = json.dumps([model, prompt_text, instruction, response], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def default_cache_path() -> Path:
    """``$MARI_JUDGE_CACHE``, else ``judge/judgements.jsonl`` under mari-eval's user cache dir."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    return cache_root() / "judge" / "judgements.jsonl"


class JudgeCache:
    """Append-only JSON-lines file of judgements, one object per line, keyed by ``key``.

    Each line is written by one ``write`` call on an O_APPEND descriptor under an exclusive
    ``flock`` (processes sharing the cache never interleave lines), then fsynced,
    so that a crash leaves at most a truncated last line; reading skips such lines
    (with a warning) and the next append starts on a fresh line.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self._lock = threading.Lock()
        self._records: dict[str, dict] | None = None

    def records(self) -> dict[str, dict]:
        with self._lock:
            if self._records is None:
                self._records = self._read()
            return self._records

    def get(self, key: str) -> dict | None:
        return self.records().get(key)

    def __len__(self) -> int:
        return len(self.records())

    def check(self) -> None:
        """Fail now, saying what to do, when the cache cannot be read and appended to."""
        os.close(self._open())
        self.records()

    def _open(self) -> int:
        self._refuse_directory()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            raise JudgeError(f"The judge cache {self.path} cannot be written ({e.strerror or e}): {self._fix()}") from None

    def _refuse_directory(self) -> None:
        if self.path.is_dir():
            raise JudgeError(f"The judge cache {self.path} is a directory, but it must name the cache file (JSON lines, "
                             f"created when missing): {self._fix(self.path / 'judgements.jsonl')}")

    def _fix(self, example: Path | None = None) -> str:
        example = example or default_cache_path().parent / "judgements.jsonl"
        return f"set {ENV_CACHE} to a file path in a writable directory, e.g. {ENV_CACHE}={example}"

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        records = self.records()
        with self._lock:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # other processes appending to the same cache wait their turn
                # Whether the file ends mid-line (a killed writer) is read under the lock: read before
                # it, another process's line could still be half written.
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = "\n" + line
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            except OSError as e:  # e.g. a full disk
                raise JudgeError(f"Could not append to the judge cache {self.path} ({e.strerror or e}): "
                                 f"{self._fix()}") from None
            finally:
                os.close(fd)
            records[record["key"]] = record

    def forget(self, model: str) -> int:
        """Remove every verdict of judge ``model`` (the name it was asked under) from the cache file;
        how many were removed. The file is rewritten under the same lock appends take, then
        renamed over the old one; lines cut short by a crash go with it."""
        removed = 0
        with self._lock:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                kept = []
                for line in self.path.read_bytes().decode("utf-8", errors="replace").splitlines():
                    try:
                        record = json.loads(line)
                        mine = record.get("judge_model") == model
                    except (json.JSONDecodeError, AttributeError):
                        continue
                    removed += mine
                    if not mine:
                        kept.append(line + "\n")
                tmp = self.path.with_name(f".{self.path.name}.forget-{os.getpid()}")
                tmp.write_text("".join(kept), encoding="utf-8")
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)
            except OSError as e:
                raise JudgeError(f"Could not rewrite the judge cache {self.path} ({e.strerror or e}): {self._fix()}") from None
            finally:
                os.close(fd)
            self._records = None  # read again on next use
        return removed

    def _read(self) -> dict[str, dict]:
        self._refuse_directory()
        if not self.path.exists():
            return {}
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise JudgeError(f"The judge cache {self.path} cannot be read ({e.strerror or e}): {self._fix()}") from None
        records, bad = {}, 0
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[record["key"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                bad += 1
        if bad:
            log.warning("%s: skipped %d unreadable line(s) (an interrupted write); those will be judged again", self.path, bad)
        return records
