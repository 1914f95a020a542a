"""The routing figures (attnres/results/probe_figures.py) of a probe's arrays
(attnres/training/routing.py `probe_arrays`): both heatmaps with the same rows and columns, the
effect centred on 0, negative effects in view."""

from __future__ import annotations

from attnres.probes import probe_routing
from tests.test_probes import _batches, _model


def test_the_routing_figure_has_the_same_rows_and_columns_on_both_heatmaps():
    from attnres.results import figures, probe_figures
    from attnres.training.routing import probe_arrays

    probe = probe_routing(_model("block"), _batches(1))
    shown = probe_arrays(probe)
    assert set(shown) == {"probe/routing", "probe/layer_knockout"}
    data, meta = shown["probe/routing"]
    assert data.shape == (4, *probe.mass.shape)
    fig = probe_figures.render_probe("probe/routing", data, meta, step=7)
    mass_ax, effect_ax = fig.axes[0], fig.axes[2]
    for axis in ("x", "y"):
        labels = [[t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()] for ax in (mass_ax, effect_ax)]
        assert labels[0] == labels[1]
    assert [t.get_text() for t in mass_ax.get_yticklabels()] == probe.row_labels
    assert [t.get_text() for t in mass_ax.get_xticklabels()] == probe.col_labels
    assert effect_ax.images[0].norm.vmin == -effect_ax.images[0].norm.vmax  # centred on 0
    pixels = figures.to_rgb(fig)
    assert pixels.ndim == 3 and pixels.shape[1] > pixels.shape[0]
    curve = probe_figures.render_probe("probe/layer_knockout", *shown["probe/layer_knockout"], step=7)
    low, high = curve.axes[0].get_ylim()
    assert low <= probe.layer_effect.min() and high >= probe.layer_effect.max()  # negative effects stay in view
