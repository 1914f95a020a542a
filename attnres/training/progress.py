"""The progress bar that `conf/callbacks/default.yaml` names: one line over optimiser steps."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ProgressBar

from attnres.training.faults import at_last_step

log = logging.getLogger("attnres")

MIN_COLUMNS = 40  # narrower than this (0 under `script`, some `docker run -t`, CI runners) a bar draws nothing useful
ESTIMATE_AT = 10  # the step whose rate gives the run's first estimate of its length
VALIDATION_SHARE = 1 / 3  # a validation batch costs about a third of a training step (forward only), until one is timed


def bar_can_draw(stream: Any = None) -> bool:
    """A bar needs a terminal with a width: `isatty()` alone also passes a pseudo-terminal of 0 columns."""
    stream = stream or sys.stdout
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns >= MIN_COLUMNS
    except (OSError, ValueError, AttributeError):
        return False


def duration(seconds: float) -> str:
    """`1h 05m`, `18m 40s`, `42 s`: how long, to the precision an estimate deserves."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.0f} s"


def training_rate(pl_module: Any) -> float | None:
    """Tokens per second of training steps in this process (validation and checkpoints left out): the rate
    metrics.json's `tokens_per_sec` and the end block report."""
    seconds = getattr(pl_module, "session_train_s", 0.0)
    return pl_module.session_tokens / seconds if seconds else None


class StepProgressBar(ProgressBar):
    """One line over optimiser steps (of `max_steps`) with the latest numbers; a validation
    only updates those numbers instead of drawing bars of its own.

    Where stdout is not a terminal with a width (a sweep's train.log, a batch job's log, `script`,
    a CI runner's pseudo-terminal of 0 columns) there is no bar: a plain log line after the first
    step (so a log says at once that training runs, and how fast), every `plain_every` steps and
    after each validation, so files hold no carriage returns or escape codes.

    At step ESTIMATE_AT a line says how long the run will take at the rate measured so far (its
    training steps, plus its validations: timed once one has run, a third of a step a batch
    before); the plain lines repeat the time left. The rate shown is the training rate, the one
    the end block and metrics.json report.
    """

    def __init__(self, refresh_rate: int = 10, plain_every: int = 100) -> None:
        super().__init__()
        self.refresh_rate, self.plain_every = max(1, int(refresh_rate)), max(1, int(plain_every))
        self._enabled, self.bar, self._first_said = True, None, False
        self._validation_s: float | None = None  # the last validation's wall time
        self._validation_started = 0.0
        self._start = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _numbers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, str]:
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        metrics.pop("perf/tokens_per_sec", None)  # one step's rate: a step beside a validation reads far too low
        numbers = {k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in metrics.items()}
        rate = training_rate(pl_module)
        if rate:
            numbers["tokens/s"] = f"{rate:,.0f}"
        return numbers

    def _line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        numbers = "  ".join(f"{k} {v}" for k, v in self._numbers(trainer, pl_module).items())
        left = self.seconds_left(trainer, pl_module)
        return f"step {trainer.global_step}/{trainer.max_steps}  {numbers}" + \
            (f"  about {duration(left)} left" if left and trainer.global_step >= ESTIMATE_AT else "")

    def seconds_left(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | None:
        """The time to the run's end at this session's rate: its training steps and validations left,
        bounded by `trainer.max_time`; None before a step has been timed or without `max_steps`."""
        steps = trainer.global_step - (getattr(pl_module, "session_start_step", None) or 0)
        seconds = getattr(pl_module, "session_train_s", 0.0)
        if steps <= 0 or not seconds or not trainer.max_steps or trainer.max_steps < 0:
            return None
        remaining = max(0, trainer.max_steps - trainer.global_step)
        left = remaining * seconds / steps
        interval = trainer.val_check_interval if isinstance(trainer.val_check_interval, int) else 0
        if interval > 0:
            validations = (trainer.max_steps // interval - trainer.global_step // interval
                           + (trainer.max_steps % interval != 0))  # the last step validates too
            batches = getattr(trainer.datamodule, "val_batches", None) if trainer.datamodule is not None else None
            each = self._validation_s if self._validation_s is not None else \
                (batches or 0) * VALIDATION_SHARE * seconds / steps
            left += max(0, validations) * each
        limit = time_left(trainer)
        return min(left, limit) if limit is not None else left

    def _estimate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
        left = self.seconds_left(trainer, pl_module)
        if left is None:
            return None
        rate = training_rate(pl_module)
        limit = time_left(trainer)
        bound = " (trainer.max_time ends it first)" if limit is not None and limit <= left else ""
        return (f"estimate: {trainer.max_steps} steps at {rate:,.0f} tokens/s (its first {trainer.global_step} "
                f"steps): about {duration(time.perf_counter() - self._start + left)} in all, {duration(left)} "
                f"left{bound}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_said, self._start, self._validation_s = False, time.perf_counter(), None
        if self._enabled and trainer.is_global_zero and bar_can_draw():
            from tqdm.auto import tqdm

            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            self.bar = tqdm(total=total, initial=trainer.global_step, desc="steps", dynamic_ncols=True,
                            file=sys.stdout, leave=True, smoothing=0.1, unit="step")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        step, last = trainer.global_step, at_last_step(trainer)
        started = getattr(pl_module, "session_start_step", None) or 0
        if step - started == min(ESTIMATE_AT, max(1, trainer.max_steps - started)) and not last:
            estimate = self._estimate(trainer, pl_module)
            if estimate and self.bar is not None:
                self.bar.write(estimate, file=sys.stdout)
                from attnres.training.report import file_log

                file_log().info(estimate)
            elif estimate:
                log.info(estimate)
        if self.bar is not None and (step % self.refresh_rate == 0 or last):
            self.bar.n = step
            self.bar.set_postfix(self._numbers(trainer, pl_module), refresh=False)
            self.bar.refresh()
        elif self.bar is None and (step % self.plain_every == 0 or last or not self._first_said):
            self._first_said = True
            log.info(self._line(trainer, pl_module))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_started = time.perf_counter()
        if self.bar is not None and not trainer.sanity_checking:
            self.bar.set_description("validating")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero or trainer.sanity_checking:
            return
        if trainer.state.fn == "fit":
            self._validation_s = time.perf_counter() - self._validation_started
        if self.bar is not None:
            self.bar.set_description("steps")
            self.bar.set_postfix(self._numbers(trainer, pl_module))
        elif trainer.state.fn == "fit":
            log.info(f"validation at {self._line(trainer, pl_module)}")

    def on_train_end(self, *args: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.on_train_end()




def time_left(trainer: pl.Trainer) -> float | None:
    """Seconds before `trainer.max_time` stops training; None without a time limit."""
    from pytorch_lightning.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is None or timer._duration is None:
        return None
    left = timer.time_remaining("train")
    return max(0.0, left) if left is not None else None
