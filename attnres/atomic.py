"""Atomic writes: a file is either its previous version or the complete new one, never half.

Every file a run leaves (checkpoints, metrics.json, summaries) is written to a temporary
file in the same folder, flushed to disk, and renamed over the target. The file gets the
permissions of any other file the user creates (the umask), not `mkstemp`'s private 0600. A
write that fails (a full disk) removes its temporary file, leaves the previous version in
place, and raises an `OSError` that names the file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


FILE_MODE = _file_mode()
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: a write refused by the disk or the folder, not by the program: reported in one line naming the file
WRITE_ERRORS = (*DISK_FULL, errno.EACCES, errno.EPERM, errno.EROFS)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        if err.errno in WRITE_ERRORS:
            raise OSError(err.errno, os.strerror(err.errno), str(path)) from err  # the file, not its temporary
        raise
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in WRITE_ERRORS and err.filename in (None, tmp):
            raise OSError(err.errno, os.strerror(err.errno), str(path)) from err  # say which file
        raise


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object written by `write_json`, or {} when the file is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None: strict JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Strict JSON (a non-finite number becomes null), written atomically."""
    text = json.dumps(finite_json(data), indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
