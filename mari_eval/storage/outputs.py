"""What an output place may be, how a failed write is reported, and where work is kept when it cannot be saved.

Every file this project writes goes through ``mari_eval.storage.files``, which applies these rules:

* only a regular file, or a directory the tool made, is ever replaced. A device node (``/dev/null``,
  a disk), a FIFO, a socket or a symbolic link at an output path is refused: renaming a new file
  over it would destroy the node (run as root, ``/dev/null`` itself) or silently cut the link;
* a write that fails names the path the user gave, never the hidden temporary file it went to
  first, with the system's reason and what to do about it (a full disk: free space; a read-only
  place: choose a writable path);
* work that took long and could not be saved where asked (a trained bundle, lm-eval's results)
  is written to ``unsaved_place`` instead, and the error says where, rather than being lost.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
from pathlib import Path

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


class SpecialFileError(FileExistsError):
    """An output path that holds something other than a regular file or a directory."""


class OutputError(OSError):
    """A write that failed, named by the path the user gave. ``reason``: the system's word for it."""

    reason: str = ""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]"
        return str(self.args[1] if len(self.args) > 1 else self.args[0])


def special_kind(path: str | Path, links: bool = True) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a directory ("a character
    device", ...); None otherwise. ``links=False`` follows a symbolic link and judges what it points to."""
    try:
        mode = os.lstat(path).st_mode if links else os.stat(path).st_mode
    except OSError:  # nothing there (or a dangling link followed): nothing to replace
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def refuse_special(path: str | Path, option: str = "") -> None:
    """Refuse (``SpecialFileError``) an output file path that holds a device node, a FIFO, a socket or a
    symbolic link: writing the output there would replace it with a regular file."""
    kind = special_kind(path)
    if kind is None:
        return
    if kind == "a symbolic link":
        raise SpecialFileError(f"{option}{path} is a symbolic link (to {os.readlink(path)}): writing there would "
                               f"replace the link with a file. Give the path it points to ({Path(path).resolve()}), "
                               "or remove the link first")
    raise SpecialFileError(f"{option}{path} is {kind}, not a regular file: writing there would replace it with a "
                           "file, which mari-eval never does (--force included). Give the path of a regular file")


def output_error(e: OSError, path: str | Path) -> OutputError:
    """``e``, a failed write of the output ``path`` (as the user gave it), as an ``OutputError`` naming that
    path, the reason and the fix. An ``OutputError`` already made for an inner file keeps its reason."""
    reason = e.reason if isinstance(e, OutputError) else (e.strerror or str(e))
    if e.errno in _FULL:
        fix = "free some space there (or raise your quota), or write elsewhere"
    elif e.errno in _DENIED:
        fix = "that place is not writable for this user (permissions, or a read-only file system): choose a writable path"
    else:
        fix = "choose another path"
    named = OutputError(e.errno or errno.EIO, f"cannot write {path}: {reason}; {fix}")
    named.reason = reason
    return named


def check_size(fd: int, expected: int | None, path: str | Path) -> None:
    """Refuse a file (open as ``fd``, written for ``path``) that holds fewer or more bytes than ``expected``,
    or, when ``expected`` is None, none at all: a write that reported success but did not reach the disk whole."""
    written = os.fstat(fd).st_size
    if (expected is None and written == 0) or (expected is not None and written != expected):
        what = "empty (0 bytes)" if written == 0 else f"{written} bytes of {expected}"
        raise output_error(OSError(errno.EIO, f"the file written was {what}"), path)


def unsaved_place(name: str) -> Path:
    """A new folder under the temporary directory for work that could not be saved where asked:
    ``<tmp>/mari-eval-unsaved/<name>-<time>-<pid>`` (usually another file system than a full output disk)."""
    return Path(tempfile.gettempdir()) / "mari-eval-unsaved" / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
