"""Paired verdicts: how each configuration of a sweep compares with its standard-residual baseline.

DESIGN.md section 6. A comparison is between two configurations that differ only in the
residual strategy (same model, data, optimiser, steps). Runs are paired by seed; for each
pair d = metric(strategy) - metric(standard). Reported: the mean of d, its 95% interval from
Student's t with n - 1 degrees of freedom (`scipy.stats.ttest_1samp`), n, how many pairs
favour each side, and the cost as ratios to the paired baseline (tokens/s, peak memory). The
tokens/s are each run's after its warm-up steps (`tokens_per_sec_after_warmup` of metrics.json,
docs/configuration.md): over the warm-up a ratio measures compilation and the kernel's first build.
A run too short for that has none, and its comparison then gives no tokens/s ratio and says why.
With one pair there is no interval; with fewer than two pairs but two or more runs on each
side, Welch's interval over the unpaired runs (`scipy.stats.ttest_ind(equal_var=False)`),
labelled "unpaired". Failed or unfinished jobs are left out and counted.

The rows are those of `summary.collect_rows`: each carries `config` (the overrides that
differ between the sweep's configurations, seed left out), `seed`, `status`, the metrics,
and `exact` / `match` (the configuration less the residual strategy's own keys, and less the
keys in `IGNORED_FOR_BASELINE` too), `is_baseline` (True for `residual=standard`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: keys a standard-residual run does not depend on: a Block run at any `optim.query_lr_scale`
#: pairs with the standard runs (which have no pseudo-queries) of an otherwise equal configuration
IGNORED_FOR_BASELINE = ("optim.query_lr_scale",)
HIGHER_IS_BETTER = ("val/accuracy",)
#: lm-eval task metrics (`<task>/<metric>`, attnres.results.task_verdicts) where higher is better:
#: accuracies, exact match, F1, MCC, pass@k, BLEU, ROUGE (with or without a filter suffix);
#: perplexities and bits per byte are lower-is-better, as the losses
TASK_HIGHER_IS_BETTER = ("acc", "exact_match", "em", "f1", "mcc", "pass@", "pass_at", "bleu", "rouge", "chrf")


def higher_is_better(metric: str) -> bool:
    """Whether a larger `metric` is the better one (val/accuracy, a task's accuracy)."""
    if metric in HIGHER_IS_BETTER:
        return True
    task, _, name = metric.rpartition("/")
    return bool(task) and not task.startswith(("val", "train")) and name.startswith(TASK_HIGHER_IS_BETTER)


@dataclass
class Comparison:
    """One configuration against its baseline, on `metric`."""

    label: str
    baseline: str | None
    metric: str
    method: str  # "paired t" | "Welch (unpaired)" | "one pair" | "no baseline" | "no runs"
    n: int = 0  # pairs (paired), or runs on the candidate's side (Welch)
    mean: float | None = None  # of d = candidate - baseline
    ci: tuple[float, float] | None = None
    p_value: float | None = None
    wins: int = 0  # pairs where the candidate is better
    losses: int = 0
    diffs: dict[Any, float] = field(default_factory=dict)  # seed -> d (paired)
    tokens_per_sec_ratio: float | None = None
    tokens_per_sec_note: str | None = None  # why there is no tokens/s ratio, when runs lack tokens/s
    peak_memory_ratio: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def lower_is_better(self) -> bool:
        return not higher_is_better(self.metric)

    @property
    def verdict(self) -> str:
        """better | worse | no clear difference (the interval spans 0) | no interval."""
        if self.ci is None:
            return "no interval"
        low, high = self.ci
        if low <= 0 <= high:
            return "no clear difference"
        below = high < 0
        return "better" if below == self.lower_is_better else "worse"

    def sentence(self) -> str:
        """One plain line, e.g. `block N=4 vs standard: better, -0.0210 val/bpb [-0.0300, -0.0120]
        (paired t, 3 seeds; lower is better), 3/3 seeds favour block N=4; 0.93x tokens/s`."""
        head = f"{self.label} vs {self.baseline or 'standard'}"
        direction = "lower is better" if self.lower_is_better else "higher is better"
        if self.method == "no baseline":
            return f"{head}: no baseline in this sweep (no residual=standard run of the same configuration)" + \
                self._notes()
        if self.mean is None:
            return f"{head}: no finished runs to compare" + self._notes()
        if self.method == "one pair":
            (seed, d), = self.diffs.items()
            text = f"{head}: {d:+.4f} {self.metric} on 1 seed (seed {seed}; {direction}): no interval"
        else:
            low, high = self.ci
            how = f"paired t, {self.n} seeds" if self.method == "paired t" else f"Welch, unpaired, {self.n} runs"
            text = (f"{head}: {self.verdict}, {self.mean:+.4f} {self.metric} [{low:+.4f}, {high:+.4f}] "
                    f"({how}; {direction})")
            if self.method == "paired t":
                text += f", {self.wins}/{self.n} seeds favour {self.label}"
        cost = [f"{value:.2f}x {name}" for value, name in ((self.tokens_per_sec_ratio, "tokens/s"),
                                                          (self.peak_memory_ratio, "peak memory")) if value]
        if self.tokens_per_sec_note:
            cost.append(self.tokens_per_sec_note)
        return text + ("; " + ", ".join(cost) if cost else "") + self._notes()

    def _notes(self) -> str:
        return f" ({'; '.join(self.notes)})" if self.notes else ""

    def columns(self) -> dict[str, Any]:
        """The comparison's columns of summary.csv."""
        return {
            "baseline": self.baseline, "method": self.method, "n": self.n, "mean_diff": self.mean,
            "ci_low": self.ci[0] if self.ci else None, "ci_high": self.ci[1] if self.ci else None,
            "p_value": self.p_value, "favour": f"{self.wins}/{self.n}" if self.method == "paired t" else None,
            "verdict": self.verdict if self.ci else None, "tokens_per_sec_ratio": self.tokens_per_sec_ratio,
            "peak_memory_ratio": self.peak_memory_ratio,
        }


COLUMNS = ("baseline", "diff", "method", "n", "mean_diff", "ci_low", "ci_high", "p_value", "favour", "verdict",
           "tokens_per_sec_ratio", "peak_memory_ratio")


def _usable(row: Mapping[str, Any], metric: str) -> bool:
    return row.get("status") == "finished" and _finite(row.get(metric))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _ratio(pairs: Iterable[tuple[Any, Any]]) -> float | None:
    """Mean of a / b over the pairs where both are known and b > 0."""
    ratios = [a / b for a, b in pairs if _finite(a) and _finite(b) and b > 0]
    return statistics.fmean(ratios) if ratios else None


def _mean_ratio(a: Sequence[Any], b: Sequence[Any]) -> float | None:
    a, b = [x for x in a if _finite(x)], [x for x in b if _finite(x)]
    return statistics.fmean(a) / statistics.fmean(b) if a and b and statistics.fmean(b) > 0 else None


#: what a comparison says when its runs have no tokens/s: metrics.json leaves it out of a run
#: too short to measure after its warm-up steps (a ratio over warm-up would be compile time)
NO_TOKENS_PER_SEC = "no tokens/s ratio: runs too short to measure throughput after their warm-up steps"
SPEED = "tokens_per_sec_after_warmup"  # the rows' key the tokens/s ratio reads


def _speed_note(runs: Iterable[Mapping[str, Any]], ratio: float | None) -> str | None:
    """Why a comparison of `runs` has no tokens/s ratio (or one over fewer pairs), if that is why."""
    missing = sum(1 for r in runs if not _finite(r.get(SPEED)))
    if not missing:
        return None
    return NO_TOKENS_PER_SEC if ratio is None else f"the tokens/s ratio leaves out {missing} run(s) too short"


def _t_interval(diffs: Sequence[float]) -> tuple[tuple[float, float], float | None]:
    from scipy import stats

    mean = statistics.fmean(diffs)
    if statistics.pstdev(diffs) == 0.0:  # identical differences: scipy divides by 0; the interval is the point
        return (mean, mean), None
    result = stats.ttest_1samp(diffs, 0.0)
    low, high = result.confidence_interval(0.95)
    return (float(low), float(high)), float(result.pvalue)


def _welch_interval(a: Sequence[float], b: Sequence[float]) -> tuple[tuple[float, float], float | None]:
    from scipy import stats

    if statistics.pstdev(a) == 0.0 and statistics.pstdev(b) == 0.0:
        d = statistics.fmean(a) - statistics.fmean(b)
        return (d, d), None
    result = stats.ttest_ind(a, b, equal_var=False)
    low, high = result.confidence_interval(0.95)
    return (float(low), float(high)), float(result.pvalue)


def compare(candidate: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]], metric: str,
            label: str, baseline_label: str | None) -> Comparison:
    """The comparison of one configuration's runs with its baseline's runs (section 6)."""
    comparison = Comparison(label=label, baseline=baseline_label, metric=metric, method="no runs")
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
    if len(seeds) >= 2 or (len(seeds) == 1 and not (len(cand) >= 2 and len(base) >= 2)):
        diffs = {s: float(cand[s][metric]) - float(base[s][metric]) for s in seeds}
        comparison.diffs, comparison.n = diffs, len(seeds)
        comparison.mean = statistics.fmean(diffs.values())
        comparison.wins = sum(1 for d in diffs.values() if sign * d < 0)
        comparison.losses = sum(1 for d in diffs.values() if sign * d > 0)
        if len(seeds) >= 2:
            comparison.method = "paired t"
            comparison.ci, comparison.p_value = _t_interval(list(diffs.values()))
        else:
            comparison.method = "one pair"
        comparison.tokens_per_sec_ratio = _ratio((cand[s].get(SPEED), base[s].get(SPEED)) for s in seeds)
        comparison.peak_memory_ratio = _ratio((cand[s].get("peak_memory_gib"), base[s].get("peak_memory_gib"))
                                              for s in seeds)
        comparison.tokens_per_sec_note = _speed_note([r for s in seeds for r in (cand[s], base[s])],
                                                     comparison.tokens_per_sec_ratio)
        if unmatched:
            comparison.notes.append(f"seed{'s' if len(unmatched) > 1 else ''} {', '.join(map(str, unmatched))} "
                                    "on one side only, left out")
    elif len(cand) >= 2 and len(base) >= 2:
        a, b = [float(r[metric]) for r in cand.values()], [float(r[metric]) for r in base.values()]
        comparison.method, comparison.n = "Welch (unpaired)", len(a)
        comparison.mean = statistics.fmean(a) - statistics.fmean(b)
        comparison.ci, comparison.p_value = _welch_interval(a, b)
        comparison.tokens_per_sec_ratio = _mean_ratio([r.get(SPEED) for r in cand.values()],
                                                      [r.get(SPEED) for r in base.values()])
        comparison.peak_memory_ratio = _mean_ratio([r.get("peak_memory_gib") for r in cand.values()],
                                                   [r.get("peak_memory_gib") for r in base.values()])
        comparison.tokens_per_sec_note = _speed_note([*cand.values(), *base.values()], comparison.tokens_per_sec_ratio)
        comparison.notes.append(f"no common seeds: {len(a)} vs {len(b)} runs")
    elif cand and base:
        comparison.notes.append(f"no seed in common: seeds {', '.join(map(str, sorted(cand, key=str)))} against "
                                f"{', '.join(map(str, sorted(base, key=str)))}")
    return comparison


def comparisons(rows: Sequence[Mapping[str, Any]], metric: str) -> list[Comparison]:
    """Every non-baseline configuration of `rows` against its baseline, in the rows' order."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if not str(row.get("status", "")).startswith("duplicate"):
            groups.setdefault(row["config"], []).append(row)
    baselines = {name: runs for name, runs in groups.items() if runs[0].get("is_baseline")}
    found = []
    for name, runs in groups.items():
        if name in baselines:
            continue
        match = _find_baseline(runs[0], baselines)
        found.append(compare(runs, baselines.get(match, []), metric, name, match))
    return found


def _find_baseline(row: Mapping[str, Any], baselines: Mapping[str, Sequence[Mapping[str, Any]]]) -> str | None:
    """The baseline group of an otherwise identical configuration: exactly equal first, then
    equal but for the keys in IGNORED_FOR_BASELINE; the first by name if several qualify."""
    for key in ("exact", "match"):
        hits = sorted(name for name, runs in baselines.items() if runs[0].get(key) == row.get(key))
        if hits:
            return hits[0]
    return None
