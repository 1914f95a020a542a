"""A refused command leaves the run folder as it found it, Hydra's own writes included.

Hydra writes `.hydra/` and opens the log file before the run's own checks can refuse it (a damaged
`ckpt_path`, data that cannot be read, a folder another run holds). `FolderSnapshot`, a Hydra
callback (conf/config.yaml), notes what the folder held just before Hydra wrote; `undo_refused`
puts it back when the run is refused: a folder that did not exist is removed, and in one that did,
`.hydra/` gets its previous files back and the log file its previous length.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from attnres.atomic import atomic_write
from attnres.config.errors import ConfigError

#: what a run folder holds before the run has produced anything (Hydra writes the first two)
UNTOUCHED = {".hydra", "attnres.log", ".run.lock"}


@dataclass
class Snapshot:
    """The folder as it was: its entries (with their sizes and times), `.hydra/`'s bytes, the log's length."""

    existed: bool
    entries: dict[str, tuple[int, int]] = field(default_factory=dict)
    record: dict[str, bytes] = field(default_factory=dict)
    record_dir: str | None = ".hydra"
    log_name: str = "attnres.log"
    log_size: int | None = None


_SNAPSHOTS: dict[Path, Snapshot] = {}


def _entries(run_dir: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for folder in (run_dir, run_dir / "checkpoints"):
        if folder.is_dir():
            for path in folder.iterdir():
                if path.name in UNTOUCHED:
                    continue
                with contextlib.suppress(OSError):
                    stat = path.stat()
                    found[str(path.relative_to(run_dir))] = (stat.st_size, stat.st_mtime_ns)
    return found


def take_snapshot(run_dir: Path, record_dir: str | None = ".hydra", log_name: str = "attnres.log") -> Snapshot:
    """Note what `run_dir` holds now (before Hydra writes into it)."""
    run_dir = run_dir.absolute()
    snap = Snapshot(existed=run_dir.is_dir(), record_dir=record_dir, log_name=log_name)
    if snap.existed:
        snap.entries = _entries(run_dir)
        if record_dir and (run_dir / record_dir).is_dir():
            for path in (run_dir / record_dir).iterdir():
                with contextlib.suppress(OSError):
                    if path.is_file():
                        snap.record[path.name] = path.read_bytes()
        with contextlib.suppress(OSError):
            snap.log_size = (run_dir / log_name).stat().st_size
    _SNAPSHOTS[run_dir] = snap
    return snap


class FolderSnapshot(Callback):
    """Hydra callback: the snapshot of a single run's folder, taken before Hydra writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
            record_dir = OmegaConf.select(config, "hydra.output_subdir")
            log_name = f"{OmegaConf.select(config, 'hydra.job.name') or 'attnres'}.log"
        except Exception:  # noqa: BLE001  (a folder the checks could not name is theirs to refuse)
            return
        take_snapshot(run_dir, None if record_dir is None else str(record_dir), log_name)


def undo_refused(run_dir: Path) -> str:
    """Put `run_dir` back as its snapshot found it, if the run has written nothing of its own
    since; returns what was done ("removed", "restored" or "" when nothing could be)."""
    run_dir = run_dir.absolute()
    snap = _SNAPSHOTS.get(run_dir)
    if snap is None or not snap.existed:
        return "removed" if remove_if_untouched(run_dir) else ""
    if _entries(run_dir) != snap.entries:
        return ""  # the run got as far as writing (or removing) something: the record stays with it
    from attnres.training.faults import RunLock

    try:
        with RunLock(run_dir):  # the log is rewound only when no other run is writing it
            _rewind_log(run_dir / snap.log_name, snap.log_size)
    except ConfigError:
        pass
    if snap.record_dir:
        record = run_dir / snap.record_dir
        if not snap.record:
            shutil.rmtree(record, ignore_errors=True)
        else:
            for path in record.glob("*"):
                if path.is_file() and path.name not in snap.record:
                    path.unlink()
            for name, data in snap.record.items():
                atomic_write(record / name, lambda f, data=data: f.write(data))
    return "restored"


def _rewind_log(log: Path, size: int | None) -> None:
    for handler in logging.getLogger().handlers:  # flushed first: nothing written after the rewind
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log.absolute():
            handler.flush()
    with contextlib.suppress(OSError):
        if size is None:
            log.unlink()
        else:
            os.truncate(log, size)


def remove_if_untouched(run_dir: Path) -> bool:
    """Remove a run folder that holds nothing but Hydra's files (a run refused before it started),
    and the parent folders that become empty, up to the current folder. Never a folder that holds
    anything else, or one another process is running in."""
    from attnres.training.faults import RunLock

    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - UNTOUCHED:
        return False
    try:
        with RunLock(run_dir):
            shutil.rmtree(run_dir)
    except (ConfigError, OSError):
        return False
    cwd, parent = Path.cwd().resolve(), run_dir.resolve().parent
    while parent != cwd and cwd in parent.parents:
        try:
            parent.rmdir()  # only when empty
        except OSError:
            break
        parent = parent.parent
    return True
