"""summary.png of a sweep: what each configuration changes, and how the runs got there.

Left: each configuration's difference from its paired standard-residual baseline (the mean,
its interval, a dot per seed), zero marked and the margin shaded, so a gap inside the seeds'
spread or inside the margin reads as one; each row names its verdict. Right: the validation
curves of the primary metric over steps, mean and min-max band over seeds, read from each
run's TensorBoard events (the `Val/...` tags the runner logs); a run that validated once (the
default at a few steps) is a point with its seeds' range as a bar.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnres.results.figures import new_figure, strategy_colours

#: a verdict's colour by its first word (verdict.margin_verdict): better, worse, equivalent; the rest grey
VERDICT_COLOURS = {"better": "#2a7d2a", "worse": "#b22222", "equivalent": "#1f5fa8"}
UNCLEAR = "#555555"


def verdict_colour(words: str) -> str:
    return VERDICT_COLOURS.get(words.split(" ", 1)[0].rstrip(",;:"), UNCLEAR)


def validation_curve(run_dir: Path, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, values) of `metric` (`val/bpb` -> tag `Val/bpb`) from a run's events, or None."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(run_dir)
    where = run_dir if any(run_dir.glob("events.out.tfevents.*")) else run_dir / "tb"
    if not where.is_dir():
        return None
    tag = "Val/" + metric.split("/", 1)[-1]
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # not "No path found after <file>" per run
    acc = EventAccumulator(str(where), size_guidance={"scalars": 0, "images": 1, "tensors": 1, "histograms": 1})
    try:
        acc.Reload()
        events = acc.Scalars(tag)
    except (KeyError, OSError, ValueError):
        return None
    last = {e.step: e.value for e in events}  # a resumed run may log a step twice: keep the last
    steps = np.array(sorted(last), dtype=np.int64)
    return steps, np.array([last[s] for s in steps], dtype=np.float64)


def config_curves(rows: Sequence[Mapping[str, Any]], metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Configuration -> (steps, (seeds, steps) values) on the steps every finished run logged."""
    per_config: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for row in rows:
        if row.get("status") != "finished" or not row.get("path"):
            continue
        curve = validation_curve(row["path"], metric)
        if curve is not None and len(curve[0]):
            per_config.setdefault(row["config"], []).append(curve)
    curves = {}
    for config, runs in per_config.items():
        common = sorted(set.intersection(*(set(steps.tolist()) for steps, _ in runs)))
        if common:
            values = np.stack([vals[np.searchsorted(steps, common)] for steps, vals in runs])
            curves[config] = (np.array(common), values)
    return curves


def summary_figure(comparisons: Sequence[Any], rows: Sequence[Mapping[str, Any]], metric: str, title: str):
    shown = [c for c in comparisons if c.mean is not None]
    curves = config_curves(rows, metric)
    height = max(3.6, 0.42 * len(shown) + 1.8)
    fig = new_figure(12.0, height)
    left, right = fig.add_gridspec(1, 2, width_ratios=[1.05, 1.0], wspace=0.45).subplots()
    _differences(left, shown, metric)
    _curves(right, curves, metric)
    fig.suptitle(f"{title}: {metric}", fontsize=10)
    fig.subplots_adjust(left=0.2, right=0.98, top=0.88, bottom=0.14)
    return fig


def tuned_verdicts_figure(tuned: Sequence[Any], shared: Sequence[Any], metric: str, title: str, panels: int):
    """summary.png of a tuned sweep: on the left both verdicts, each arm at its own best and, when
    the folder has those runs, every arm at the configured values; `panels` axes on the right for
    the search (tuning_figure.draw_search). Returns (figure, the search's axes)."""
    rows = [(c, "own best") for c in tuned if c.mean is not None] + \
        [(c, "configured") for c in shared if c.mean is not None]
    fig = new_figure(6.4 + 5.0 * panels, max(4.0, 0.6 * len(rows) + 2.2))
    axes = fig.add_gridspec(1, 1 + panels, width_ratios=[1.2] + [1.0] * panels, wspace=0.5).subplots()
    _differences(axes[0], [c for c, _ in rows], metric, stages=[stage for _, stage in rows])
    axes[0].set_title("each arm at its own best, and at the configured values:\nmean, interval, o: each seed, "
                      "shaded: the margin", fontsize=9)
    fig.suptitle(f"{title}: the verdicts ({metric}, verdict seeds) and the search", fontsize=10)
    fig.subplots_adjust(left=0.16, right=0.98, top=0.84, bottom=0.16)
    return fig, list(axes[1:])


