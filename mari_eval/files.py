"""Writing files so that a killed writer, or two writers at once, never leave a damaged one.

Everything this project stores for later (bundles, training checkpoints, repro results,
evaluation caches) is written here: into a uniquely named temporary file in the same
directory, flushed to disk, then renamed over the target. A rename within one file system
is atomic, so a reader sees the old file or the new one, never half of either; when two
processes write the same path, the last rename wins and the file is whole.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | Path, obj: Any, **dumps_kwargs: Any) -> Path:
    return atomic_write(path, json.dumps(obj, **{"indent": 2, **dumps_kwargs}) + "\n")
