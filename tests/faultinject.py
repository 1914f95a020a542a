"""Faults injected into a real `attnres-run` process at chosen moments, as Lightning callbacks
named on the command line (`+callbacks.fault._target_=faultinject.KillAt ...`, with this folder
on PYTHONPATH: tests/helpers.py `faultinject_env`). Used by tests/training/test_faults.py and
test_report.py; nothing here is part of the package."""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

import pytorch_lightning as pl
import torch

import attnres.atomic as attnres_io


def _signal(name: str) -> signal.Signals:
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


class KillAt(pl.Callback):
    """Send `sig` to this process (`times` times in a row) at optimiser step `step`, at `moment`:

    - "step": right after the step's optimiser update (on_train_batch_end);
    - "validation": in the middle of the validation that follows the step;
    - "checkpoint": inside the write of the checkpoint of that step, after the temporary file
      is complete and before it is renamed over last.ckpt / best.ckpt.
    """

    def __init__(self, step: int, moment: str = "step", sig: str = "KILL", times: int = 1) -> None:
        self.step, self.moment, self.sig, self.times = step, moment, _signal(sig), times
        self.sent = False
        if moment == "checkpoint":
            real_fsync = attnres_io.os.fsync
            callback = self

            def fsync_then_kill(fd: int) -> None:
                real_fsync(fd)
                if callback.armed:
                    os.kill(os.getpid(), callback.sig)

            self.armed = False
            attnres_io.os.fsync = fsync_then_kill  # the module's `os` is the real one: patch the attribute
            self._restore = real_fsync

    def _send(self) -> None:
        if not self.sent:
            self.sent = True
            for _ in range(self.times):  # `times=2`: a second Ctrl-C before the first one's stop is done
                os.kill(os.getpid(), self.sig)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and self.moment == "step":
            self._send()
        if self.moment == "checkpoint":
            self.armed = trainer.global_step == self.step

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and self.moment == "validation" and not trainer.sanity_checking:
            self._send()


class NaNAt(pl.Callback):
    """Make training step `step` (1-based) non-finite.

    - "loss": the embedding's output is NaN for that step only (the weights stay finite);
    - "weights": one weight becomes NaN before that step (every later step is NaN too, until
      something restores the weights).
    """

    def __init__(self, step: int, what: str = "loss") -> None:
        self.step, self.what = step, what
        self.handle = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step + 1 != self.step:
            return
        embed = pl_module.model.embed
        if self.what == "weights":
            with torch.no_grad():
                embed.weight[0, 0] = float("nan")
                embed.weight[:, :] = embed.weight[0, 0]
        else:
            self.handle = embed.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class DiskFullAt(pl.Callback):
    """From optimiser step `step` on, every atomic write fails with `error` (ENOSPC, as on a full
    disk, used where no small tmpfs can be mounted; EACCES or EROFS, as in a folder made unwritable
    or a disk remounted read-only, which root cannot make of a folder in use)."""

    def __init__(self, step: int, error: str = "ENOSPC") -> None:
        self.step = step
        code = getattr(errno, error)
        real_fsync = attnres_io.os.fsync
        callback = self
        self.active = False

        def fsync_or_full(fd: int) -> None:
            if callback.active:
                raise OSError(code, os.strerror(code))
            real_fsync(fd)

        attnres_io.os.fsync = fsync_or_full

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            self.active = True


class FillDiskAtSweepEnd:
    """A Hydra callback (`+hydra.callbacks.fill._target_=faultinject.FillDiskAtSweepEnd`): when the
    sweep ends, before the summary is written (Hydra ends callbacks in reverse order), fill the disk
    that holds `path` with that file, as another program could."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_multirun_end(self, *args: Any, **kwargs: Any) -> None:
        with open(self.path, "wb") as f:
            try:
                while True:
                    f.write(bytes(1 << 20))
                    f.flush()
            except OSError:
                pass

    def __getattr__(self, name: str) -> Any:  # every other Hydra callback event: nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class FillDiskAtExit(pl.Callback):
    """`+callbacks.fill._target_=faultinject.FillDiskAtExit +callbacks.fill.path=...`: when the training
    process exits (after its metrics.json and end block), fill the disk that holds `path`, as
    another program could while the sweep around the job records how it ended."""

    def __init__(self, path: str) -> None:
        import atexit

        atexit.register(FillDiskAtSweepEnd(path).on_multirun_end)
