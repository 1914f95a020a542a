"""The machine's load while a run trained, for metrics.json (`machine_load`): a speed ratio between two
runs means little when one of them shared its cores with other work (attnres/results/cost.py says so).

`os.getloadavg()`'s 1-minute average (runnable processes, smoothed over about a minute) is sampled
when training starts, every `every_s` seconds of training (at the end of a step, so nothing runs
beside the training) and when it ends; `os.cpu_count()` says how many cores there were to share.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl


def load_1min() -> float | None:
    """The 1-minute load average, or None where the system has none (Windows)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


class MachineLoad(pl.Callback):
    """Samples the load over a fit; `record()` is what metrics.json keeps."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []  # (seconds since the fit started, 1-minute load)
        self._start: float | None = None
        self._last = 0.0

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._start is None:
            self._start = now
        load = load_1min()
        if load is not None:
            self.samples.append((round(now - self._start, 1), load))
        self._last = now

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sample()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self.sample(now)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sample()

    def record(self) -> dict[str, Any] | None:
        """{cpu_count, samples_1min: [[s, load], ...], mean_1min, max_1min}, or None with no sample."""
        if not self.samples:
            return None
        loads = [load for _, load in self.samples]
        return {"cpu_count": os.cpu_count(), "samples_1min": [list(s) for s in self.samples],
                "mean_1min": round(sum(loads) / len(loads), 3), "max_1min": max(loads)}
