"""Paired verdicts: how each configuration of a sweep compares with its standard-residual baseline.

DESIGN.md section 6; the decision rule is docs/sweeps.md#verdicts. A comparison is between two
configurations that differ only in the residual strategy. Runs are paired by seed; for each pair
d = metric(strategy) - metric(standard). The interval on the mean of d is Student's t with n - 1
degrees of freedom (`scipy.stats.ttest_1samp`), at 95%, or at 1 - 0.05 / K when K arms share one
baseline (Bonferroni, so that K intervals hold together; the p-values beside are Holm's). Welch's
interval (`scipy.stats.ttest_ind(equal_var=False)`), labelled "unpaired", when no seed is common
but each side has two runs or more. Failed or unfinished jobs are left out and counted.

The words come from the interval and a margin m > 0, the smallest difference that matters
(`Margin`: a share of the baseline's mean for losses and bpb, points for accuracies), by
`margin_verdict`: beyond the margin, inside it, equivalent (the interval inside (-m, +m): two
one-sided tests at alpha / 2 each, TOST), or not resolved. Two pairs or fewer never give a winner:
one degree of freedom barely estimates a spread. Each verdict also carries its power (power.py):
the smallest difference its seeds detect at 80% power, and the seeds a margin-sized difference
needs; and the cost as paired ratios with an interval (cost.py).

The rows are those of `summary.collect_rows`: each carries `config` (the overrides that differ
between the sweep's configurations, seed left out), `seed`, `status`, the metrics, `exact` /
`match` (the configuration less the strategy's keys, and less `IGNORED_FOR_BASELINE` too),
`is_baseline` (True for `residual=standard`) and, when the run recorded it, `machine_load`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from attnres.results import cost, power
from attnres.results.margin import HIGHER_IS_BETTER, TASK_HIGHER_IS_BETTER, Margin, higher_is_better

__all__ = ["HIGHER_IS_BETTER", "TASK_HIGHER_IS_BETTER", "Comparison", "Margin", "RESOLVED", "compare", "compare_arms",
           "comparisons", "higher_is_better", "margin_verdict"]
#: keys a standard-residual run does not depend on: a Block run at any `optim.query_lr_scale`
#: pairs with the standard runs (which have no pseudo-queries) of an otherwise equal configuration
IGNORED_FOR_BASELINE = ("optim.query_lr_scale",)
ALPHA = 0.05


# == the decision rule (docs/sweeps.md#verdicts) ======================================================
BETTER_BY_MARGIN = "better by at least the margin"
BETTER_WITHIN = "better, by less than the margin"
BETTER_UNSURE = "better; whether by the margin is not resolved"
WORSE_BY_MARGIN = "worse by at least the margin"
WORSE_WITHIN = "worse, by less than the margin"
WORSE_UNSURE = "worse; whether by the margin is not resolved"
EQUIVALENT = "equivalent within the margin"
NOT_RESOLVED = "not resolved"
#: what adding seeds stops on: the question is answered, one way or the other
RESOLVED = frozenset({BETTER_BY_MARGIN, BETTER_WITHIN, WORSE_BY_MARGIN, WORSE_WITHIN, EQUIVALENT})


def margin_verdict(low: float, high: float, margin: float, lower_is_better: bool) -> str:
    """The words for an interval [low, high] on d = candidate - baseline and a margin m > 0.

    For lower-is-better (mirrored for higher-is-better):
    high < -m: better by at least the margin; -m <= low and high < 0: better, by less than the
    margin; low < -m <= high < 0: better, by the margin not resolved; -m < low <= 0 <= high < m:
    equivalent within the margin; anything else (the interval reaches past a margin and across 0):
    not resolved. "worse" symmetrically."""
    if not margin > 0:
        raise ValueError(f"a margin must be positive, not {margin}")
    if not lower_is_better:  # higher is better: the same rule on -d
        low, high = -high, -low
    if high < -margin:
        return BETTER_BY_MARGIN
    if high < 0:
        return BETTER_WITHIN if low >= -margin else BETTER_UNSURE
    if low > margin:
        return WORSE_BY_MARGIN
    if low > 0:
        return WORSE_WITHIN if high <= margin else WORSE_UNSURE
    if -margin < low and high < margin:
        return EQUIVALENT
    return NOT_RESOLVED


def few_seeds(n: int, unpaired: bool = False) -> str:
    """The verdict of an interval from two pairs (or two runs a side) or fewer."""
    what = f"{n} runs a side" if unpaired else f"{n} seed{'s' * (n != 1)}"
    return f"not resolved: {what} barely estimate the spread (1 degree of freedom)"


@dataclass
class Comparison:
    """One configuration against its baseline, on `metric`. `verdict` follows from `ci` and `margin`
    alone, so code that replaces `ci` (a sequential design's repeated interval) gets the right words."""

    label: str
    baseline: str | None
    metric: str
    method: str  # "paired t" | "Welch (unpaired)" | "one pair" | "no baseline" | "no runs"
    n: int = 0  # pairs (paired), or runs on the candidate's side (Welch)
    n_baseline: int = 0  # runs on the baseline's side (Welch)
    mean: float | None = None  # of d = candidate - baseline
    ci: tuple[float, float] | None = None
    p_value: float | None = None  # the t test of d = 0
    wins: int = 0  # pairs where the candidate is better
    losses: int = 0
    diffs: dict[Any, float] = field(default_factory=dict)  # seed -> d (paired)
    margin: float | None = None  # in the metric's units
    margin_rule: str = ""  # how it was set, "0.5% of the baseline"
    arms: int = 1  # comparisons sharing this baseline: the interval is at 1 - ALPHA / arms
    p_holm: float | None = None  # Holm's adjusted p over the arms (arms > 1)
    tost_p: float | None = None  # two one-sided tests of |d| < margin
    sd: float | None = None  # of the paired differences (or pooled, unpaired)
    detectable: float | None = None  # the smallest |d| these seeds detect at 80% power
    seeds_needed: int | None = None  # for 80% power at a margin-sized d
    tokens_per_sec_ratio: float | None = None  # geometric mean over the pairs
    tokens_per_sec_ci: tuple[float, float] | None = None
    tokens_per_sec_note: str | None = None  # why there is no tokens/s ratio, when runs lack tokens/s
    load_note: str | None = None  # the machine's load made the tokens/s ratio unreliable (cost.py)
    peak_memory_ratio: float | None = None
    peak_memory_ci: tuple[float, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def lower_is_better(self) -> bool:
        return not higher_is_better(self.metric)

    @property
    def alpha(self) -> float:
        return ALPHA / max(1, self.arms)

    @property
    def verdict(self) -> str:
        """The words of `margin_verdict`, or why there are none."""
        if self.ci is None:
            return "not resolved: 1 seed gives no interval" if self.method == "one pair" else "no interval"
        unpaired = self.method.startswith("Welch")
        if min(self.n, self.n_baseline) <= 2 if unpaired else self.n <= 2:
            return few_seeds(min(self.n, self.n_baseline) if unpaired else self.n, unpaired)
        if not self.margin:
            return f"{NOT_RESOLVED} (no margin: the baseline's mean is 0)"
        return margin_verdict(*self.ci, self.margin, self.lower_is_better)

    def sentence(self) -> str:
        """One plain line, e.g. `block vs standard: better by at least the margin, -0.0410 val/bpb
        [-0.0500, -0.0320] (paired t, 3 seeds; lower is better; margin 0.0100 = 0.5% of the baseline),
        3/3 seeds favour block; 80% power at 0.0200 with 3 seeds, the margin needs 9; 0.93x tokens/s
        [0.91, 0.95], 1.01x peak memory [1.00, 1.02]`."""
        head = f"{self.label} vs {self.baseline or 'standard'}"
        direction = "lower is better" if self.lower_is_better else "higher is better"
        if self.method == "no baseline":
            return f"{head}: no baseline in this sweep (no residual=standard run of the same configuration)" + \
                self._notes()
        if self.mean is None:
            return f"{head}: no finished runs to compare" + self._notes()
        margin = f"margin {self.margin:.4f} = {self.margin_rule}" if self.margin else "no margin"
        if self.method == "one pair":
            (seed, d), = self.diffs.items()
            text = f"{head}: {self.verdict}, {d:+.4f} {self.metric} on seed {seed} ({direction}; {margin})"
        else:
            low, high = self.ci
            unpaired = self.method.startswith("Welch")
            how = f"Welch, unpaired, {self.n} runs" if unpaired else f"paired t, {self.n} seeds"
            if self.arms > 1:  # the interval at the Bonferroni level the words read; Holm's p beside
                how += f", {100 * (1 - self.alpha):.4g}% interval: Holm over {self.arms} arms" + \
                    (f", adjusted p {self.p_holm:.3g}" if self.p_holm is not None else "")
            words = self.verdict + (f" (TOST p {self.tost_p:.3g})" if self.verdict == EQUIVALENT and
                                    self.tost_p is not None else "")
            text = (f"{head}: {words}, {self.mean:+.4f} {self.metric} [{low:+.4f}, {high:+.4f}] "
                    f"({how}; {direction}; {margin})")
            if not unpaired:
                text += f", {self.wins}/{self.n} seeds favour {self.label}"
            text += "; " + self.power_text()
        return text + self._cost() + self._notes()

    def power_text(self) -> str:
        """`80% power at 0.0200 with 3 seeds, the margin needs 9`."""
        unit = "runs a side" if self.method.startswith("Welch") else "seeds"
        if not self.sd:
            return "no spread between seeds to estimate power from"
        found = f"80% power at {self.detectable:.4f} with {self.n} {unit}" if self.detectable else \
            "no power figure"
        return found + (f", the margin needs {self.seeds_needed}" if self.seeds_needed else "")

    def _cost(self) -> str:
        cost_parts = []
        for value, interval, name in ((self.tokens_per_sec_ratio, self.tokens_per_sec_ci, "tokens/s"),
                                      (self.peak_memory_ratio, self.peak_memory_ci, "peak memory")):
            if value:
                cost_parts.append(f"{value:.2f}x {name}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]"
                                                            if interval else ""))
            if value and name == "tokens/s" and self.load_note:  # right after the ratio it qualifies
                cost_parts.append(self.load_note)
        if self.tokens_per_sec_note:
            cost_parts.append(self.tokens_per_sec_note)
        return "; " + ", ".join(cost_parts) if cost_parts else ""

    def _notes(self) -> str:
        return f" ({'; '.join(self.notes)})" if self.notes else ""

    def columns(self) -> dict[str, Any]:
        """The comparison's columns of summary.csv."""
        ci, tps, mem = self.ci or (None, None), self.tokens_per_sec_ci or (None, None), \
            self.peak_memory_ci or (None, None)
        return {
            "baseline": self.baseline, "method": self.method, "n": self.n, "mean_diff": self.mean,
            "ci_low": ci[0], "ci_high": ci[1], "level": 1 - self.alpha if self.ci else None,
            "p_value": self.p_value, "arms": self.arms, "p_holm": self.p_holm,
            "favour": f"{self.wins}/{self.n}" if self.method == "paired t" else None,
            "margin": self.margin, "verdict": self.verdict if self.mean is not None else None,
            "tost_p": self.tost_p, "sd": self.sd, "detectable": self.detectable, "seeds_needed": self.seeds_needed,
            "tokens_per_sec_ratio": self.tokens_per_sec_ratio, "tokens_per_sec_ci_low": tps[0],
            "tokens_per_sec_ci_high": tps[1], "load": self.load_note,
            "peak_memory_ratio": self.peak_memory_ratio, "peak_memory_ci_low": mem[0], "peak_memory_ci_high": mem[1],
        }


COLUMNS = ("baseline", "diff", "method", "n", "mean_diff", "ci_low", "ci_high", "level", "p_value", "arms", "p_holm",
           "favour", "margin", "verdict", "tost_p", "sd", "detectable", "seeds_needed", "tokens_per_sec_ratio",
           "tokens_per_sec_ci_low", "tokens_per_sec_ci_high", "load", "peak_memory_ratio", "peak_memory_ci_low",
           "peak_memory_ci_high")


def _usable(row: Mapping[str, Any], metric: str) -> bool:
    return row.get("status") == "finished" and _finite(row.get(metric))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


#: re-exported: what a comparison says when its runs have no tokens/s (cost.py)
NO_TOKENS_PER_SEC, SPEED = cost.NO_TOKENS_PER_SEC, cost.SPEED


def _t_interval(diffs: Sequence[float], level: float) -> tuple[tuple[float, float], float | None]:
    from scipy import stats

    mean = statistics.fmean(diffs)
    if statistics.pstdev(diffs) == 0.0:  # identical differences: scipy divides by 0; the interval is the point
        return (mean, mean), None
    result = stats.ttest_1samp(diffs, 0.0)
    low, high = result.confidence_interval(level)
    return (float(low), float(high)), float(result.pvalue)


def _welch_interval(a: Sequence[float], b: Sequence[float], level: float) -> tuple[tuple[float, float], float | None]:
    from scipy import stats

    if statistics.pstdev(a) == 0.0 and statistics.pstdev(b) == 0.0:
        d = statistics.fmean(a) - statistics.fmean(b)
        return (d, d), None
    result = stats.ttest_ind(a, b, equal_var=False)
    low, high = result.confidence_interval(level)
    return (float(low), float(high)), float(result.pvalue)


def compare(candidate: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]], metric: str,
            label: str, baseline_label: str | None, margin: Margin | None = None, arms: int = 1) -> Comparison:
    """The comparison of one configuration's runs with its baseline's runs (section 6), its interval
    at 1 - ALPHA / arms."""
    margin = margin or Margin()
    comparison = Comparison(label=label, baseline=baseline_label, metric=metric, method="no runs", arms=arms)
    left_out = [r for r in (*candidate, *baseline) if not _usable(r, metric)
                and not str(r.get("status", "")).startswith("duplicate")]
    if left_out:
        kinds = sorted({str(r.get("status") or "unfinished").split(" ")[0] for r in left_out})
        comparison.notes.append(f"{len(left_out)} {'/'.join(kinds)} job{'s' if len(left_out) > 1 else ''} left out")
    cand = {r.get("seed"): r for r in candidate if _usable(r, metric)}
    if baseline_label is None:
        comparison.method = "no baseline"
        return comparison
    base = {r.get("seed"): r for r in baseline if _usable(r, metric)}
    seeds = sorted(set(cand) & set(base), key=str)
    unmatched = sorted((set(cand) ^ set(base)), key=str)
    sign = 1.0 if comparison.lower_is_better else -1.0
    level = 1 - comparison.alpha
    if len(seeds) >= 2 or (len(seeds) == 1 and not (len(cand) >= 2 and len(base) >= 2)):
        a, b = [float(cand[s][metric]) for s in seeds], [float(base[s][metric]) for s in seeds]
        diffs = {s: x - y for s, x, y in zip(seeds, a, b, strict=True)}
        comparison.diffs, comparison.n = diffs, len(seeds)
        comparison.mean = statistics.fmean(diffs.values())
        comparison.wins = sum(1 for d in diffs.values() if sign * d < 0)
        comparison.losses = sum(1 for d in diffs.values() if sign * d > 0)
        _set_margin(comparison, margin, statistics.fmean(b))
        if len(seeds) >= 2:
            comparison.method = "paired t"
            comparison.ci, comparison.p_value = _t_interval(list(diffs.values()), level)
            _set(comparison, power.figures(a, b, comparison.margin, comparison.alpha, paired=True))
        else:
            comparison.method = "one pair"
        _set(comparison, cost.paired([(cand[s], base[s]) for s in seeds]))
        if unmatched:
            comparison.notes.append(f"seed{'s' if len(unmatched) > 1 else ''} {', '.join(map(str, unmatched))} "
                                    "on one side only, left out")
    elif len(cand) >= 2 and len(base) >= 2:
        a, b = [float(r[metric]) for r in cand.values()], [float(r[metric]) for r in base.values()]
        comparison.method, comparison.n, comparison.n_baseline = "Welch (unpaired)", len(a), len(b)
        comparison.mean = statistics.fmean(a) - statistics.fmean(b)
        comparison.ci, comparison.p_value = _welch_interval(a, b, level)
        _set_margin(comparison, margin, statistics.fmean(b))
        _set(comparison, power.figures(a, b, comparison.margin, comparison.alpha, paired=False))
        _set(comparison, cost.unpaired(list(cand.values()), list(base.values())))
        comparison.notes.append(f"no common seeds: {len(a)} vs {len(b)} runs")
    elif cand and base:
        comparison.notes.append(f"no seed in common: seeds {', '.join(map(str, sorted(cand, key=str)))} against "
                                f"{', '.join(map(str, sorted(base, key=str)))}")
    return comparison


