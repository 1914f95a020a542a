"""The search of a tuned sweep as a figure (tuning.png, and the right of its summary.png): for each
arm, the selection metric against each searched value, one point per tuning seed, their mean as a
line, the chosen value starred; a grid that grew at an edge shows its added points, and a choice
still on the edge is drawn hollow (white inside, ringed) and named in the legend. A trial without a
full-length value is marked where it ran: a cross at the panel's top when it diverged or failed, a
hollow triangle at its bottom when successive halving stopped it at a rung.

Arms whose means nearly coincide (standard and Block within 0.001 of each other) would draw one line
over the other, so that one arm looked never run: each arm gets its own line style and marker, and
its points are set a little aside from the others' (`DODGE` of a grid step, on the log axis)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnres.results import tuning
from attnres.results.figures import new_figure, strategy_colours


def search_keys(state: Mapping[str, Any]) -> list[str]:
    """The searched keys, in order (a grid's keys; an Optuna study's space)."""
    keys: list[str] = []
    for group in state.get("groups", []):
        for trial in group.get("trials", []):
            for key in trial.get("values") or {}:
                if key not in keys:
                    keys.append(key)
    return keys


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")
DODGE = 0.12  # each arm's points set aside by this share of a factor-2 grid step (log x), centred on the value


def arm_styles(count: int) -> list[tuple[str, str, float]]:
    """(line style, marker, x factor) of each of `count` arms: no two alike, the offsets centred on 1."""
    return [(LINE_STYLES[i % len(LINE_STYLES)], MARKERS[i % len(MARKERS)], 2 ** (DODGE * (i - (count - 1) / 2)))
            for i in range(count)]


def draw_search(axes: Sequence[Any], state: Mapping[str, Any]) -> None:
    """One panel per searched key: each arm's trials (points), their mean (line), the choice (star)."""
    metric = state.get("signature", {}).get("metric", "val/loss")
    grid = state.get("signature", {}).get("method", "grid") == "grid"  # optuna: each trial moves every key
    seeds = state.get("tuning_seeds", [])
    groups = state.get("groups", [])
    colours = dict(zip([g["label"] for g in groups], strategy_colours([g["label"] for g in groups]), strict=True))
    styles = dict(zip([g["label"] for g in groups], arm_styles(len(groups)), strict=True))
    for ax, key in zip(axes, search_keys(state), strict=False):
        ticks: set[float] = set()
        for group in groups:
            colour = colours[group["label"]]
            style, marker, aside = styles[group["label"]]
            trials = [t for t in group.get("trials", []) if key in (t.get("values") or {})]
            if not trials:
                continue
            xs = np.array([float(t["values"][key]) for t in trials])
            ticks.update(xs.tolist())
            ys = np.array([tuning.trial_value(t) for t in trials])
            finite = np.isfinite(ys)
            pruned = np.array([t.get("status") == "pruned" for t in trials])
            ax.scatter(xs[finite] * aside, ys[finite], s=14, color=colour, alpha=0.55, zorder=3, marker=marker)
            _edge_marks(ax, xs[~finite & ~pruned] * aside, 0.97, dict(marker="x", color=colour, s=30),
                        "diverged or failed")
            _edge_marks(ax, xs[pruned] * aside, 0.03, dict(marker="^", facecolors="none", edgecolors=colour, s=26),
                        "stopped at a rung")
            means = tuning.point_means(trials, seeds)
            points = sorted(means, key=lambda p: _x(trials, p, key))
            line = [(_x(trials, p, key) * aside, means[p]) for p in points if math.isfinite(means[p])]
            label = group["label"]
            chosen = group.get("chosen")
            if chosen is not None and any(t["point"] == chosen for t in trials):
                cx, cy = _x(trials, chosen, key), means.get(chosen)
                edge = group.get("edge") if group.get("edge_key") in (None, key) else None
                hollow = edge is not None
                # hollow: white inside (an unfilled star showed the line through it and read as filled)
                ax.scatter([cx * aside], [cy], marker="*", s=240 if hollow else 170, zorder=5, edgecolors=colour,
                           facecolors="white" if hollow else colour, linewidths=2.0 if hollow else 1.4)
                label += f": {tuning.format_value(cx)}" + (f" (at the {'upper' if edge == 'up' else 'lower'} "
                                                            "edge)" if hollow else "")
            if line and grid:
                ax.plot(*zip(*line, strict=True), color=colour, linewidth=1.6, label=label, zorder=4, linestyle=style,
                        marker=marker, markersize=4, markerfacecolor="white")
            elif line:  # a trial's mean over seeds; no line: neighbouring trials differ in the other keys too
                ax.scatter(*zip(*line, strict=True), color=colour, s=36, marker="D", label=label, zorder=4)
        ax.set_xscale("log")
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.xaxis.set_minor_formatter(NullFormatter())  # log minor labels overlap on a narrow range
        if grid and 0 < len(ticks) <= 12:  # the searched values themselves, not log decades
            ax.set_xticks(sorted(ticks), [tuning.format_value(x) for x in sorted(ticks)], rotation=30)
        elif ticks:  # trials anywhere in a range: four ticks across it, two significant digits
            low, high = min(ticks), max(ticks)
            marks = sorted({float(f"{x:.2g}") for x in np.geomspace(low, high, 4)}) if high > low > 0 else [low]
            ax.set_xticks(marks, [tuning.format_value(x) for x in marks], rotation=30)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: tuning.format_value(x)))
        ax.set_xlabel(key, fontsize=8)
        ax.set_ylabel(f"{metric} (tuning seeds {', '.join(map(str, seeds))})", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="mean over seeds; * chosen" if grid else "a trial's mean over seeds; * chosen",
                  title_fontsize=7)
    for ax in axes[len(search_keys(state)):]:
        ax.set_visible(False)


def _edge_marks(ax: Any, xs: np.ndarray, at: float, style: Mapping[str, Any], what: str) -> None:
    """Trials without a full-length value, marked at a height of the panel (`at`, axes fraction:
    0.97 the top, 0.03 the bottom) above their x: their metric would be off the scale (a
    divergence) or not comparable (a successive-halving trial's loss at an earlier rung), but that
    they ran, and where, shows. The legend names each kind once."""
    if not len(xs):
        return
    named = any(c.get_label() == what for c in ax.collections)
    ax.scatter(xs, np.full(len(xs), at), transform=ax.get_xaxis_transform(), zorder=3, clip_on=False,
               label="_" + what if named else what, **style)


def _x(trials: Sequence[Mapping[str, Any]], point: Any, key: str) -> float:
    return next(float(t["values"][key]) for t in trials if t["point"] == point)


def search_figure(state: Mapping[str, Any], title: str):
    keys = search_keys(state) or ["(no trials)"]
    fig = new_figure(5.2 * len(keys), 4.2)
    axes = np.atleast_1d(fig.add_gridspec(1, len(keys), wspace=0.3).subplots())
    draw_search(list(axes), state)
    fig.suptitle(f"{title}: the search, each arm on its tuning seeds", fontsize=10)
    fig.subplots_adjust(left=0.1, right=0.98, top=0.86, bottom=0.16)
    return fig

