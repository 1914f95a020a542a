"""The verdicts' margins (`verdict:` in conf/config.yaml): the smallest difference that matters,
read and checked here, before a sweep runs, and again by `attnres-summarize --margin`.

- `verdict.margin` (default 0.5%): for losses, bpb and other lower-is-better metrics, a share of
  the baseline's mean, written with a percent sign. 0.5% is half the smallest gap of the paper's
  Table 2 (Block at 241M: 1.875 against 1.895, 1.06% of the baseline's loss): an effect of the size
  the paper reports is twice the margin, so seeds can tell it from one that does not matter.
- `verdict.margin_points` (default 1): for accuracies and other higher-is-better task metrics,
  points, a hundredth of a metric on a 0-1 scale (1 point = 0.01 accuracy). The median AttnRes gain
  of the paper's Table 3 is 1.2 points, its smallest nonzero one 0.2.
"""

from __future__ import annotations

import math
from typing import Any

from attnres.config.errors import ConfigError

DEFAULT_SHARE_TEXT = "0.5%"
DEFAULT_POINTS = 1.0


def share(value: Any, key: str = "verdict.margin") -> float:
    """`0.5%` -> 0.005; anything else is a one-line ConfigError naming the fix."""
    text = str(value).strip()
    fix = f"write a share of the baseline's mean with a percent sign above 0 and below 100, e.g. {key}=0.5%"
    if not text.endswith("%"):
        raise ConfigError(f"{key}={text or repr(text)} is not a share; {fix}")
    try:
        percent = float(text[:-1])
    except ValueError:
        raise ConfigError(f"{key}={text} is not a number of percent; {fix}") from None
    if not (math.isfinite(percent) and 0 < percent < 100):
        raise ConfigError(f"{key}={text} is out of range; {fix}")
    return percent / 100


def points(value: Any, key: str = "verdict.margin_points") -> float:
    """A number of points above 0 and below 100, or a one-line ConfigError naming the fix."""
    fix = f"write a number of points above 0 and below 100 (1 point = 0.01 accuracy), e.g. {key}=1"
    if isinstance(value, bool):
        raise ConfigError(f"{key}={str(value).lower()} is not a number; {fix}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value} is not a number; {fix}") from None
    if not (math.isfinite(number) and 0 < number < 100):
        raise ConfigError(f"{key}={value} is out of range; {fix}")
    return number


def check(cfg: Any) -> None:
    """The `verdict:` node of a composed config, when it has one (a config older than it has none)."""
    node = cfg.get("verdict") if hasattr(cfg, "get") else None
    if node is None:
        return
    if "margin" in node:
        share(node.get("margin"))
    if "margin_points" in node:
        points(node.get("margin_points"))
