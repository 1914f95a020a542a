"""The figures (attnres/results/figures.py) and attnres-plot (attnres/results/plot_run.py), which draws them from a
run's events: heatmaps sized to what they show, the comparison of magnitudes coloured by strategy,
and the script's pictures equal to the ones the shared runs logged, pixel for pixel."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from attnres.labels import sublayer_label
from attnres.results import figures
from tests.helpers import RUN_N_LAYER, copy_run, run_script

L = 2 * RUN_N_LAYER


@pytest.mark.slow
def test_plot_run_renders_the_tensorboard_pictures(strategy_events, strategy_runs, tmp_path):
    import matplotlib.image as mpimg

    sweep = tmp_path / "runs"  # a copy: the script writes plots/ into each run folder and the sweep's
    for name, ran in strategy_runs.items():
        copy_run(ran.dir, sweep / name)
    done = run_script("experiments/plot_run.py", str(sweep), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("standard", "full", "block"):
        assert str(sweep / name) in done.stdout
        expected = {"magnitude.png", "grad_norm.png"} | ({"heatmap.png"} if name != "standard" else set())
        assert {p.name for p in (sweep / name / "plots").glob("*.png")} == expected
    assert "no dashboard data" in done.stdout  # the callbacks=none run, skipped with a note
    assert {"compare_magnitude.png", "compare_grad_norm.png"} <= {p.name for p in (sweep / "plots").iterdir()}
    png = mpimg.imread(sweep / "block" / "plots" / "heatmap.png")[..., :3]
    logged_png = strategy_events["block"].Images("depth/heatmap")[-1].encoded_image_string
    logged = mpimg.imread(io.BytesIO(logged_png), format="png")
    np.testing.assert_array_equal(png, logged[..., :3])  # same picture, pixel for pixel

    (tmp_path / "empty").mkdir()
    empty = run_script("experiments/plot_run.py", str(tmp_path / "empty"), cwd=tmp_path, timeout=60)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "no TensorBoard event files" in empty.stderr


def _full_heatmap(num_sublayers: int):
    L = num_sublayers
    grid = np.full((L + 1, L + 1), np.nan, dtype=np.float32)
    for r in range(L + 1):
        grid[r, : r + 1] = 1.0 / (r + 1)
    grid[L, L] = 0.5  # one large weight, so that the grids with only large values printed print it
    rows = [sublayer_label(i, L) for i in range(L + 1)]
    cols = ["emb", *rows[:-1]]
    meta = {"strategy": "Full AttnRes", "rows": rows, "cols": cols, "sources": "source"}
    return figures.render("depth/heatmap", grid, meta, 0)


def test_heatmap_size_and_annotations_follow_the_grid():
    sizes = [figures.heatmap_figsize(n + 1, n + 1) for n in (8, 16, 24, 40, 48, 96)]
    for (w0, h0), (w1, h1) in zip(sizes, sizes[1:], strict=False):
        assert w1 > w0 and h1 > h0  # grows with the number of rows and columns ...
    assert sizes[-1][0] / sizes[1][0] < 2.2  # ... but slower than they do (6 times as many here)
    heights = [figures.heatmap_figsize(rows, 9)[1] for rows in (17, 25, 41, 49, 97)]  # Block AttnRes N=8
    assert heights == sorted(heights) and len(set(heights)) == len(heights)
    texts = {}
    for n in (8, 16, 24, 48):
        fig = _full_heatmap(n)
        assert fig.get_size_inches() == pytest.approx(figures.heatmap_figsize(n + 1, n + 1))
        texts[n] = [t for t in fig.axes[0].texts]
    cells = {n: (n + 1) * (n + 2) // 2 for n in texts}
    assert len(texts[8]) == cells[8] and len(texts[16]) == cells[16]  # every value printed
    assert 0 < len(texts[24]) < cells[24] / 10  # only the large weights
    assert texts[48] == []  # colours and the colour bar only
    sizes = [texts[n][0].get_fontsize() for n in (8, 16, 24)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]  # the font shrinks with the cells


def test_compare_magnitude_has_input_and_output_panels_coloured_by_strategy(tmp_path, monkeypatch):
    from attnres.results import plot_run

    labels = [sublayer_label(i, L) for i in range(L)]
    rng = np.random.default_rng(0)
    results = {}
    for residual, strategy in (("standard", "Standard residual"), ("full", "Full AttnRes")):
        for seed in (0, 1):
            data = rng.uniform(0.5, 2.0, (2, L)).astype(np.float32)
            results[f"residual={residual},seed={seed}"] = {
                "magnitude/plot": (10, data, {"strategy": strategy, "labels": labels})}
    drawn = {}
    monkeypatch.setattr(plot_run.figures, "save_png", lambda fig, path: drawn.setdefault(Path(path).name, fig))
    plot_run.compare(results, tmp_path)
    fig = drawn["compare_magnitude.png"]
    panels = [ax for ax in fig.axes if ax.lines]
    assert [ax.get_ylabel().split(" (")[0] for ax in panels] == ["input RMS", "output RMS"]
    for ax, row in zip(panels, (0, 1), strict=True):
        plotted = {line.get_label(): line for line in ax.lines}
        for run, data in results.items():
            short = run  # both keys vary: the short names are the names
            np.testing.assert_allclose(plotted[short].get_ydata(), data["magnitude/plot"][1][row])
    from matplotlib.colors import rgb_to_hsv, to_rgb

    hue = {run: rgb_to_hsv(to_rgb(line.get_color()))[0] for run, line in
           ((line.get_label(), line) for line in panels[0].lines)}
    colour = {line.get_label(): line.get_color() for line in panels[0].lines}
    assert hue["residual=standard,seed=0"] == pytest.approx(hue["residual=standard,seed=1"], abs=0.02)  # shades
    assert colour["residual=standard,seed=0"] != colour["residual=standard,seed=1"]
    assert abs(hue["residual=standard,seed=0"] - hue["residual=full,seed=0"]) > 0.1  # hues
    legend = fig.legends[0]
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for ax in panels:  # the legend sits outside the data
        assert not box.overlaps(ax.get_window_extent(renderer))
    assert [t.get_text() for t in legend.get_texts()] == list(results)
