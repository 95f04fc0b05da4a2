"""Writing files so that a killed writer, or two writers at once, never leave a damaged one.

Everything this project stores for later (bundles, training checkpoints, repro results,
evaluation caches) is written here: into a uniquely named temporary file in the same
directory, flushed to disk, then renamed over the target. A rename within one file system
is atomic, so a reader sees the old file or the new one, never half of either; when two
processes write the same path, the last rename wins and the file is whole. A directory
whose files belong together (a bundle) is written the same way as a whole
(``replace_directory``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from mari_eval.storage.outputs import SpecialFileError, check_size, output_error, refuse_special, special_kind

log = logging.getLogger(__name__)


def check_writable_file(path: Path, option: str, example_name: str) -> None:
    """Refuse (ValueError), before the work it will hold, an output file that could not be written
    at the end: a directory, or a place this process cannot create files in. ``option`` is how the
    user gave it (``--out``, ``diagnostics=``), ``example_name`` a file name to suggest inside a directory."""
    if path.is_dir():
        raise ValueError(f"{option}{path} is a directory: give a file name, e.g. {option}{path / example_name}")
    try:
        refuse_special(path, option)  # /dev/null, a FIFO, a link: never replaced at the end
    except SpecialFileError as e:
        raise ValueError(str(e)) from None
    _check_creatable(path.parent, f"{option}{path}")


def check_writable_dir(path: Path, option: str) -> None:
    """Refuse (ValueError), before the work it will hold, an output directory that cannot be created
    or written in (``push --to-dir``). An existing file there is refused too."""
    if path.exists() and not path.is_dir():
        what = special_kind(path, links=False) or "a file"
        raise ValueError(f"{option}{path} is {what}, not a directory: give a new directory")
    _check_creatable(path, f"{option}{path}")


def check_replaceable_place(path: Path, option: str) -> None:
    """Refuse (ValueError), before the work, an output directory that ``replace_directory`` could not put
    in place at the end: its parent (the link's target's, for a link) must take new entries."""
    target = path.resolve() if path.is_symlink() else path
    _check_creatable(target.parent, f"{option}{path}")


_CHECK_ATTEMPTS = 5  # a folder made and removed by another process's check meanwhile is checked again


def _check_creatable(folder: Path, named: str) -> None:
    """Create a file in ``folder`` (and the folders missing above it), then remove what was created."""
    for attempt in range(_CHECK_ATTEMPTS):
        first_missing = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".check-", suffix=".tmp"):
                return
        except OSError as e:
            # Another process's check (a second torchrun rank, a parallel run) may have removed the folder it
            # made between our mkdir and our file: check again, and refuse only a folder that stays missing.
            if not isinstance(e, FileNotFoundError) or attempt + 1 == _CHECK_ATTEMPTS:
                raise ValueError(f"{named} cannot be written ({e.strerror or e}): choose a writable path") from None
        finally:
            if first_missing is not None:
                _remove_empty(folder, first_missing)


def _remove_empty(folder: Path, top: Path) -> None:
    """Remove ``folder`` and its parents up to ``top``, while empty: the folders a check made. One that
    another process has put something in meanwhile (parallel runs sharing --runs) is left as it is."""
    for path in (folder, *folder.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == top:
            return


@contextlib.contextmanager
def writing_alone(target: Path, option: str) -> Iterator[None]:
    """Hold, for the block, a lock on output ``target`` (``flock`` on a file named by a hash of its
    absolute path under the temporary directory's ``mari-eval-locks/``, so nothing is left beside
    the output, even by a killed process): a second process writing the same target meanwhile is
    refused (FileExistsError naming the first's pid), where both would report success and one
    would overwrite the other. The kernel releases the lock when its holder exits, however it does."""
    where = str(Path(target).expanduser().resolve())
    lock = Path(tempfile.gettempdir()) / "mari-eval-locks" / (hashlib.sha256(where.encode()).hexdigest()[:32] + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise FileExistsError(f"{option}{target} is being written by another process (pid {holder}, lock {lock}): "
                                  "wait for it to finish, or give another path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` whole or not at all: a temporary file beside it, flushed to disk,
    checked to hold every byte, then renamed into place. The file gets an ordinary file's permissions
    (0666 less the umask), not the temporary file's private 0600. A failure names ``path``, never the
    temporary file (``outputs.output_error``); a device node, FIFO, socket or link at ``path`` is refused."""
    blob = data.encode() if isinstance(data, str) else data

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(blob)

    return atomic_write_with(path, fill, len(blob))


def atomic_write_with(path: str | Path, fill: Callable[[Path], None], size: int | None = None) -> Path:
    """``atomic_write`` for a writer that takes a file name (gguf's ``GGUFWriter``): ``fill(tmp)`` writes
    the hidden temporary file beside ``path``, which must then hold ``size`` bytes (None: any but none)."""
    path = Path(path)
    refuse_special(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise output_error(e, path) from None
    tmp = Path(name)
    try:
        os.close(fd)
        fill(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a full disk may answer only here
            check_size(fd, size, path)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())
        refuse_special(path)  # again: made meanwhile?
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, SpecialFileError):
            raise output_error(e, path) from None
        raise
    return path


def _umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write_json(path: str | Path, obj: Any, **dumps_kwargs: Any) -> Path:
    return atomic_write(path, json.dumps(obj, **{"indent": 2, **dumps_kwargs}) + "\n")


# ----------------------------------------------------------------------------- results: strict JSON
#
# Python's json writes a NaN or an infinity as the bare words NaN / Infinity, which are not
# JSON: jq, JavaScript's JSON.parse and most other readers refuse such a file. Every results
# file (repro/'s results/*.json, `mari-eval judge --out`) is written by ``write_results_json``:
# a missing or undefined number (NaN, +-inf) becomes null, and anything else that is not JSON
# raises instead of being written.


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf, numpy's float64 included) replaced by
    None, through dicts, lists and tuples (tuples become lists, as json writes them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def strict_json_dumps(obj: Any, **dumps_kwargs: Any) -> str:
    """Strict JSON text of ``obj``: non-finite numbers as null (``finite_json``), and
    ``allow_nan=False``, so that a NaN that got past it raises rather than being written."""
    return json.dumps(finite_json(obj), **{"indent": 2, **dumps_kwargs, "allow_nan": False})


def write_results_json(path: str | Path, obj: Any, **dumps_kwargs: Any) -> Path:
    """``atomic_write_json`` for results files: strict JSON (``strict_json_dumps``)."""
    return atomic_write(path, strict_json_dumps(obj, **dumps_kwargs) + "\n")


# ----------------------------------------------------------------------------- whole directories
#
# A bundle is two files that only make sense together (weights.safetensors and the
# bundle.json that says which layer and shapes they are for). Writing them one by one in
# place, a failure between the two leaves new weights beside an old bundle.json, which
# loads and runs at the wrong site. ``replace_directory`` writes the whole directory into a
# temporary sibling and then puts it in place of the old one: on Linux by one atomic
# exchange of the two names (renameat2 RENAME_EXCHANGE); elsewhere by renaming the old one
# aside and the new one in, a window of two renames that ``recover_directory`` closes after
# a crash by putting the old one back. The temporary siblings are hidden (".NAME.saving-*",
# ".NAME.old-*") and carry their writer's host and pid, so that only a writer that is gone
# has its leftovers removed.

_SAVING, _OLD = ".saving-", ".old-"
_OWNER = re.compile(r"(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]{1,10})-[A-Za-z0-9_]+")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "unknown_host"


def _owner_gone(suffix: str) -> bool:
    """Whether a leftover whose name ends in ``suffix`` ("HOST-PID-RANDOM") was written by a
    process of this host that no longer exists. Another host's, a live one's, or an unreadable
    name: False (left alone)."""
    match = _OWNER.fullmatch(suffix)
    if match is None or match["host"] != _host():
        return False
    pid = int(match["pid"])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):  # another user's live process, or no such pid number
        return False
    return False


def recover_directory(target: str | Path) -> None:
    """Clean up after a writer of ``target`` that died inside ``replace_directory``: its
    unfinished copy is removed and, if it died between its two renames (``target`` missing),
    the previous directory it had moved aside is renamed back."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    for path in sorted(target.parent.iterdir()):
        name = path.name
        kind = next((k for k in (_SAVING, _OLD) if name.startswith(f".{target.name}{k}")), None)
        if kind is None or not _owner_gone(name[len(target.name) + 1 + len(kind):]):
            continue
        if kind == _OLD and not os.path.lexists(target):
            try:
                os.rename(path, target)
                log.warning("%s: an interrupted save had moved it aside to %s; put back", target, name)
                continue
            except OSError:
                pass
        shutil.rmtree(path, ignore_errors=True)


def replace_directory(target: str | Path, fill: Callable[[Path], None],
                      replaceable: Callable[[str], bool] | None = None) -> Path:
    """Write the directory ``target`` whole: ``fill(tmp)`` writes its files into a temporary
    sibling, which then takes ``target``'s place (the old directory is deleted). A failure or a
    crash at any point leaves the old directory or the new one at ``target``, never a mix.

    An existing ``target`` is replaced only when ``replaceable(name)`` holds for every file in
    it (default: any), so that a directory holding other things is never deleted with it. A failed
    write names ``target`` as given (``outputs.output_error``), never the temporary sibling."""
    given = target = Path(target)
    if target.is_symlink():
        target = target.resolve()  # replace what the link points to, keep the link
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise output_error(e, given) from None
    recover_directory(target)
    check_replaceable(target, replaceable)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{_SAVING}{_host()}-{os.getpid()}-", dir=target.parent))
    except OSError as e:
        raise output_error(e, given) from None
    try:
        fill(tmp)
        _fsync_directory(tmp)
        _put_in_place(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, SpecialFileError):
            raise output_error(e, given) from None
        raise
    _fsync_directory(target.parent)
    return target


def check_replaceable(target: str | Path, replaceable: Callable[[str], bool] | None = None) -> None:
    """Refuse (``FileExistsError``) a ``target`` that ``replace_directory`` would not replace: a file (or a
    device node, FIFO, socket), a directory holding anything but regular files (a link, a folder: not
    what this tool writes), or a file for which ``replaceable(name)`` is false. Nothing there is fine."""
    target = Path(target)
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        what = special_kind(target, links=False) or "a file"
        raise SpecialFileError(f"{target} exists and is {what}, not a directory; remove it or write elsewhere")
    odd = [f"{p.name} ({special_kind(p) or 'a folder'})" for p in sorted(target.iterdir())
           if p.is_symlink() or not p.is_file()]
    if odd:
        raise SpecialFileError(f"{target} holds {', '.join(odd[:5])}{', ...' if len(odd) > 5 else ''}, not files this "
                               "tool wrote, which replacing the directory would delete: move them away or write to "
                               "another directory")
    if replaceable is not None:
        others = sorted(p.name for p in target.iterdir() if not replaceable(p.name))
        if others:
            raise FileExistsError(
                f"{target} already holds files that would be deleted with it ({', '.join(others[:5])}"
                f"{', ...' if len(others) > 5 else ''}); move them away or write to another directory")


def _put_in_place(tmp: Path, target: Path) -> None:
    for _ in range(10):  # another writer of the same target may move it meanwhile: the last one wins
        try:
            os.rename(tmp, target)  # no target (or an empty one): one atomic rename
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if _exchange(tmp, target):  # tmp now holds the old directory
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = target.with_name(f".{target.name}{_OLD}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(target, old)
        except FileNotFoundError:
            continue
        try:
            os.rename(tmp, target)
        except BaseException as e:  # another writer's is there now, or an interruption: the old one goes back
            try:
                os.rename(old, target)
            except OSError:
                shutil.rmtree(old, ignore_errors=True)
            if not isinstance(e, OSError):
                raise
            continue
        shutil.rmtree(old, ignore_errors=True)
        return
    raise OSError(f"could not put {tmp} in place of {target}: other writers keep replacing it")


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux renameat2); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes  # optional: Linux's libc, where there is one

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (data files, imported vectors and adapters)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
