"""tuning.png (attnres/results/tuning_figure.py): two arms whose means nearly coincide both show,
and a choice on the grid's edge reads as hollow. Issue "The first hour, round two", item 6."""

from __future__ import annotations

import numpy as np
from matplotlib.colors import to_rgba

from attnres.results.tuning_figure import search_figure

LRS = [0.0015, 0.003, 0.006, 0.012, 0.024]


def _state() -> dict:
    groups = []
    for label, shift, chosen, edge in (("standard", 0.0, 4, "up"), ("block N=2", 0.001, 3, None)):
        trials = [{"point": p, "seed": seed, "values": {"optim.optimizer.lr": lr},
                   "value": 3.0 - 0.1 * p + shift + 0.0001 * seed}
                  for p, lr in enumerate(LRS) for seed in (1000, 1001)]
        groups.append({"label": label, "trials": trials, "chosen": chosen, "edge": edge,
                       "edge_key": "optim.optimizer.lr" if edge else None})
    return {"signature": {"metric": "val/loss", "method": "grid"}, "tuning_seeds": [1000, 1001], "groups": groups}


def test_two_arms_with_nearly_equal_means_both_show_and_an_edge_choice_is_hollow():
    fig = search_figure(_state(), "quick")
    ax = fig.axes[0]
    lines = {line.get_label().split(":")[0]: line for line in ax.lines}
    standard, block = lines["standard"], lines["block N=2"]
    assert standard.get_linestyle() != block.get_linestyle()  # one lay exactly under the other
    assert standard.get_marker() != block.get_marker()
    assert np.all(np.asarray(standard.get_xdata()) != np.asarray(block.get_xdata()))  # set a little aside
    ratio = np.asarray(block.get_xdata()) / np.asarray(standard.get_xdata())
    assert np.all((ratio > 1.02) & (ratio < 1.2))  # aside, but well within a grid step (a factor 2)
    stars = [c for c in ax.collections if len(c.get_offsets()) == 1 and c.get_sizes()[0] >= 170]
    assert len(stars) == 2
    hollow = next(c for c in stars if tuple(c.get_facecolors()[0]) != tuple(c.get_edgecolors()[0]))
    assert tuple(hollow.get_facecolors()[0]) == to_rgba("white")  # opaque white: the line does not show through
    assert "(at the upper edge)" in standard.get_label()


def test_trials_without_a_full_length_value_are_marked_where_they_ran():
    """A diverged trial (no value) and two stopped at a rung (successive halving) have no point on the
    metric's scale; each is marked at its x, a cross at the panel's top and a triangle at its bottom,
    and each kind is named once in the legend. Before, a NaN height drew nothing."""
    state = _state()
    trials = state["groups"][0]["trials"]
    trials[0].update(value=None, status="diverged")  # lr 0.0015, seed 1000
    for t in trials[2:4]:  # lr 0.003, both seeds
        t.update(value=None, status="pruned", pruned_at=200, rungs={"200": 3.4})
    state["groups"][1]["trials"][2].update(value=None, status="pruned", pruned_at=200, rungs={"200": 3.5})
    ax = search_figure(state, "quick").axes[0]
    marks = {}
    for c in ax.collections:
        if c.get_offset_transform() == ax.get_xaxis_transform() and len(c.get_offsets()):
            marks.setdefault(c.get_label().lstrip("_"), []).append(np.asarray(c.get_offsets()))
    assert set(marks) == {"diverged or failed", "stopped at a rung"}
    top, = marks["diverged or failed"]
    assert top.shape == (1, 2) and top[0, 1] == 0.97 and 0.0015 * 0.9 < top[0, 0] < 0.0015 * 1.1
    bottom = np.concatenate(marks["stopped at a rung"])
    assert bottom.shape == (3, 2) and np.all(bottom[:, 1] == 0.03)
    assert np.all((bottom[:, 0] > 0.003 * 0.9) & (bottom[:, 0] < 0.003 * 1.1))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend.count("diverged or failed") == 1 and legend.count("stopped at a rung") == 1
