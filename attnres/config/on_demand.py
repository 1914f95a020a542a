"""The `seeds:` node of a composed config (seeds on demand, attnres.sweep.on_demand), checked before
anything runs: each value one line naming the fix."""

from __future__ import annotations

import math
from typing import Any

from attnres.config.errors import ConfigError

#: key -> (lowest value, an example); `start` is at least 3: two seeds barely estimate a spread
INTEGERS = {"first": (0, 0), "start": (3, 3), "batch": (1, 2), "max": (3, 10)}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check(cfg: Any) -> None:
    node = cfg.get("seeds") if hasattr(cfg, "get") else None
    if node is None:
        return
    on = node.get("on_demand", False)
    if not isinstance(on, bool):
        raise ConfigError(f"seeds.on_demand={on} is not true or false; e.g. seeds.on_demand=true")
    for key, (low, example) in INTEGERS.items():
        value = node.get(key)
        if not _int(value) or value < low:
            why = "two seeds barely estimate a spread" if key == "start" else "a count of seeds"
            raise ConfigError(f"seeds.{key}={value} must be an integer of at least {low} ({why}); "
                              f"e.g. seeds.{key}={example}")
    if node.get("max") < node.get("start"):
        raise ConfigError(f"seeds.max={node.get('max')} is below seeds.start={node.get('start')}: the first look "
                          f"would pass the maximum; raise seeds.max or lower seeds.start")
    alpha = node.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and 0 < alpha < 0.5):
        raise ConfigError(f"seeds.alpha={alpha} must be a number above 0 and below 0.5 (the design's two-sided "
                          "error rate over all its looks); e.g. seeds.alpha=0.05")
