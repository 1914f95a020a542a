"""The `seeds:` node of a composed config (seeds on demand, attnres.sweep.on_demand), checked before
anything runs: each value one line naming the fix; and `seeds.on_demand=true` on a run alone (no -m),
which has no arms to compare and no looks to take, refused the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def refuse_run_alone(config_name: str, overrides: Sequence[Any]) -> None:
    """`seeds.on_demand=true` on the command line of a run alone: Hydra would train it on one seed and
    never read the design, so it is refused, naming -m and what the run alone would do. Runs inside
    `hydra_on` (attnres.config.compose), after the job's checks: its seed is the composed one."""
    if not any(o.key_or_group == "seeds.on_demand" and o.value() is True for o in overrides):
        return
    from hydra import compose

    seed = compose(config_name, overrides=[o.input_line for o in overrides if not o.is_hydra_override()]).seed
    raise ConfigError(f"seeds.on_demand=true needs a sweep: add -m and the arms to compare (attnres-run -m "
                      f"residual=standard,block seeds.on_demand=true); without -m it would train one run on seed "
                      f"{seed} and read no verdict, so leave seeds.on_demand=true out of a run alone")
