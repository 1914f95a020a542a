"""The cost beside a verdict: tokens/s and peak-memory ratios to the paired baseline, with an interval,
and whether the machine's load makes a speed ratio unreliable.

A ratio is paired by seed: r_s = cost(candidate, seed s) / cost(baseline, seed s). Ratios multiply,
so the interval is Student's t (95%) on log r_s, exponentiated: a geometric-mean ratio and its
interval. One pair gives the ratio alone.

Each run records the machine's load while it ran (metrics.json `machine_load`,
attnres/training/machine_load.py: the 1-minute load average at its start, every few seconds during
and at its end, and the cores). A speed ratio is flagged when, in some pair,
- **heavy load**: a run saw a 1-minute load above the machine's cores (more runnable processes than
  cores: every process got less than a core), or
- **uneven load**: the two runs' mean 1-minute loads differ by more than a quarter of the cores (at
  least 1, one busy core): they ran on differently busy machines.
Peak memory does not depend on the load and is never flagged. Runs without a record (older runs)
are not judged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

LEVEL = 0.95


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def ratio_interval(pairs: Iterable[tuple[Any, Any]], level: float = LEVEL
                   ) -> tuple[float, tuple[float, float] | None] | None:
    """(geometric mean of a / b, its interval at `level`) over the pairs where both are positive
    numbers: Student's t on log(a / b), exponentiated; one pair gives the ratio and no interval;
    none gives None."""
    from scipy import stats

    logs = [math.log(a / b) for a, b in pairs if _finite(a) and _finite(b) and a > 0 and b > 0]
    if not logs:
        return None
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None
    if statistics.pstdev(logs) == 0.0:  # identical ratios: scipy divides by 0; the interval is the point
        return math.exp(mean), (math.exp(mean), math.exp(mean))
    low, high = stats.ttest_1samp(logs, 0.0).confidence_interval(level)
    return math.exp(mean), (math.exp(float(low)), math.exp(float(high)))


def uneven_threshold(cores: int) -> float:
    """How far two paired runs' mean 1-minute loads may differ before their speed ratio is flagged."""
    return max(1.0, cores / 4)


def load_note(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> str | None:
    """What the recorded load says about a speed ratio over these (candidate, baseline) run pairs
    (each a row with `machine_load`), or None when every recorded pair ran on a quiet, even machine."""
    heavy: list[tuple[float, int]] = []
    uneven = 0
    judged = 0
    for pair in pairs:
        records = [row.get("machine_load") for row in pair]
        if not all(isinstance(r, Mapping) and _finite(r.get("max_1min")) and _finite(r.get("mean_1min"))
                   and _finite(r.get("cpu_count")) for r in records):
            continue
        judged += 1
        cores = int(min(r["cpu_count"] for r in records))
        peak = max(float(r["max_1min"]) for r in records)
        if peak > cores:
            heavy.append((peak, cores))
        if abs(float(records[0]["mean_1min"]) - float(records[1]["mean_1min"])) > uneven_threshold(cores):
            uneven += 1
    if not heavy and not uneven:
        return None
    said = []
    if heavy:
        peak, cores = max(heavy)
        said.append(f"heavy load (1-minute load up to {peak:.1f} on {cores} cores)")
    if uneven:
        said.append(f"uneven load between the paired runs in {uneven} of {judged} seeds")
    return "tokens/s measured under " + " and ".join(said) + ": not a reliable speed comparison"


#: what a comparison says when its runs have no tokens/s: metrics.json leaves it out of a run
#: too short to measure after its warm-up steps (a ratio over warm-up would be compile time)
NO_TOKENS_PER_SEC = "no tokens/s ratio: runs too short to measure throughput after their warm-up steps"
SPEED = "tokens_per_sec_after_warmup"  # the rows' key the tokens/s ratio reads
MEMORY = "peak_memory_gib"


def speed_note(runs: Iterable[Mapping[str, Any]], ratio: float | None) -> str | None:
    """Why a comparison of `runs` has no tokens/s ratio (or one over fewer pairs), if that is why."""
    missing = sum(1 for r in runs if not _finite(r.get(SPEED)))
    if not missing:
        return None
    return NO_TOKENS_PER_SEC if ratio is None else f"the tokens/s ratio leaves out {missing} run(s) too short"


def paired(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> dict[str, Any]:
    """A comparison's cost fields over its (candidate, baseline) run pairs: each ratio with its interval,
    why the tokens/s ratio is missing, and what the load says of it."""
    speed = ratio_interval((c.get(SPEED), b.get(SPEED)) for c, b in pairs) or (None, None)
    memory = ratio_interval((c.get(MEMORY), b.get(MEMORY)) for c, b in pairs) or (None, None)
    return {"tokens_per_sec_ratio": speed[0], "tokens_per_sec_ci": speed[1], "peak_memory_ratio": memory[0],
            "peak_memory_ci": memory[1], "tokens_per_sec_note": speed_note([r for p in pairs for r in p], speed[0]),
            "load_note": load_note(pairs) if speed[0] else None}


def _mean_ratio(a: Sequence[Any], b: Sequence[Any]) -> float | None:
    a, b = [x for x in a if _finite(x)], [x for x in b if _finite(x)]
    return statistics.fmean(a) / statistics.fmean(b) if a and b and statistics.fmean(b) > 0 else None


def unpaired(candidate: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The cost fields of runs with no seed in common: the ratio of the means, no interval."""
    speed = _mean_ratio([r.get(SPEED) for r in candidate], [r.get(SPEED) for r in baseline])
    return {"tokens_per_sec_ratio": speed,
            "peak_memory_ratio": _mean_ratio([r.get(MEMORY) for r in candidate], [r.get(MEMORY) for r in baseline]),
            "tokens_per_sec_note": speed_note([*candidate, *baseline], speed)}
