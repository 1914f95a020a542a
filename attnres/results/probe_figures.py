"""The routing probes' figures (`attnres.probes`): which sources each sublayer uses, and which
sublayers the model uses, drawn once for TensorBoard and for `experiments/probe_routing.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure
from attnres.results.figures import (
    ANNOTATE_ALL,
    cell_text,
    depth_profile,
    heatmap_annotations,
    heatmap_cell,
    heatmap_margins,
    label_grid,
    new_figure,
    put_title,
)

# -- routing probes (attnres.probes) ------------------------------------------------------------
# image tag -> tag of the raw array it is drawn from; `render_probe` draws them
PROBE_TAGS = {"probe/routing": "probe/routing_data", "probe/layer_knockout": "probe/layer_knockout_data"}
EFFECT_CMAP = "RdBu_r"  # red: the model needs the source (loss rises without it); blue: better without
EFFECT_LINEAR = 300  # the knock-out colour scale is linear within +-limit / this, logarithmic beyond


def _effect_text(value: float) -> str:
    """'+.012', '-.25', '+1.3': three decimals below 0.1, two below 1, one above; no leading zero;
    '0' for what rounds to zero."""
    if abs(value) < 0.0005:
        return "0"
    digits = 3 if abs(value) < 0.1 else 2 if abs(value) < 1 else 1
    text = f"{value:+.{digits}f}"
    return text.replace("0.", ".", 1) if abs(value) < 1 else text


def _grid_axes(ax: Any, grid: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], cmap: Any,
               norm: Any, text: Any, fontscale: float = 1.0, diverging: bool = False) -> Any:
    """One heatmap panel as `depth_heatmap` draws it (labels coloured by kind, rules between
    layers and above the output, values in the cells where they fit); returns the image.
    `diverging`: white text on both dark ends of the scale, not only on the low one."""
    R, C = grid.shape
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    label_grid(ax, R, C, row_labels, col_labels)
    annotations = heatmap_annotations(R, C)
    if annotations is not None and C <= ANNOTATE_ALL:
        fontsize = annotations[0] * fontscale
        for (r, c), value in np.ndenumerate(grid):
            if math.isfinite(value):
                shade = float(image.norm(value))
                dark = (shade < 0.2 or shade > 0.8) if diverging else value < 0.55
                ax.text(c, r, text(value), ha="center", va="center", fontsize=fontsize,
                        color="white" if dark else "black")
    return image


def routing_figure(
    mass: np.ndarray, effect: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], title: str,
    xlabel: str = "source", effect_limit: float | None = None, rank: np.ndarray | None = None,
    top: np.ndarray | None = None,
) -> Figure:
    """Mass beside effect: left the depth-attention weights (rows: sublayers, columns: sources,
    as `depth_heatmap`, colour scale [0, 1]); middle the change in loss when that source is
    knocked out of that row, with the same rows and columns, on a diverging colour scale to
    +-`effect_limit` (default: the largest |effect|; give one limit to every run of a sweep so
    that colours compare), symmetric-logarithmic (linear within +-limit/EFFECT_LINEAR) because
    effects span orders of magnitude; right, aligned with the rows, each row's rank correlation
    between mass and effect (`rank`, in [-1, 1]) and whether its largest-mass source is also its
    largest effect (`top`: filled dot yes, open dot no). NaN cells are grey: sources a row does
    not have, and rows of a single source (nothing to knock out)."""
    import matplotlib
    from matplotlib.colors import Normalize, SymLogNorm

    R, C = mass.shape
    finite = np.abs(effect[np.isfinite(effect)])
    limit = effect_limit if effect_limit else (float(finite.max()) if finite.size and finite.max() > 0 else 1.0)
    cell_w, cell_h = heatmap_cell(C), heatmap_cell(R)
    left, right, top_m, bottom = heatmap_margins(C)
    top_m += 0.25  # a two-line title
    grid_w, grid_h = C * cell_w, max(R * cell_h, 2.4)
    gap = left + 0.25  # the middle panel repeats the row labels
    rank_w = 1.5
    width = left + grid_w + right + gap + grid_w + right + 0.5 + rank_w + 0.3
    height = top_m + bottom + grid_h
    fig = new_figure(width, height)
    y0, h = bottom / height, grid_h / height
    x_mass = left
    x_effect = x_mass + grid_w + right + gap
    x_rank = x_effect + grid_w + right + 0.5
    grey = "#e6e6e6"
    ax_m = fig.add_axes((x_mass / width, y0, grid_w / width, h))
    image_m = _grid_axes(ax_m, mass, row_labels, col_labels, matplotlib.colormaps["viridis"].with_extremes(bad=grey),
                         Normalize(0.0, 1.0), cell_text)
    ax_m.set_xlabel(xlabel, fontsize=8)
    ax_m.set_title("depth-attention mass (mean weight over tokens)", fontsize=9, loc="left")
    cax = fig.add_axes(((x_mass + grid_w + 0.25) / width, y0, 0.18 / width, h))
    fig.colorbar(image_m, cax=cax).set_label("weight", fontsize=8)
    ax_e = fig.add_axes((x_effect / width, y0, grid_w / width, h))
    image_e = _grid_axes(ax_e, effect, row_labels, col_labels,
                         matplotlib.colormaps[EFFECT_CMAP].with_extremes(bad=grey),
                         SymLogNorm(limit / EFFECT_LINEAR, vmin=-limit, vmax=limit, base=10), _effect_text,
                         fontscale=0.85, diverging=True)
    ax_e.set_xlabel(xlabel, fontsize=8)
    ax_e.set_title("effect: change in loss when the source is knocked out", fontsize=9, loc="left")
    cax = fig.add_axes(((x_effect + grid_w + 0.25) / width, y0, 0.18 / width, h))
    linear = limit / EFFECT_LINEAR
    decades = [10.0**k for k in range(math.ceil(math.log10(linear)), math.floor(math.log10(limit)) + 1)]
    bar = fig.colorbar(image_e, cax=cax, ticks=[*(-d for d in reversed(decades)), 0.0, *decades])
    bar.ax.set_yticklabels([f"{-d:g}" for d in reversed(decades)] + ["0"] + [f"+{d:g}" for d in decades])
    bar.set_label(f"loss(knocked out) - loss (nats)\nlinear within \u00b1{linear:.1g}, log beyond", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    ax_r = fig.add_axes((x_rank / width, y0, rank_w / width, h), sharey=ax_m)
    rank = np.full(R, np.nan) if rank is None else np.asarray(rank, dtype=np.float64)
    top = np.full(R, np.nan) if top is None else np.asarray(top, dtype=np.float64)
    rows = np.arange(R)
    ok = np.isfinite(rank)
    ax_r.barh(rows[ok], rank[ok], height=0.6, color=["#b2182b" if v < 0 else "#2166ac" for v in rank[ok]])
    for r in rows:
        if ok[r]:
            ax_r.text(rank[r] + (0.05 if rank[r] >= 0 else -0.05), r, cell_text(abs(rank[r])) if rank[r] >= 0
                      else "-" + cell_text(-rank[r]), ha="left" if rank[r] >= 0 else "right", va="center", fontsize=7)
        else:
            ax_r.text(0.05, r, "< 3 sources", ha="left", va="center", fontsize=7, color="grey")
    for r in rows[np.isfinite(top)]:
        ax_r.scatter([1.25], [r], s=22, marker="o", color="black", facecolors="black" if top[r] else "none",
                     clip_on=False, zorder=3)
    ax_r.axvline(0.0, color="black", linewidth=0.8)
    ax_r.set_xlim(-1.25, 1.4)
    ax_r.set_xticks([-1, 0, 1], ["-1", "0", "1"], fontsize=8)
    ax_r.tick_params(axis="y", left=False, labelleft=False)
    ax_r.set_xlabel("bar: rank correlation\ndot: top source agrees (filled)", fontsize=8)
    ax_r.set_title("mass vs effect", fontsize=9, loc="left")
    ax_r.grid(True, axis="x", alpha=0.3)
    put_title(fig, title)
    return fig


def render_probe(tag: str, data: np.ndarray, meta: Mapping[str, Any], step: int) -> Figure:
    """The figure logged under probe image `tag` (a key of PROBE_TAGS), from its raw array and
    metadata: "probe/routing" data (4, R, C) = mass, effect, then the rank correlation and the
    top agreement in column 0 of planes 2 and 3; "probe/layer_knockout" data (L,). Meta:
    {"strategy", "rows", "cols", "sources", "mode", "clean_loss", "tokens", "effect_limit"} or
    {"strategy", "labels", "mode", "clean_loss", "tokens"}."""
    name, mode = meta["strategy"], meta.get("mode", "remove")
    on = f"{meta.get('tokens', '?')} tokens, loss {meta.get('clean_loss', float('nan')):.4f}"
    if tag == "probe/routing":
        how = "removed, weights renormalised" if mode == "remove" else "replaced by its mean over tokens"
        title = f"{name}, step {step}: which sources does each sublayer use? ({on})\nknock-out: the source {how}"
        return routing_figure(data[0], data[1], meta["rows"], meta["cols"], title, meta.get("sources", "source"),
                              meta.get("effect_limit"), rank=data[2][:, 0], top=data[3][:, 0])
    if tag == "probe/layer_knockout":
        title = (f"{name}, step {step}: which sublayers does the model use?\n"
                 f"change in loss when one sublayer's output is removed ({on})")
        return depth_profile({"layer knock-out": data}, meta["labels"], title, "loss(without it) - loss (nats)",
                             "sublayer removed (depth)", signed=True)
    raise ValueError(f"no probe figure for tag {tag!r}; known: {', '.join(PROBE_TAGS)}")


