"""Atomic writes: a file is either its previous version or the complete new one, never half.

Every file a run leaves (checkpoints, metrics.json, summaries) is written to a temporary
file in the same folder, flushed to disk, and renamed over the target.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object written by `write_json`, or {} when the file is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(data, indent=2, sort_keys=True) + "\n").encode()))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that never leaves a truncated checkpoint behind."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        atomic_write(path, lambda f: torch.save(checkpoint, f))
