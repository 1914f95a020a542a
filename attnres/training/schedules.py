"""Learning-rate schedules as multipliers of the base rate: `schedule(step) -> float`.

Configured with Hydra `_partial_: true`; the Lightning module fills in `total_steps`
(the trainer's `max_steps` unless the config sets it) and wraps the result in `LambdaLR`.
"""

from __future__ import annotations

import math


def _check(warmup_steps: int, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"the schedule needs total_steps >= 1 (set trainer.max_steps), got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")


def warmup_cosine(step: int, *, total_steps: int, warmup_steps: int = 100, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    _check(warmup_steps, total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(
    step: int, *, total_steps: int, warmup_steps: int = 100, decay_fraction: float = 0.2, min_lr_ratio: float = 0.0
) -> float:
    """WSD: linear warmup, constant, then linear decay over the last `decay_fraction` of training."""
    _check(warmup_steps, total_steps)
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in [0, 1], got {decay_fraction}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = total_steps - int(decay_fraction * total_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - min_lr_ratio) * progress


def constant(step: int, *, total_steps: int, warmup_steps: int = 0) -> float:
    """Linear warmup, then the base rate."""
    _check(warmup_steps, total_steps)
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0