def _set(comparison: Comparison, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        setattr(comparison, key, value)


def _set_margin(comparison: Comparison, margin: Margin, baseline_mean: float) -> None:
    comparison.margin = margin.in_units(comparison.metric, baseline_mean)
    comparison.margin_rule = margin.describe(comparison.metric)


def compare_arms(arms: Sequence[tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]], str, str | None]],
                 metric: str, margin: Margin | None = None) -> list[Comparison]:
    """Each (candidate runs, baseline runs, label, baseline label) compared; the K arms with an
    interval against one baseline are compared again at 1 - ALPHA / K (Bonferroni), and their
    t tests' p-values adjusted by Holm (power.holm)."""
    first = [compare(c, b, metric, label, base, margin) for c, b, label, base in arms]
    family: dict[str | None, list[int]] = {}
    for i, found in enumerate(first):
        if found.ci is not None and found.baseline is not None:
            family.setdefault(found.baseline, []).append(i)
    for members in family.values():
        if len(members) < 2:
            continue
        for i in members:
            c, b, label, base = arms[i]
            first[i] = compare(c, b, metric, label, base, margin, arms=len(members))
        tested = [i for i in members if first[i].p_value is not None]
        for i, p in zip(tested, power.holm([first[i].p_value for i in tested], ALPHA) if tested else [],
                        strict=True):
            first[i].p_holm = p
    return first


def comparisons(rows: Sequence[Mapping[str, Any]], metric: str, margin: Margin | None = None) -> list[Comparison]:
    """Every non-baseline configuration of `rows` against its baseline, in the rows' order."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if not str(row.get("status", "")).startswith("duplicate"):
            groups.setdefault(row["config"], []).append(row)
    baselines = {name: runs for name, runs in groups.items() if runs[0].get("is_baseline")}
    arms = []
    for name, runs in groups.items():
        if name in baselines:
            continue
        match = _find_baseline(runs[0], baselines)
        arms.append((runs, baselines.get(match, []), name, match))
    return compare_arms(arms, metric, margin)


def _find_baseline(row: Mapping[str, Any], baselines: Mapping[str, Sequence[Mapping[str, Any]]]) -> str | None:
    """The baseline group of an otherwise identical configuration: exactly equal first, then
    equal but for the keys in IGNORED_FOR_BASELINE; the first by name if several qualify."""
    for key in ("exact", "match"):
        hits = sorted(name for name, runs in baselines.items() if runs[0].get(key) == row.get(key))
        if hits:
            return hits[0]
    return None
