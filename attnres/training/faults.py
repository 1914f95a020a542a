"""What a run does when something goes wrong: signals, non-finite losses, a second process in
the same folder, leftovers of a killed write, and how each ends (DESIGN.md section 8).

- `RunLock`: one process per run folder (an exclusive `flock`; the kernel frees it when the
  holder dies, so a killed run never blocks the next one).
- `clean_stale_tmp`: temporary files an atomic write left when its process was killed.
- `clear_previous_run`: what `overwrite=true` removes before the new run writes anything.
- `GracefulStop`: SIGTERM / SIGINT finish the current step, write `last.ckpt`, and end the run
  as `interrupted` (exit status 143 / 130); a second signal ends the process at once.
- `NonFiniteLoss` / `RunEnded`: a run that stopped on purpose, with its exit status and the
  one line the user sees.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from attnres.config.errors import ConfigError

log = logging.getLogger("attnres")

#: what `overwrite=true` removes from a run folder (Hydra writes `.hydra/` and the log first),
#: besides TensorBoard's event files (`tb/` is where runs before them kept theirs)
PREVIOUS_RUN_FILES = ("checkpoints", "tb", "metrics.json", "plots", "slot.json", "metrics.csv", "hparams.yaml", "wandb")
#: exit status of a run stopped by a signal: the shell's convention, 128 + signal number
SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


class RunEnded(Exception):  # noqa: N818  (not an error: the run ended the way the user or the run asked)
    """The run stopped before its end and said why in metrics.json; `exit_code` for the shell."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RunRefused(ConfigError):  # noqa: N818  (a refusal, reported like a ConfigError)
    """The run folder holds another run, or another process: nothing in it may be touched."""


def secondary_rank() -> bool:
    """True in the processes a distributed launcher started for ranks other than 0: they run the
    same command, but the folder (its lock, leftovers, overwrite) is rank 0's to handle."""
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_PROCID"))


class NonFiniteLoss(Exception):  # noqa: N818  (raised to stop training, caught by the runner)
    """The training loss (or the gradient norm) was not finite at `step` (1-based)."""

    def __init__(self, step: int, what: str = "loss", detail: str = "") -> None:
        super().__init__(f"non-finite {what} at step {step}" + (f" ({detail})" if detail else ""))
        self.step, self.what = step, what


def at_last_step(trainer: pl.Trainer) -> bool:
    """Training has reached `max_steps` (never, for `max_steps=-1`: a run bounded otherwise)."""
    return bool(trainer.max_steps and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps)


# -- one process per run folder ---------------------------------------------------------------
class RunLock:
    """An exclusive lock on `<run_dir>/.run.lock` for the life of a run; refuses a second run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".run.lock"
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        if secondary_rank():
            return self  # rank 0 of this run holds the lock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunRefused(
                f"another attnres-run (pid {holder}) is running in {self.path.parent}; wait for it to end, "
                "or pass name=<new name> for a new folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock; the file stays (removing it would race a waiter)
            self.fd = None


def clean_stale_tmp(run_dir: Path) -> list[Path]:
    """Remove the temporary files of atomic writes (`.NAME.*.tmp`) that a killed process left in
    the run folder and its checkpoints. Call it holding the run's `RunLock`: no live writer then."""
    removed = []
    if secondary_rank():
        return removed
    for folder in (run_dir, run_dir / "checkpoints"):
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    removed.append(tmp)
    if removed:
        log.info(f"removed {len(removed)} temporary file(s) left by an interrupted write in {run_dir}")
    return removed


def clear_previous_run(run_dir: Path) -> list[str]:
    """`overwrite=true`: remove the previous run's checkpoints, events and metrics, so that nothing
    of it can be resumed or mistaken for the new run's. Each entry is first renamed aside (one
    atomic step), so a crash midway never leaves a half-deleted `checkpoints/` under its name."""
    removed = []
    if secondary_rank():
        return removed  # rank 0 did it
    events = sorted(p.name for p in run_dir.glob("events.out.tfevents.*"))  # TensorBoard writes them here
    for name in (*PREVIOUS_RUN_FILES, *events):
        path = run_dir / name
        if not path.exists():
            continue
        aside = run_dir / f".overwritten-{name}-{os.getpid()}-{time.time_ns()}"
        os.replace(path, aside)
        if aside.is_dir():
            shutil.rmtree(aside)
        else:
            aside.unlink()
        removed.append(name)
    for leftover in run_dir.glob(".overwritten-*"):  # from an overwrite that was itself killed
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    if removed:
        log.info(f"overwrite=true: removed the previous run's {', '.join(removed)} from {run_dir}")
    return removed


