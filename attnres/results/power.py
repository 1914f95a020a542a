"""What a verdict's seeds could decide, and the tests beside its interval (verdict.py), each from statsmodels:

- power (`statsmodels.stats.power`): the smallest difference the seeds in hand detect with 80%
  power in a two-sided t test at the verdict's level, from the observed spread of the paired
  differences (`TTestPower`, one-sample t on d) or, unpaired, of the runs (`TTestIndPower`,
  pooled sd, equal sizes); and the seeds a margin-sized difference needs for the same power;
- equivalence (`statsmodels.stats.weightstats.ttost_paired` / `ttost_ind`): two one-sided tests
  against -margin and +margin; its p below alpha / 2 is the interval at level 1 - alpha inside
  (-margin, +margin);
- several arms against one baseline (`statsmodels.stats.multitest.multipletests`, Holm).

The cost ratios' intervals are cost.py's.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from typing import Any

POWER = 0.8
#: 2 pairs never give a verdict (verdict.py): seeds-needed is at least this
MIN_SEEDS = 3


def detectable(sd: float, n: int, alpha: float, paired: bool = True) -> float | None:
    """The smallest |difference| detected with 80% power by a two-sided t test at `alpha` with `n`
    pairs (or `n` runs a side, unpaired) whose spread is `sd`; None below 2 (no spread to use)."""
    from statsmodels.stats.power import TTestIndPower, TTestPower

    if n < 2 or not (sd > 0 and math.isfinite(sd)):
        return None
    solver = TTestPower() if paired else TTestIndPower()
    with warnings.catch_warnings():  # statsmodels warns where its root finder gives up: the result is checked
        warnings.simplefilter("ignore")
        size = solver.solve_power(None, n, alpha, POWER, alternative="two-sided")  # nobs (TTestPower), nobs1
    return float(size) * sd if size is not None and math.isfinite(size) else None


def seeds_needed(margin: float, sd: float, alpha: float, paired: bool = True) -> int | None:
    """The seeds (pairs, or runs a side unpaired) for 80% power to detect a difference of `margin`
    with spread `sd` at `alpha`; at least MIN_SEEDS; None when there is no spread to go by."""
    from statsmodels.stats.power import TTestIndPower, TTestPower

    if not (sd > 0 and math.isfinite(sd)) or not margin > 0:
        return None
    solver = TTestPower() if paired else TTestIndPower()
    effect = margin / sd
    with warnings.catch_warnings():  # as in `detectable`
        warnings.simplefilter("ignore")
        probe = effect  # statsmodels' noncentral t gives nan for some large effects: power grows with the
        found = math.nan  # effect, so a smaller effect with the power already is as good an answer
        while not math.isfinite(found) and probe > 1e-6:
            found = solver.power(probe, MIN_SEEDS, alpha, alternative="two-sided")
            probe /= 2
        if found >= POWER:
            return MIN_SEEDS  # the root finder has nothing to find below it
        n = solver.solve_power(effect, None, alpha, POWER, alternative="two-sided")
    n = float(n)
    return max(MIN_SEEDS, math.ceil(n - 1e-9)) if math.isfinite(n) else None


def tost_p(candidate: Sequence[float], baseline: Sequence[float], margin: float, paired: bool = True) -> float | None:
    """The p-value of two one-sided tests that candidate - baseline lies inside (-margin, +margin)
    (paired by position, or Welch); None where the differences have no spread."""
    import numpy as np
    from statsmodels.stats.weightstats import ttost_ind, ttost_paired

    a, b = np.asarray(candidate, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    spread = np.std(a - b) if paired else max(np.std(a), np.std(b))
    if len(a) < 2 or len(b) < 2 or spread == 0.0:
        return None
    with np.errstate(all="ignore"):
        if paired:
            p, _, _ = ttost_paired(a, b, -margin, margin)
        else:
            p, _, _ = ttost_ind(a, b, -margin, margin, usevar="unequal")
    return float(p) if math.isfinite(p) else None


def holm(p_values: Sequence[float], alpha: float) -> list[float]:
    """Holm's adjusted p-values (family-wise error at `alpha` over the arms)."""
    from statsmodels.stats.multitest import multipletests

    return [float(p) for p in multipletests(list(p_values), alpha=alpha, method="holm")[1]]


def figures(candidate: Sequence[float], baseline: Sequence[float], margin: float | None, alpha: float,
            paired: bool) -> dict[str, Any]:
    """A comparison's power fields: the spread (sd of the paired differences, or the pooled sd of the
    runs unpaired, the one TTestIndPower's effect size is in), the smallest difference detected at 80%
    power, the seeds a margin-sized difference needs, and the equivalence test's p."""
    if paired:
        sd = statistics.stdev([a - b for a, b in zip(candidate, baseline, strict=True)])
    else:
        sd = math.sqrt((statistics.variance(candidate) + statistics.variance(baseline)) / 2)
    n = len(candidate) if paired else min(len(candidate), len(baseline))
    found = {"sd": sd, "detectable": detectable(sd, n, alpha, paired)}
    if margin:
        found.update(seeds_needed=seeds_needed(margin, sd, alpha, paired),
                     tost_p=tost_p(candidate, baseline, margin, paired))
    return found
