"""The progress bar that `conf/callbacks/default.yaml` names: one line over optimiser steps."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ProgressBar

from attnres.training.faults import at_last_step

log = logging.getLogger("attnres")


class StepProgressBar(ProgressBar):
    """One line over optimiser steps (of `max_steps`) with the latest numbers; a validation
    only updates those numbers instead of drawing bars of its own.

    Where stdout is not a terminal (a sweep's train.log, a batch job's log) there is no bar:
    a plain log line after the first step (so a log says at once that training runs, and how
    fast), every `plain_every` steps and after each validation, so files hold no carriage
    returns or escape codes.
    """

    def __init__(self, refresh_rate: int = 10, plain_every: int = 100) -> None:
        super().__init__()
        self.refresh_rate, self.plain_every = max(1, int(refresh_rate)), max(1, int(plain_every))
        self._enabled, self.bar, self._first_said = True, None, False

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _numbers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, str]:
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return {k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in metrics.items()}

    def _line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        numbers = "  ".join(f"{k} {v}" for k, v in self._numbers(trainer, pl_module).items())
        return f"step {trainer.global_step}/{trainer.max_steps}  {numbers}"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_said = False
        if self._enabled and trainer.is_global_zero and sys.stdout.isatty():
            from tqdm.auto import tqdm

            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            self.bar = tqdm(total=total, initial=trainer.global_step, desc="steps", dynamic_ncols=True,
                            file=sys.stdout, leave=True, smoothing=0.1, unit="step")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        step, last = trainer.global_step, at_last_step(trainer)
        if self.bar is not None and (step % self.refresh_rate == 0 or last):
            self.bar.n = step
            self.bar.set_postfix(self._numbers(trainer, pl_module), refresh=False)
            self.bar.refresh()
        elif self.bar is None and (step % self.plain_every == 0 or last or not self._first_said):
            self._first_said = True
            log.info(self._line(trainer, pl_module))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.bar is not None and not trainer.sanity_checking:
            self.bar.set_description("validating")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero or trainer.sanity_checking:
            return
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