# -- signals ------------------------------------------------------------------------------------
class Interrupted(Exception):  # noqa: N818  (raised out of `fit` on purpose)
    """Training stopped on a signal after step `step`, whose checkpoint is written."""

    def __init__(self, sig: signal.Signals, step: int) -> None:
        super().__init__(f"interrupted by {sig.name} at step {step}")
        self.signal, self.step = sig, step


class GracefulStop(pl.Callback):
    """SIGTERM and SIGINT stop training at the end of the current step: `last.ckpt` of that step
    is written there and then, and `Interrupted` leaves `fit` (no validation first: a scheduler's
    grace period is short). A signal during a validation stops at the end of the next step.
    A second signal ends the process at once, with its closing line and metrics.json (the last
    checkpoint on disk stays whole: writes are atomic; `describe` words it). Lightning installs its
    own SIGTERM handler when fit starts (its loops would then exit with status 0): this one is
    installed again at `on_train_start`, after Lightning's, and replaces it.
    """

    signals = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, checkpoint: str | Path | None = None, describe: Callable[[Path], str] = str) -> None:
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.describe = describe  # checkpoint -> "PATH (step N)" (checkpoints.describe_checkpoint)
        self.received: signal.Signals | None = None
        self.trainer: pl.Trainer | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # the second one: stop now
            self._stop_now(signal.Signals(signum))
            return
        self.received = signal.Signals(signum)
        log.warning(f"received {self.received.name}: stopping after this step and saving a checkpoint "
                    f"(send it again to stop at once)")

    def _stop_now(self, sig: signal.Signals) -> None:
        """The second signal: no step finishes, but the run still says how it ended (metrics.json
        and one line), naming the last checkpoint on disk (whole: writes are atomic)."""
        import sys

        from attnres.atomic import read_json, write_json

        step = self.trainer.global_step if self.trainer is not None else None
        kept = self.describe(self.checkpoint) if self.checkpoint is not None else "no checkpoint"
        text = (f"stopped at once by a second {sig.name}" + (f" at step {step}" if step is not None else "") +
                f"; kept: {kept}; continue with the same command and resume=true")
        with contextlib.suppress(Exception):
            if self.checkpoint is not None and not secondary_rank():
                metrics = self.checkpoint.parent.parent / "metrics.json"
                write_json(metrics, {**read_json(metrics), "status": "interrupted", "error": text, "step": step})
            print(f"attnres-run: {text}", file=sys.stderr, flush=True)
        os._exit(SIGNAL_EXIT.get(sig, 128 + int(sig)))

    def install(self) -> None:
        for sig in self.signals:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # under DDP a scheduler may signal one rank only: all ranks stop at the same step
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        self.received = self.received or signal.SIGTERM
        if at_last_step(trainer):
            return  # the last step: the run ends normally anyway
        if self.checkpoint is not None and not trainer.fast_dev_run:
            trainer.save_checkpoint(self.checkpoint, weights_only=False)
        raise Interrupted(self.received, trainer.global_step)

    @property
    def exit_code(self) -> int:
        return SIGNAL_EXIT.get(self.received, 128 + int(self.received)) if self.received else 0


@contextlib.contextmanager
def stop_signals(stop: GracefulStop) -> Iterator[GracefulStop]:
    """Catch SIGTERM/SIGINT for the whole run (setup and the final validation included)."""
    stop.install()
    try:
        yield stop
    finally:
        stop.uninstall()


# -- checkpoints between validations -------------------------------------------------------------
class PeriodicCheckpoint(pl.Callback):
    """Write `last.ckpt` every `every_n_steps` optimiser steps and/or every `every_n_minutes` of
    training, besides the one written at every validation, so a kill or a preemption loses
    little when validations are far apart or steps are long."""

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = None,
                 every_n_minutes: float | None = None) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("every_n_minutes", every_n_minutes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"callbacks.periodic_checkpoint.{name}={value!r} must be a positive number "
                                  "or null (off)")
        self.path = Path(dirpath) / "last.ckpt"
        self.every_n_steps, self.every_s = every_n_steps, every_n_minutes * 60 if every_n_minutes else None
        self._last_save = time.monotonic()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_save = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        due = bool(self.every_n_steps and step % self.every_n_steps == 0)
        due = due or bool(self.every_s and time.monotonic() - self._last_save >= self.every_s)
        if due and not trainer.sanity_checking and not trainer.fast_dev_run and not at_last_step(trainer):
            trainer.save_checkpoint(self.path, weights_only=False)
            self._last_save = time.monotonic()
