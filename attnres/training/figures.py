"""The dashboard figures, drawn once for TensorBoard and for `experiments/plot_run.py`.

Every function takes numpy arrays and plain labels and returns a matplotlib `Figure` on an
Agg canvas (no pyplot, no global backend switch, nothing left open). `render(tag, data,
meta, step)` is the single entry point both callers use, so a PNG from `plot_run.py` and
the image in TensorBoard are the same picture, pixel for pixel.

matplotlib is imported inside the functions: `import attnres.training` stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
# image tag -> tag of the raw array it is drawn from (logged beside it as a tensor summary)
FIGURE_TAGS = {"depth/heatmap": "depth/heatmap_data", "magnitude/plot": "magnitude/plot_data",
               "grad_norm/plot": "grad_norm/plot_data"}
ATTN_COLOUR, MLP_COLOUR = "#1f4e9c", "#b35900"
CELL_W, CELL_H = 0.5, 0.3  # inches per heatmap cell: room for "0.25" in 8 pt
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#e377c2", "#7f7f7f", "#bcbd22")
ANNOTATE_MAX = 40  # annotate cell values up to this many rows and columns (Full AttnRes at L = 38)


# -- labels -------------------------------------------------------------------------------------
def sublayer_label(index: int, num_sublayers: int) -> str:
    """'L3 mlp' for sublayer 7; 'output' for the output aggregation (index == L)."""
    if index == num_sublayers:
        return "output"
    return f"L{index // 2} {'attn' if index % 2 == 0 else 'mlp'}"


def sublayer_tag(index: int, num_sublayers: int) -> str:
    """'L03_mlp' for sublayer 7 (zero-padded so TensorBoard sorts by depth); 'output'."""
    if index == num_sublayers:
        return "output"
    return f"L{index // 2:02d}_{'attn' if index % 2 == 0 else 'mlp'}"


# -- the three figures --------------------------------------------------------------------------
def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def heatmap_figsize(rows: int, cols: int) -> tuple[float, float]:
    """Inches (width, height) of the heatmap of a rows x cols grid; times DPI = pixels."""
    cell_w = CELL_W if cols <= ANNOTATE_MAX else max(0.15, 20.0 / cols)
    cell_h = CELL_H if rows <= ANNOTATE_MAX else max(0.12, 12.0 / rows)
    left, right, top, bottom = _heatmap_margins(cols)
    return max(6.4, left + right + cols * cell_w), max(3.6, top + bottom + rows * cell_h)


def _heatmap_margins(cols: int) -> tuple[float, float, float, float]:
    """Inches left (row labels), right (colour bar), top (title), bottom (column labels)."""
    return 1.1, 1.3, 0.75, 0.6 if cols <= 8 else 1.15


def depth_heatmap(
    weights: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], title: str, xlabel: str = "source"
) -> Figure:
    """weights: (rows, cols), row r = one sublayer's depth weights averaged over tokens, NaN where
    that sublayer has no such source. Colour scale fixed to [0, 1]; rows labelled and coloured
    by kind (attention / MLP); a white rule between Transformer layers, a black one above the
    output aggregation; cell values printed (2 decimals) when the grid is at most ANNOTATE_MAX."""
    import matplotlib

    R, C = weights.shape
    width, height = heatmap_figsize(R, C)
    fig = _new_figure(width, height)
    left, right, top, bottom = _heatmap_margins(C)
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6")
    image = ax.imshow(np.ma.masked_invalid(weights), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(C), col_labels, rotation=0 if C <= 8 else 90, fontsize=8)
    ax.set_yticks(range(R), row_labels, fontsize=8)
    ax.tick_params(length=0)
    for tick, label in zip(ax.get_yticklabels(), row_labels, strict=True):
        tick.set_color(ATTN_COLOUR if "attn" in label else MLP_COLOUR if "mlp" in label else "black")
        if label == "output":
            tick.set_fontweight("bold")
    for r in range(2, R - 1, 2):  # between Transformer layers (after each MLP row)
        ax.axhline(r - 0.5, color="white", linewidth=2.0)
    if R > 1 and row_labels[-1] == "output":
        ax.axhline(R - 1.5, color="black", linewidth=2.5)
    if R <= ANNOTATE_MAX and C <= ANNOTATE_MAX:
        for (r, c), value in np.ndenumerate(weights):
            if not math.isnan(value):
                ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=7.5,
                        color="white" if value < 0.55 else "black")
    ax.set_xlabel(xlabel, fontsize=9)
    _title(fig, title)
    cax = fig.add_axes(((width - right + 0.25) / width, bottom / height, 0.18 / width, 1 - (top + bottom) / height))
    fig.colorbar(image, cax=cax).set_label("weight (mean over tokens)", fontsize=8)
    return fig


def depth_profile(
    series: Mapping[str, np.ndarray], xlabels: Sequence[str], title: str, ylabel: str, xlabel: str
) -> Figure:
    """One line per series over depth (x = sublayer or layer, labelled by `xlabels`); attention
    points drawn as circles, MLP points as squares, others as diamonds. Log y axis when the
    values span more than a factor of 10, else linear from 0."""
    n = len(xlabels)
    longest = max((len(s) for s in xlabels), default=1)
    vertical = longest > 3
    width, height = max(6.4, 2.2 + 0.34 * n), 4.4 + (0.07 * longest if vertical else 0.0)
    fig = _new_figure(width, height)
    left, right, top, bottom = 0.95, 0.3, 0.75, 0.55 + (0.075 * longest if vertical else 0.15)
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height))
    x = np.arange(n)
    attn = np.array(["attn" in s for s in xlabels])
    mlp = np.array(["mlp" in s for s in xlabels])
    masks = [attn, mlp, ~(attn | mlp)]
    everything = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in series.values()])
    finite = everything[np.isfinite(everything)]
    for colour, (name, values) in zip(_COLOURS, series.items(), strict=False):
        values = np.asarray(values, dtype=np.float64)
        ax.plot(x, values, color=colour, linewidth=1.5, label=name)
        for marker, keep in zip("osD", masks, strict=True):
            if keep.any():
                ax.scatter(x[keep], values[keep], color=colour, marker=marker, s=24, zorder=3)
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > 10:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.3, not 3 x 10^-1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        decades = math.log10(finite.max() / finite.min())
        ax.yaxis.set_minor_formatter(plain if decades < 3 else NullFormatter())
    else:
        ax.set_ylim(bottom=0.0, top=(finite.max() * 1.1 if finite.size and finite.max() > 0 else 1.0))
    ax.set_xticks(x, xlabels, rotation=90 if vertical else 0, fontsize=8)
    for tick, label in zip(ax.get_xticklabels(), xlabels, strict=True):
        tick.set_color(ATTN_COLOUR if "attn" in label else MLP_COLOUR if "mlp" in label else "black")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _title(fig, title)
    return fig


def _title(fig: Figure, title: str) -> None:
    """Title lines at the top left of the figure (not the axes: long titles never get cut)."""
    fig.text(0.1 / fig.get_figwidth(), 1 - 0.12 / fig.get_figheight(), title, ha="left", va="top", fontsize=10)


# -- one entry point for both callers ----------------------------------------------------------
def render(tag: str, data: np.ndarray, meta: Mapping[str, Any], step: int) -> Figure:
    """The figure logged under image `tag` (a key of FIGURE_TAGS), drawn from its raw array and
    the metadata logged with it ({"strategy": str, "rows"/"cols" or "labels": [str], "sources": str})."""
    name = meta["strategy"]
    if tag == "depth/heatmap":
        title = f"{name}, step {step}\ndepth-attention weights, mean over tokens (row: sublayer, column: source)"
        xlabel = meta.get("sources", "source")
        return depth_heatmap(np.asarray(data, dtype=np.float64), meta["rows"], meta["cols"], title, xlabel)
    if tag == "magnitude/plot":
        series = {"input RMS (what the sublayer reads)": data[0], "output RMS (what it writes)": data[1]}
        title = f"{name}, step {step}\nmagnitude of each sublayer's input and output"
        return depth_profile(series, meta["labels"], title, "RMS over D, mean over tokens", "sublayer (depth)")
    if tag == "grad_norm/plot":
        title = f"{name}, step {step}\ngradient norm of each Transformer layer's parameters (before clipping)"
        return depth_profile({"gradient norm": data}, meta["labels"], title, "L2 norm of the layer's gradients",
                             "Transformer layer (depth)")
    raise ValueError(f"no figure for tag {tag!r}; known: {', '.join(FIGURE_TAGS)}")


def to_rgb(fig: Figure) -> np.ndarray:
    """(H, W, 3) uint8 pixels of the figure; H, W = figsize * DPI."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_png(fig: Figure, path: Any) -> None:
    fig.savefig(path, dpi=DPI, format="png")
