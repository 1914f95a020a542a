"""Compute equivalence, as the AttnRes paper measures it (DESIGN.md section 6).

Training compute of a run, in FLOPs (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1, Table 1: forward 2N + 2 n_layer n_ctx d_model per token, backward twice
the forward):

    C = 6 * N * tokens + 6 * n_layer * T * D * tokens

N: non-embedding parameters (metrics.json `non_embedding_parameters`: everything but the token
embedding and LM head, the residual strategy's own parameters included), tokens: tokens seen,
T: sequence length, D: width. The depth attention's own elementwise work is not counted (a few
per cent of C for Full AttnRes at D = 64, well under 1% for Block at the ladder's sizes).

Per strategy, the final losses over model sizes are fitted with L(C) = a * (C / C0)^(-b) + c
(C0: the geometric mean of the compute, for a well-scaled fit; `scipy.optimize.curve_fit`).
For an AttnRes point (C, L), the multiplier is C_base(L) / C, where C_base inverts the
baseline's fit: the compute at which the baseline would reach the same loss. The paper's
headline: Block AttnRes matches a baseline trained with 1.25x the compute. The interval is a
bootstrap over seeds: each (strategy, size) cell resamples its seeds, the baseline is refitted,
the multipliers recomputed; 2.5 and 97.5 percentiles.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def training_flops(non_embedding_parameters: float, tokens: float, n_layer: int, seq_len: int, width: int) -> float:
    """C = 6 N tokens + 6 n_layer T D tokens (module docstring)."""
    return 6.0 * non_embedding_parameters * tokens + 6.0 * n_layer * seq_len * width * tokens


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = a * (C / c0)^(-b) + c."""

    a: float
    b: float
    c: float
    c0: float

    def __call__(self, compute: Any) -> Any:
        return self.a * (np.asarray(compute, dtype=np.float64) / self.c0) ** (-self.b) + self.c

    def inverse(self, loss: float) -> float | None:
        """The compute at which the fit reaches `loss`; None at or below its irreducible term."""
        if not loss > self.c or self.a <= 0 or self.b <= 0:
            return None
        return self.c0 * ((loss - self.c) / self.a) ** (-1.0 / self.b)


def fit_power_law(compute: Sequence[float], loss: Sequence[float]) -> PowerLaw:
    """Least-squares fit of L = a (C / C0)^(-b) + c over points (at least 3 distinct computes),
    with a > 0, 0 < b < 5 and 0 <= c < min(L); the best of a few starting points."""
    from scipy.optimize import curve_fit

    x, y = np.asarray(compute, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if len(np.unique(x)) < 3:
        raise ValueError(f"fitting a * C^-b + c needs at least 3 distinct compute values, got {len(np.unique(x))}")
    c0 = float(np.exp(np.log(x).mean()))
    u = x / c0
    low = float(y.min())

    def model(u: np.ndarray, a: float, b: float, c: float) -> np.ndarray:
        return a * u ** (-b) + c

    best: tuple[float, tuple[float, float, float]] | None = None
    for frac in (0.0, 0.5, 0.8, 0.95):
        c_start = frac * low
        slope = np.polyfit(np.log(u), np.log(np.maximum(y - c_start, 1e-12)), 1)[0]
        start = (max(float(np.exp(np.log(np.maximum(y - c_start, 1e-12)).mean())), 1e-9),
                 float(np.clip(-slope, 1e-3, 4.9)), c_start)
        try:
            params, _ = curve_fit(model, u, y, p0=start, bounds=([1e-12, 1e-4, 0.0], [np.inf, 5.0, low * (1 - 1e-9)]),
                                  maxfev=20000)
        except (RuntimeError, ValueError):
            continue
        sse = float(((model(u, *params) - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, tuple(float(p) for p in params))
    if best is None:
        raise ValueError("the power-law fit did not converge from any starting point")
    a, b, c = best[1]
    return PowerLaw(a=a, b=b, c=c, c0=c0)


@dataclass
class Cell:
    """The runs of one strategy at one model size: compute and final loss per seed."""

    strategy: str
    size: str
    parameters: int
    compute: dict[Any, float]
    loss: dict[Any, float]

    @property
    def mean_compute(self) -> float:
        return statistics.fmean(self.compute.values())

    @property
    def mean_loss(self) -> float:
        return statistics.fmean(self.loss.values())


def multipliers(baseline: Sequence[Cell], others: Sequence[Cell]
                ) -> tuple[PowerLaw, dict[tuple[str, str], float | None]]:
    """The baseline's fit over its cells' means, and (strategy, size) -> C_base(L) / C."""
    fit = fit_power_law([c.mean_compute for c in baseline], [c.mean_loss for c in baseline])
    found = {}
    for cell in others:
        reached = fit.inverse(cell.mean_loss)
        found[(cell.strategy, cell.size)] = None if reached is None else reached / cell.mean_compute
    return fit, found


def geometric_mean(values: Sequence[float]) -> float:
    return float(math.exp(statistics.fmean(math.log(v) for v in values)))


def bootstrap_multipliers(baseline: Sequence[Cell], others: Sequence[Cell], samples: int = 2000,
                          seed: int = 0) -> dict[Any, tuple[float, float] | None]:
    """95% percentile intervals of each (strategy, size) multiplier and of each strategy's
    geometric mean over sizes (key: the strategy name), resampling the seeds of every cell."""
    rng = np.random.default_rng(seed)

    def resample(cell: Cell) -> Cell:
        seeds = list(cell.loss)
        drawn = [seeds[i] for i in rng.integers(0, len(seeds), len(seeds))]
        return Cell(cell.strategy, cell.size, cell.parameters, {k: cell.compute[s] for k, s in enumerate(drawn)},
                    {k: cell.loss[s] for k, s in enumerate(drawn)})

    draws: dict[Any, list[float]] = {}
    for _ in range(samples):
        try:
            _, found = multipliers([resample(c) for c in baseline], [resample(c) for c in others])
        except ValueError:
            continue
        per_strategy: dict[str, list[float]] = {}
        for key, value in found.items():
            if value is not None:
                draws.setdefault(key, []).append(value)
                per_strategy.setdefault(key[0], []).append(value)
        for strategy, values in per_strategy.items():
            if len(values) == sum(1 for c in others if c.strategy == strategy):  # every size reached
                draws.setdefault(strategy, []).append(geometric_mean(values))
    keys = {(c.strategy, c.size) for c in others} | {c.strategy for c in others}
    return {key: (float(np.percentile(draws[key], 2.5)), float(np.percentile(draws[key], 97.5)))
            if len(draws.get(key, ())) >= samples // 2 else None for key in keys}


def cells_from_runs(runs: Sequence[Mapping[str, Any]], metric: str = "val/loss") -> list[Cell]:
    """Group finished runs (dicts with strategy, size, parameters, seed, compute and `metric`)
    into cells, in order of strategy then parameters."""
    cells: dict[tuple[str, str], Cell] = {}
    for run in runs:
        value = run.get(metric)
        if run.get("status") != "finished" or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        key = (run["strategy"], run["size"])
        cell = cells.setdefault(key, Cell(run["strategy"], run["size"], int(run["parameters"]), {}, {}))
        cell.compute[run["seed"]] = float(run["compute"])
        cell.loss[run["seed"]] = float(value)
    return sorted(cells.values(), key=lambda c: (c.strategy, c.parameters))
