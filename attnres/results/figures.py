"""The dashboard figures, drawn once for TensorBoard and for `attnres-plot`.

Every function takes numpy arrays and plain labels and returns a matplotlib `Figure` on an
Agg canvas (no pyplot, no global backend switch, nothing left open). `render(tag, data,
meta, step)` is the single entry point both callers use, so a PNG from `plot_run.py` and
the image in TensorBoard are the same picture, pixel for pixel.

matplotlib is imported inside the functions: importing these modules stays fast.
The routing probes' figures are in `probe_figures.py`.
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
LEGEND_TITLE = "run (colour: strategy)"  # of compare_profiles
ATTN_COLOUR, MLP_COLOUR = "#1f4e9c", "#b35900"
# Heatmap cells shrink as the grid grows (side 1.5 / sqrt(n) inches, within [CELL_MIN, CELL_MAX]),
# so the grid grows like sqrt(n): small grids get room for their numbers and large ones stay a
# size whose colours still read when TensorBoard scales the image down to its card.
CELL_MAX, CELL_MIN, CELL_SCALE = 0.5, 0.14, 1.5
ANNOTATE_ALL = 17  # print every cell's value up to this many columns (Full AttnRes at 16 sublayers)
ANNOTATE_MAX, ANNOTATE_MIN_WEIGHT = 33, 0.3  # up to this many columns, only weights of at least this; then none
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#e377c2", "#7f7f7f", "#bcbd22")


# -- labels -------------------------------------------------------------------------------------
def sublayer_tag(index: int, num_sublayers: int) -> str:
    """'L03_mlp' for sublayer 7 (zero-padded so TensorBoard sorts by depth); 'output'."""
    if index == num_sublayers:
        return "output"
    return f"L{index // 2:02d}_{'attn' if index % 2 == 0 else 'mlp'}"


# -- the three figures --------------------------------------------------------------------------
def new_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def heatmap_cell(n: int) -> float:
    """Inches per heatmap cell along an axis of n cells: 0.5 up to 9 cells, 0.36 at 17, 0.3 at 25,
    0.21 at 49, never below CELL_MIN. n * heatmap_cell(n) grows with n."""
    return min(CELL_MAX, max(CELL_MIN, CELL_SCALE / math.sqrt(max(n, 1))))


def heatmap_figsize(rows: int, cols: int) -> tuple[float, float]:
    """Inches (width, height) of the heatmap of a rows x cols grid; times DPI = pixels. Both grow
    with the grid, the grid part like sqrt(rows) and sqrt(cols), from a minimum that holds the
    title and the axis label (6.4 x 3.6 inches)."""
    left, right, top, bottom = heatmap_margins(cols)
    return max(6.4, left + right + cols * heatmap_cell(cols)), max(3.6, top + bottom + rows * heatmap_cell(rows))


def heatmap_annotations(rows: int, cols: int) -> tuple[float, float] | None:
    """(font size in points, fitted to the cell; smallest weight printed) of the cell values:
    every value up to ANNOTATE_ALL columns, the weights of at least ANNOTATE_MIN_WEIGHT up to
    ANNOTATE_MAX, and None beyond, or when rows are too thin for text (colours and the colour
    bar only)."""
    w, h = heatmap_cell(cols) * 72, heatmap_cell(rows) * 72  # cell size in points
    if cols > ANNOTATE_MAX or h < 12:
        return None
    return round(min(10.0, 0.36 * w, 0.6 * h), 1), (0.0 if cols <= ANNOTATE_ALL else ANNOTATE_MIN_WEIGHT)


def heatmap_margins(cols: int) -> tuple[float, float, float, float]:
    """Inches left (row labels), right (colour bar), top (title), bottom (column labels)."""
    return 0.9, 1.1, 0.7, 0.6 if cols <= 8 else 1.05


def cell_text(value: float) -> str:
    """'.25', '1', '0': two decimals without the leading zero, so the text fits a small cell."""
    return "1" if value >= 0.995 else "0" if value < 0.005 else f"{value:.2f}".lstrip("0")


def label_grid(ax: Any, R: int, C: int, row_labels: Sequence[str], col_labels: Sequence[str]) -> None:  # noqa: N803
    """The labels and rules of a sublayer-by-source heatmap panel: ticks sized to the cells,
    row labels coloured by kind (attention / MLP, `output` bold), a white rule between
    Transformer layers (after each MLP row) and a black one above the output aggregation."""
    cell_w, cell_h = heatmap_cell(C) * 72, heatmap_cell(R) * 72  # points
    ax.set_xticks(range(C), col_labels, rotation=0 if C <= 8 else 90, fontsize=min(8.0, 0.75 * cell_w))
    ax.set_yticks(range(R), row_labels, fontsize=min(8.0, 0.75 * cell_h))
    ax.tick_params(length=0)
    for tick, label in zip(ax.get_yticklabels(), row_labels, strict=True):
        tick.set_color(ATTN_COLOUR if "attn" in label else MLP_COLOUR if "mlp" in label else "black")
        if label == "output":
            tick.set_fontweight("bold")
    rule = min(2.0, 0.12 * cell_h)
    for r in range(2, R - 1, 2):
        ax.axhline(r - 0.5, color="white", linewidth=rule)
    if R > 1 and row_labels[-1] == "output":
        ax.axhline(R - 1.5, color="black", linewidth=1.25 * rule)


def depth_heatmap(
    weights: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str], title: str, xlabel: str = "source"
) -> Figure:
    """weights: (rows, cols), row r = one sublayer's depth weights averaged over tokens, NaN where
    that sublayer has no such source. Colour scale fixed to [0, 1]; rows labelled and coloured
    by kind (attention / MLP); a white rule between Transformer layers, a black one above the
    output aggregation. The figure, its labels and the printed cell values (two decimals; all of
    them, the large ones, or none, by grid size) are sized to the grid (`heatmap_figsize`,
    `heatmap_annotations`)."""
    import matplotlib

    R, C = weights.shape
    width, height = heatmap_figsize(R, C)
    fig = new_figure(width, height)
    left, right, top, bottom = heatmap_margins(C)
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#e6e6e6")
    image = ax.imshow(np.ma.masked_invalid(weights), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest")
    label_grid(ax, R, C, row_labels, col_labels)
    annotations = heatmap_annotations(R, C)
    if annotations is not None:
        fontsize, smallest = annotations
        for (r, c), value in np.ndenumerate(weights):
            if not math.isnan(value) and value >= smallest:
                ax.text(c, r, cell_text(value), ha="center", va="center", fontsize=fontsize,
                        color="white" if value < 0.55 else "black")
    ax.set_xlabel(xlabel, fontsize=9)
    put_title(fig, title)
    cax = fig.add_axes(((width - right + 0.25) / width, bottom / height, 0.18 / width, 1 - (top + bottom) / height))
    fig.colorbar(image, cax=cax).set_label("weight (mean over tokens)", fontsize=8)
    return fig


def depth_profile(
    series: Mapping[str, np.ndarray], xlabels: Sequence[str], title: str, ylabel: str, xlabel: str,
    signed: bool = False,
) -> Figure:
    """One line per series over depth (x = sublayer or layer, labelled by `xlabels`); attention
    points drawn as circles, MLP points as squares, others as diamonds. Log y axis when the
    values span more than a factor of 10, else linear from 0; `signed`: values that may be
    negative (`_signed_y_scale`)."""
    n = len(xlabels)
    longest = max((len(s) for s in xlabels), default=1)
    vertical = longest > 3
    width, height = max(6.4, 2.2 + 0.34 * n), 4.4 + (0.07 * longest if vertical else 0.0)
    fig = new_figure(width, height)
    left, right, top, bottom = 0.95, 0.3, 0.75, 0.55 + (0.075 * longest if vertical else 0.15)
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (top + bottom) / height))
    x = np.arange(n)
    attn = np.array(["attn" in s for s in xlabels])
    mlp = np.array(["mlp" in s for s in xlabels])
    masks = [attn, mlp, ~(attn | mlp)]
    everything = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in series.values()])
    for colour, (name, values) in zip(_COLOURS, series.items(), strict=False):
        _profile_axes(ax, x, np.asarray(values, dtype=np.float64), colour, masks, name, size=24)
    (_signed_y_scale if signed else _y_scale)(ax, everything)
    ax.set_xticks(x, xlabels, rotation=90 if vertical else 0, fontsize=8)
    for tick, label in zip(ax.get_xticklabels(), xlabels, strict=True):
        tick.set_color(ATTN_COLOUR if "attn" in label else MLP_COLOUR if "mlp" in label else "black")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    put_title(fig, title)
    return fig


def strategy_colours(strategies: Sequence[str]) -> list[str]:
    """One colour per run: runs of the same strategy (seeds) get shades of one hue, from dark to
    light in the order given; strategies get hues in order of first appearance."""
    from matplotlib.colors import to_hex, to_rgb

    hues: dict[str, int] = {}
    for name in strategies:
        hues.setdefault(name, len(hues))
    counts = {name: strategies.count(name) for name in hues}
    seen: dict[str, int] = {}
    colours = []
    for name in strategies:
        i, n = seen.get(name, 0), counts[name]
        seen[name] = i + 1
        base = np.array(to_rgb(_COLOURS[hues[name] % len(_COLOURS)]))
        t = 0.0 if n == 1 else -0.35 + 0.8 * i / (n - 1)  # < 0 towards black, > 0 towards white
        colours.append(to_hex(base * (1 + t) if t < 0 else base + (1 - base) * t))
    return colours


def _profile_axes(ax: Any, x: np.ndarray, values: np.ndarray, colour: str, masks: list, label: str,
                  size: float = 20) -> None:
    """One line over depth, its points marked by kind (masks: attention, MLP, other)."""
    ax.plot(x, values, color=colour, linewidth=1.5, label=label)
    for marker, keep in zip("osD", masks, strict=True):
        if keep.any():
            ax.scatter(x[keep], values[keep], color=colour, marker=marker, s=size, zorder=3)


def _y_scale(ax: Any, values: np.ndarray) -> None:
    """Log y when the finite values span more than a factor of 10 (plain tick labels), else linear from 0."""
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > 10:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.3, not 3 x 10^-1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(plain if math.log10(finite.max() / finite.min()) < 3 else NullFormatter())
    else:
        ax.set_ylim(bottom=0.0, top=(finite.max() * 1.1 if finite.size and finite.max() > 0 else 1.0))


def _signed_y_scale(ax: Any, values: np.ndarray) -> None:
    """For changes that may be negative: `_y_scale` when every finite value is positive, else a
    linear axis that holds every value and 0, with a rule at 0."""
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() > 0:
        _y_scale(ax, finite)
        return
    low, high = (min(0.0, finite.min()), max(0.0, finite.max())) if finite.size else (0.0, 1.0)
    pad = 0.08 * (high - low) if high > low else 1.0
    ax.set_ylim(low - pad, high + pad)
    ax.axhline(0.0, color="black", linewidth=0.8, zorder=1)


def compare_profiles(
    panels: Sequence[tuple[str, Mapping[str, np.ndarray]]], strategies: Mapping[str, str],
    xlabels: Sequence[str], title: str, xlabel: str, signed: bool = False,
) -> Figure:
    """Runs of a sweep over depth, one panel per quantity (stacked, sharing the x axis): panels
    is [(y label, {run label: values})], strategies {run label: strategy}. Each strategy has its
    own hue and its runs (seeds) shades of it; the legend sits right of the panels, outside the
    data. Attention points are circles, MLP points squares, others diamonds. `signed`: values
    that may be negative (`_signed_y_scale`)."""
    n = len(xlabels)
    runs = list(dict.fromkeys(r for _, series in panels for r in series))
    colours = dict(zip(runs, strategy_colours([strategies.get(r, r) for r in runs]), strict=True))
    longest = max((len(s) for s in xlabels), default=1)
    vertical = longest > 3
    legend_w = min(4.5, 0.6 + 0.065 * max([len(LEGEND_TITLE), *(len(r) for r in runs)]))  # the title fits too
    panel_h = 2.8
    left, top, gap = 0.95, 0.75, 0.25
    bottom = 0.55 + (0.075 * longest if vertical else 0.15)
    width = max(6.4, 1.25 + 0.3 * n) + legend_w
    height = top + bottom + len(panels) * panel_h + (len(panels) - 1) * gap
    fig = new_figure(width, height)
    x = np.arange(n)
    attn = np.array(["attn" in s for s in xlabels])
    mlp = np.array(["mlp" in s for s in xlabels])
    masks = [attn, mlp, ~(attn | mlp)]
    axes = []
    for k, (ylabel, series) in enumerate(panels):
        y0 = height - top - (k + 1) * panel_h - k * gap
        ax = fig.add_axes((left / width, y0 / height, (width - left - legend_w - 0.3) / width, panel_h / height))
        for run, values in series.items():
            _profile_axes(ax, x, np.asarray(values, dtype=np.float64), colours[run], masks, run)
        everything = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in series.values()])
        (_signed_y_scale if signed else _y_scale)(ax, everything)
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xticks(x, xlabels if k == len(panels) - 1 else [], rotation=90 if vertical else 0, fontsize=8)
        axes.append(ax)
    for tick, label in zip(axes[-1].get_xticklabels(), xlabels, strict=True):
        tick.set_color(ATTN_COLOUR if "attn" in label else MLP_COLOUR if "mlp" in label else "black")
    axes[-1].set_xlabel(xlabel, fontsize=9)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colours[r], linewidth=1.5) for r in runs]
    fig.legend(handles, runs, loc="upper left", fontsize=8, frameon=False,
               bbox_to_anchor=((width - legend_w) / width, 1 - top / height), title=LEGEND_TITLE,
               title_fontsize=8, alignment="left")
    put_title(fig, title)
    return fig


def put_title(fig: Figure, title: str) -> None:
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
