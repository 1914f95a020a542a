"""REPORT.md's "Training length": did the curves of the deep and shallow shapes flatten, and did
every run get 20 tokens per parameter (STUDY_PLAN.md's criterion, set before the runs)?"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from study import METRIC, Run, finished, save

from attnres.results import figures
from attnres.results.summary_figure import validation_curve

FLAT = 1.0  # percent: "flattened" when the last 20% of steps lower val/loss by less than this


def part_length(runs: Sequence[Run], figs: Path) -> list[str]:
    configs = sorted({(r.shape, r.strategy) for r in runs if r.shape in ("deep", "shallow")})
    lines = [f"A configuration is trained long enough here when the last 20% of its steps lower val/loss by less "
             f"than {FLAT:g}% (relative, the mean over its seeds) and every run gets at least 20 tokens per parameter "
             "(all parameters, the embedding included); the curves below show the flattening.", "",
             "| shape | strategy | seeds | tokens per parameter | drop over the last 20% of steps (mean, max) |",
             "|---|---|---|---|---|"]
    worst: list[tuple[float, float, float]] = []  # per configuration: mean and largest drop, fewest tokens/parameter
    fig = figures.new_figure(8.0, 4.2)
    axes = fig.subplots(1, 2, sharey=False)
    colours = {"standard": "#555555", "full": "#b22222"}
    for shape, strategy in configs:
        got = list(finished(runs, shape, strategy).values())
        curves = [c for c in (validation_curve(r.path, METRIC) for r in got) if c is not None and len(c[0]) >= 5]
        if not curves:
            continue
        drops = []
        for steps, values in curves:
            at = int(np.searchsorted(steps, 0.8 * steps[-1]))
            drops.append(100 * (values[at] - values[-1]) / values[at])
        ratio = statistics.fmean(r.tokens / r.parameters for r in got if r.parameters)
        worst.append((statistics.fmean(drops), max(drops), min(r.tokens / r.parameters for r in got if r.parameters)))
        lines.append(f"| {shape} | {strategy} | {len(got)} | {ratio:.1f} | {statistics.fmean(drops):.2f}%, "
                     f"{max(drops):.2f}% |")
        common = sorted(set.intersection(*(set(s.tolist()) for s, _ in curves)))
        mean = np.mean([v[np.searchsorted(s, common)] for s, v in curves], axis=0)
        ax = axes[0 if shape == "deep" else 1]
        ax.plot(common, mean, label=strategy, color=colours.get(strategy), lw=1.4)
    for ax, shape in zip(axes, ("deep (8 x 40)", "shallow (2 x 80)"), strict=True):
        ax.set_title(f"{shape}: val/loss, mean over seeds", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(top=min(ax.get_ylim()[1], 5.0))
        if ax.lines:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = save(fig, figs / "curves.png")
    if worst:
        mean, largest, tokens = (max(w[0] for w in worst), max(w[1] for w in worst), min(w[2] for w in worst))
        met = mean < FLAT and tokens >= 20
        lines += ["", f"{'Every' if met else 'Not every'} configuration meets both (the criterion applies to a "
                      f"configuration's mean over seeds, as STUDY_PLAN.md set it before the runs): the largest mean "
                      f"drop over the last 20% of steps is {mean:.2f}% (the largest of any one run {largest:.2f}%), "
                      f"the fewest tokens per parameter {tokens:.1f}."]
    return lines + ["", f"![validation curves]({png})"]