def _differences(ax: Any, shown: Sequence[Any], metric: str, stages: Sequence[str] | None = None) -> None:
    ax.axvline(0.0, color="black", linewidth=0.9)
    if not shown:
        ax.text(0.5, 0.5, "no comparison: the sweep needs\nresidual=standard runs of the same configuration",
                ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_yticks([])
        return
    rng = np.random.default_rng(0)  # the same jitter on every redraw
    for y, c in enumerate(shown):
        colour = verdict_colour(c.verdict)
        if getattr(c, "margin", None):  # the differences that do not matter
            ax.fill_betweenx([y - 0.4, y + 0.4], -c.margin, c.margin, color="#999999", alpha=0.18, linewidth=0)
        if c.ci is not None:
            ax.errorbar([c.mean], [y], xerr=[[c.mean - c.ci[0]], [c.ci[1] - c.mean]], fmt="o", color=colour,
                        capsize=4, markersize=6, zorder=3)
        else:
            ax.plot([c.mean], [y], "o", color=colour, markersize=6, zorder=3)
        if c.diffs:
            d = np.array(list(c.diffs.values()))
            ax.scatter(d, y + rng.uniform(-0.12, 0.12, len(d)), s=14, facecolors="none", edgecolors=colour, zorder=4)
        tag = {"paired t": f"n={c.n}", "one pair": "1 seed", "Welch (unpaired)": f"unpaired n={c.n}"}.get(c.method, "")
        ax.annotate(tag, (1.0, y), xycoords=("axes fraction", "data"), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=7, color=UNCLEAR, annotation_clip=False)
    stages = stages or [""] * len(shown)
    ax.set_yticks(range(len(shown)), [f"{c.label} vs {c.baseline}" + (f" ({stage})" if stage else "") +
                                      f"\n{_wrapped(c.verdict)}" for c, stage in zip(shown, stages, strict=True)],
                  fontsize=7)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    better = "lower" if shown[0].lower_is_better else "higher"
    ax.set_xlabel(f"{metric} difference from the paired baseline ({better} is better)", fontsize=8)
    ax.set_title("mean, t interval, o: each seed, shaded: the margin", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)


def _wrapped(words: str, width: int = 34) -> str:
    """A verdict in lines of about `width` characters, for a tick label."""
    lines, line = [], ""
    for word in words.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


#: a curve of at most this many validations gets a marker at each
MARKED_POINTS = 12


def _curves(ax: Any, curves: Mapping[str, tuple[np.ndarray, np.ndarray]], metric: str) -> None:
    """Each configuration's validations over steps: the mean over seeds as a line (with markers when
    it has few points) and the seeds' min-max as a band. When every run validated once, a point per
    configuration with its seeds' range as a bar (`_last_values`). A legend only for what is drawn."""
    shown = {name: curve for name, curve in curves.items() if len(curve[0])}
    if not shown:
        ax.text(0.5, 0.5, f"no {metric} curves in the runs' events", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    names = sorted(shown)
    if all(len(steps) == 1 for steps, _ in shown.values()):
        _last_values(ax, {name: shown[name] for name in names}, metric)
        return
    from matplotlib.ticker import MaxNLocator

    for name, colour in zip(names, strategy_colours(names), strict=True):
        steps, values = shown[name]
        few = len(steps) <= MARKED_POINTS
        ax.plot(steps, values.mean(axis=0), color=colour, linewidth=1.4, marker="o" if few else None, markersize=4,
                label=f"{name} ({len(values)})")
        if len(values) > 1:
            ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color=colour, alpha=0.18, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(metric, fontsize=8)
    ax.set_title("validation: mean over seeds, band min-max (n seeds)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)


def _last_values(ax: Any, curves: Mapping[str, tuple[np.ndarray, np.ndarray]], metric: str) -> None:
    """Runs that validated once (a few steps, the default validation interval): no curve to draw, so
    one column per configuration, its mean over seeds as a point and their min-max as a bar."""
    names = list(curves)
    for x, (name, colour) in enumerate(zip(names, strategy_colours(names), strict=True)):
        _, values = curves[name]
        mean = values.mean(axis=0)
        ax.errorbar([x], mean, yerr=[mean - values.min(axis=0), values.max(axis=0) - mean], fmt="o", color=colour,
                    markersize=6, capsize=4, linewidth=1.2, label=f"{name} ({len(values)})")
    ax.set_xticks(range(len(names)), [f"{name}\n({len(curves[name][1])} seeds)" for name in names], fontsize=8)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylabel(metric, fontsize=8)
    steps = sorted({int(steps[0]) for steps, _ in curves.values()})
    at = f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))
    ax.set_title(f"validation (once, at {at}): mean over seeds, bar min-max", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", alpha=0.3)
