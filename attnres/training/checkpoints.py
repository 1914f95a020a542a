"""Checkpoints: written atomically, chosen for a resume (never clobbering a run), checked before use."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO

from attnres.atomic import atomic_write, read_json, write_json
from attnres.config.errors import ConfigError
from attnres.training.faults import RunRefused

log = logging.getLogger("attnres")


def started_before(run_dir: Path) -> bool:
    """Whether an earlier start of a run left a trace in `run_dir`: checkpoints/, an event file, or
    a log (Hydra's, or a sweep job's train.log) holding an earlier start's "run folder:" line (this
    start writes its own after `resume_checkpoint`)."""
    if (run_dir / "checkpoints").is_dir() or any(run_dir.glob("events.out.tfevents.*")):
        return True
    for log_file in run_dir.glob("*.log"):
        with contextlib.suppress(OSError):
            if "] - run folder: " in log_file.read_text(errors="replace"):
                return True
    return False


def resume_checkpoint(run_dir: Path, resume: bool, ckpt_path: str | None, overwrite: bool) -> str | None:
    """The checkpoint to continue from, or None for a fresh run; refuses to clobber a run.

    Call it holding the run's `RunLock`. A folder "holds a run" when it has `last.ckpt` or a
    `metrics.json`. `overwrite=true` removes the previous run's checkpoints, events and
    metrics first (`faults.clear_previous_run`), so nothing of it can be resumed later.
    `resume=true` on a run that never reached its first checkpoint starts it from scratch
    and says so: a requeue loop that always passes `resume=true` can restart it.
    """
    last = run_dir / "checkpoints" / "last.ckpt"
    status = read_json(run_dir / "metrics.json").get("status")
    if resume and overwrite:
        raise ConfigError("resume=true and overwrite=true contradict each other; pass only one of them")
    if ckpt_path:
        if not Path(ckpt_path).is_file():
            raise ConfigError(f"ckpt_path={ckpt_path} is not a file; pass the path of a .ckpt written by attnres-run")
        if not overwrite and (last.is_file() or status is not None) and Path(ckpt_path).resolve() != last.resolve():
            raise RunRefused(
                f"{run_dir} already holds a run; ckpt_path={ckpt_path} would train over it: pass overwrite=true to "
                "replace it, or name=<new name> for a new folder"
            )
        if overwrite and Path(ckpt_path).resolve().is_relative_to((run_dir / "checkpoints").resolve()):
            raise ConfigError(f"ckpt_path={ckpt_path} lies in the checkpoints that overwrite=true would remove from "
                              f"{run_dir}; copy it out of the folder first, or drop overwrite=true")
        return str(ckpt_path)
    if resume:
        if last.is_file():
            return str(last)
        if status == "finished":
            raise ConfigError(
                f"resume=true but the finished run in {run_dir} has no checkpoints/last.ckpt to continue from; "
                "pass overwrite=true to train it again, or name=<new name> for a new folder"
            )
        if started_before(run_dir):
            log.warning(f"resume=true: {run_dir} has no checkpoint yet (stopped before its first one); "
                        "starting this run from scratch")
        else:  # a new job of a sweep run with resume=true: nothing to say but that it starts
            log.info(f"resume=true: no earlier run in {run_dir}; starting it")
        return None
    if overwrite:
        return None  # `train` clears the previous run once every check has passed
    if last.is_file() or status is not None:
        held = last if last.is_file() else run_dir / "metrics.json"
        raise RunRefused(
            f"{run_dir} already holds a run ({held}); pass resume=true to continue it, "
            "overwrite=true to start it again, or name=<new name> for a new folder"
        )
    return None


def load_checkpoint(path: str | Path) -> Any:
    """The checkpoint at `path`, or one line (ConfigError) when it is truncated, empty, damaged (its
    SHA-256 record disagrees) or not a checkpoint."""
    verify_checkpoint(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # any failure to unpickle means the same thing to the user
        raise ConfigError(f"checkpoint {path} is corrupt or not a checkpoint ({type(err).__name__}: {err})") from err


def check_checkpoint(path: str, module: pl.LightningModule) -> dict[str, Any]:
    """Fail early, in one line, on a checkpoint that is unreadable or for another model; returns it."""
    ckpt = load_checkpoint(path)
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if state is None:
        raise ConfigError(f"checkpoint {path} has no 'state_dict'; it was not written by attnres-run")
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        which = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which this model lacks"
        raise ConfigError(
            f"checkpoint {path} does not match this model: it {which} "
            f"({len(missing)} missing, {len(unexpected)} unexpected keys); "
            "resume with the config it was trained with (.hydra/config.yaml in its run folder)"
        )
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise ConfigError(
                f"checkpoint {path} does not match this model: {key} is {tuple(state[key].shape)} there "
                f"but {tuple(value.shape)} here; resume with the config it was trained with"
            )
    return ckpt


def checkpoint_step(path: str | Path) -> int | None:
    """The optimiser step a checkpoint was written at, or None when it cannot be read."""
    try:
        step = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("global_step")
    except Exception:  # unreadable: `check_checkpoint` says so in one line
        return None
    return int(step) if isinstance(step, int) else None


def describe_checkpoint(path: Path) -> str:
    """`path (step N)` for the checkpoint a user can go back to, or a note that there is none."""
    if not path.is_file():
        return "no checkpoint yet"
    step = checkpoint_step(path)
    return f"{path} (step {step})" if step is not None else str(path)


#: beside each checkpoint `x.ckpt`, `x.ckpt.sha256` holds the SHA-256 of its bytes (JSON: a list,
#: the newest first; while a new version replaces the old one it lists both, so a kill at any
#: moment leaves a record that matches the file in place)
DIGEST_SUFFIX = ".sha256"
CHUNK = 1 << 22


def digest_path(path: str | Path) -> Path:
    return Path(f"{path}{DIGEST_SUFFIX}")


def file_digest(path: str | Path) -> str:
    with open(path, "rb") as f:
        return _digest_of(f)


def _digest_of(f: Any) -> str:
    """SHA-256 of everything in the open file `f`, read back by position (its own offset untouched)."""
    digest, offset, fd = hashlib.sha256(), 0, f.fileno()
    while block := os.pread(fd, CHUNK, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def verify_checkpoint(path: str | Path) -> None:
    """Raise ConfigError, naming the file, when a checkpoint's bytes are not the ones written (its
    `.sha256` record disagrees); a checkpoint without a record (written elsewhere, or before
    attnres kept one) passes."""
    record = read_json(digest_path(path)) if digest_path(path).is_file() else None
    if not record:
        return
    if file_digest(path) not in record.get("sha256", []):
        raise ConfigError(f"checkpoint {path} is damaged: its bytes differ from the SHA-256 written with it "
                          f"({digest_path(path).name}); use another checkpoint (best.ckpt, or ckpt_path=...), or "
                          "start again with overwrite=true")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that never leaves a truncated checkpoint behind, and writes the
    SHA-256 of each checkpoint beside it (`verify_checkpoint` holds a loaded one against it)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        record = digest_path(path)
        previous = read_json(record).get("sha256", [])[:1] if record.is_file() else []
        written: list[str] = []

        def write(f: Any) -> None:
            try:
                torch.save(checkpoint, f)
            except RuntimeError as err:  # torch words a failed write of the file under it (a full disk)
                if isinstance(err.__context__, OSError):  # as a RuntimeError: the OSError says what happened
                    raise err.__context__ from err
                raise
            f.flush()
            written.append(_digest_of(f))
            write_json(record, {"sha256": [*written, *previous]})  # before the new file takes its place

        atomic_write(path, write)
        write_json(record, {"sha256": written})

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        digest_path(path).unlink(missing_ok=True)
