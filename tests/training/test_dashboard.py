"""TensorBoard dashboards: the real CLI for a few steps per strategy, read back with TensorBoard's
own event reader; `experiments/plot_run.py`; the figures' sizes; and a fast check that probing
leaves nothing behind."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from attnres import BlockAttentionResidual, Transformer
from attnres.labels import sublayer_label
from attnres.results import figures
from attnres.training import LitLanguageModel
from attnres.training.dashboard import DepthDashboard
from attnres.training.data import SyntheticDataModule

REPO = Path(__file__).resolve().parents[1]
N_LAYER, L, N, STEPS, EVERY = 2, 4, 2, 6, 2
TINY = [
    "data=synthetic", f"model.n_layer={N_LAYER}", "model.n_embd=32", "model.n_head=2", f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=3", "trainer.accelerator=cpu", "data.batch_size=8", "data.val_batches=1",
    "data.block_size=64",  # room for any of the task's default sizes
    "trainer.enable_progress_bar=false",
]
EVERY_2 = f"callbacks.depth_dashboard.every_n_steps={EVERY}"
RUNS = {"standard": ["residual=standard", EVERY_2], "full": ["residual=full", EVERY_2],
        "block": ["residual=block", f"num_blocks={N}", EVERY_2],
        "no_callbacks": ["residual=block", f"num_blocks={N}", "callbacks=none"]}
PROBE_STEPS, GRAD_STEPS = [0, 2, 4, 6], [0, 2, 4, 5]  # every 2 steps and the end; grads: also the last step


def _accumulator(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    where = run if any(run.glob("events.out.tfevents.*")) else run / "tb"  # tb/: the layout before the issue 11 one
    acc = EventAccumulator(str(where), size_guidance={"images": 0, "tensors": 0, "scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _array(event) -> np.ndarray:
    proto = event.tensor_proto
    return np.asarray(proto.float_val, dtype=np.float32).reshape([d.size for d in proto.tensor_shape.dim])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """One folder per run, the four CLI runs at once (one thread each: 2 shared cores)."""
    root = tmp_path_factory.mktemp("sweep")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "attnres", *TINY, *extra, f"hydra.run.dir={root / name}"],
                               cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, extra in RUNS.items()
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name} failed:\n{out[-3000:]}"
    return root


@pytest.fixture(scope="module")
def events(sweep):
    return {name: _accumulator(sweep / name) for name in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_magnitudes_and_grad_norms_for_every_strategy(events, residual):
    acc = events[residual]
    tags = acc.Tags()
    subs = [figures.sublayer_tag(i, L) for i in range(L)]
    assert {f"magnitude/{io}/{s}" for io in ("input", "output") for s in subs} <= set(tags["scalars"])
    assert {f"grad_norm/layer_{k:02d}" for k in range(N_LAYER)} <= set(tags["scalars"])
    assert {"magnitude/plot", "grad_norm/plot"} <= set(tags["images"])
    assert [e.step for e in acc.Images("magnitude/plot")] == PROBE_STEPS
    assert [e.step for e in acc.Images("grad_norm/plot")] == GRAD_STEPS
    magnitude = _array(acc.Tensors("magnitude/plot_data")[-1])
    assert magnitude.shape == (2, L) and np.all(magnitude > 0)
    assert math.isclose(acc.Scalars(f"magnitude/output/{subs[-1]}")[-1].value, magnitude[1, -1], rel_tol=1e-6)
    grads = _array(acc.Tensors("grad_norm/plot_data")[-1])
    assert grads.shape == (N_LAYER,) and np.all(grads > 0)
    for tag in ("magnitude/plot", "grad_norm/plot"):  # the image is the picture drawn from the logged array
        data = acc.Tensors(figures.FIGURE_TAGS[tag])[-1]
        meta = json.loads(acc.SummaryMetadata(figures.FIGURE_TAGS[tag]).plugin_data.content)
        expected = figures.to_rgb(figures.render(tag, _array(data), meta, data.step)).shape
        image = acc.Images(tag)[-1]
        assert (image.height, image.width, 3) == expected
    has_heatmap = any(t.startswith("depth/") for kind in ("images", "scalars", "histograms", "tensors")
                      for t in tags[kind])
    assert has_heatmap == (residual != "standard")


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["full", "block"])
def test_depth_heatmap_rows_are_distributions(events, residual):
    acc = events[residual]
    tags = acc.Tags()
    # sources per row: Full l + 1; Block: completed blocks, plus the partial sum after a block's first sublayer
    sources = list(range(1, L + 2)) if residual == "full" else [1, 2, 2, 3, 3]
    rows = [figures.sublayer_tag(i, L) for i in range(L + 1) if sources[i] > 1]  # one source: constant, not logged
    for kind in ("entropy", "embedding_weight"):
        assert {f"depth/{kind}/{r}" for r in rows} <= set(tags["scalars"])
    assert {f"depth/weights/{r}" for r in rows} <= set(tags["histograms"])
    images = acc.Images("depth/heatmap")
    assert [e.step for e in images] == PROBE_STEPS
    cols = L + 1 if residual == "full" else N + 1
    width, height = figures.heatmap_figsize(L + 1, cols)
    assert (images[-1].width, images[-1].height) == (round(width * figures.DPI), round(height * figures.DPI))
    for event in acc.Tensors("depth/heatmap_data"):
        grid = _array(event)
        assert grid.shape == (L + 1, cols)
        assert [int(np.isfinite(row).sum()) for row in grid] == sources
        np.testing.assert_allclose(np.nansum(grid, axis=1), 1.0, atol=1e-5)
    # step 0: pseudo-queries are zero, so every row is uniform over its sources
    first = _array(acc.Tensors("depth/heatmap_data")[0])
    for row, s in zip(first, sources, strict=True):
        np.testing.assert_allclose(row[:s], 1.0 / s, atol=1e-6)
    entropy0 = [acc.Scalars(f"depth/entropy/{r}")[0].value for r in rows]
    np.testing.assert_allclose(entropy0, np.log([s for s in sources if s > 1]), atol=1e-5)
    meta = json.loads(acc.SummaryMetadata("depth/heatmap_data").plugin_data.content)
    assert meta["rows"][-1] == "output" and meta["rows"][:2] == ["L0 attn", "L0 mlp"] and meta["cols"][0] == "emb"


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "block"])
def test_hparams_with_final_metrics(events, sweep, residual):
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = events[residual]
    content = acc.PluginTagToContent("hparams")
    assert set(content) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hp = start.hparams
    assert hp["residual"].string_value == residual
    assert hp["n_layer"].number_value == N_LAYER and hp["seed"].number_value == 0 and hp["lr"].number_value == 3e-3
    assert hp["model"].string_value == "tiny" and hp["parameters"].number_value > 0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {"residual", "num_blocks", "n_layer", "n_embd", "seed", "lr", "query_lr_scale"} <= {
        h.name for h in experiment.hparam_infos}
    assert {"Val/loss", "Val/accuracy"} <= {m.name.tag for m in experiment.metric_infos}
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == 1  # STATUS_SUCCESS
    # TensorBoard fills the metric columns with each tag's last value: the final validation
    final = json.loads((sweep / residual / "metrics.json").read_text())["metrics"]
    assert acc.Scalars("Val/loss")[-1].value == pytest.approx(final["val/loss"])
    assert acc.Scalars("Val/loss")[-1].step >= STEPS - 1  # the validation after the last step


def _hparams(acc):
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    return experiment, start.hparams


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_hparams_declare_only_metrics_the_run_logs(events, residual):
    acc = events[residual]
    experiment, _ = _hparams(acc)
    declared = [m.name.tag for m in experiment.metric_infos]
    assert set(declared) <= set(acc.Tags()["scalars"])  # every metric column has values
    assert declared == ["Val/loss", "Val/accuracy", "Train/loss"]  # synthetic data: accuracy, no bpb


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_hparams_columns_are_filled_and_the_swept_ones_shown(events, residual):
    experiment, hp = _hparams(events[residual])
    declared = {h.name for h in experiment.hparam_infos}
    assert declared == set(hp)  # no run leaves a column empty (TensorBoard drops it from the parallel coordinates)
    assert all(v.WhichOneof("kind") is not None for v in hp.values())
    assert hp["num_blocks"].number_value == (N if residual == "block" else 0)
    assert {h.name for h in experiment.hparam_infos if h.differs} == {"residual", "num_blocks", "seed"}


@pytest.mark.slow
def test_tensorboard_names_runs_by_their_folders(sweep):
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    for name in RUNS:
        assert list((sweep / name).glob("events.out.tfevents.*")) and not (sweep / name / "tb").exists()
        assert not (sweep / name / "hparams.yaml").exists()
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(sweep))
    mux.Reload()
    assert set(mux.Runs()) == set(RUNS)  # run names are the run folders: no trailing /tb
    assert set(mux.PluginRunToTagToContent("hparams")) == {"standard", "full", "block"}  # HParams finds them


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block", "no_callbacks"])
def test_scalars_open_on_the_losses(events, residual):
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = events[residual]
    scalars = acc.Tags()["scalars"]
    assert "epoch" not in scalars and not any(t.startswith(("train/", "val/")) for t in scalars)
    groups = list(dict.fromkeys(t.split("/", 1)[0] for t in sorted(scalars)))  # TensorBoard's order of groups
    assert groups[:2] == ["Train", "Val"] and len(groups) > 2
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    first = layout.category[0]
    regexes = [c.multiline.tag[0] for c in first.chart]
    assert regexes == ["^Train/loss$", "^Val/loss$", "^Val/accuracy$"]
    assert [c.title for c in first.chart] == ["Train/loss", "Val/loss", "Val/accuracy"]
    for regex in regexes:
        assert [t for t in scalars if re.match(regex, t)]  # every chart has a line


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["full", "block"])
def test_constant_depth_scalars_are_not_logged(events, residual):
    tags = events[residual].Tags()
    first = figures.sublayer_tag(0, L)  # one source (the embedding): weight 1, entropy 0 by construction
    assert f"depth/entropy/{first}" not in tags["scalars"]
    assert f"depth/embedding_weight/{first}" not in tags["scalars"]
    assert f"depth/weights/{first}" not in tags["histograms"]
    assert f"depth/entropy/{figures.sublayer_tag(1, L)}" in tags["scalars"]


@pytest.mark.slow
def test_callbacks_none_still_runs(events, sweep):
    assert (sweep / "no_callbacks" / "metrics.json").is_file()
    tags = events["no_callbacks"].Tags()
    assert not any(t.startswith(("depth/", "magnitude/", "grad_norm/")) for t in tags["scalars"] + tags["images"])


@pytest.mark.slow
def test_plot_run_renders_the_tensorboard_pictures(events, sweep, tmp_path):
    import matplotlib.image as mpimg

    script = str(REPO / "experiments" / "plot_run.py")
    done = subprocess.run([sys.executable, script, str(sweep)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("standard", "full", "block"):
        assert str(sweep / name) in done.stdout
        expected = {"magnitude.png", "grad_norm.png"} | ({"heatmap.png"} if name != "standard" else set())
        assert {p.name for p in (sweep / name / "plots").glob("*.png")} == expected
    assert "no dashboard data" in done.stdout  # the callbacks=none run, skipped with a note
    assert {"compare_magnitude.png", "compare_grad_norm.png"} <= {p.name for p in (sweep / "plots").iterdir()}
    png = mpimg.imread(sweep / "block" / "plots" / "heatmap.png")[..., :3]
    logged = mpimg.imread(io.BytesIO(events["block"].Images("depth/heatmap")[-1].encoded_image_string), format="png")
    np.testing.assert_array_equal(png, logged[..., :3])  # same picture, pixel for pixel

    empty = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "no TensorBoard event files" in empty.stderr


# -- fast: figures sized to what they show -------------------------------------------------------
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
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", REPO / "experiments" / "plot_run.py")
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
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


# -- fast: the probe leaves nothing behind ---------------------------------------------------------
class _Spy(pl.Callback):
    """Checks the strategy's state after every training step."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        residual = pl_module.model.residual
        assert residual.recorded is None and not residual._record_next and residual._record is None
        self.steps += 1


def _fit(tmp_path: Path, logger: bool) -> tuple[LitLanguageModel, DepthDashboard, list, list]:
    torch.manual_seed(0)
    data = SyntheticDataModule(batch_size=4, val_batches=1)  # the task's own defaults otherwise
    model = Transformer(data.vocab_size, n_layer=2, n_head=2, n_embd=16, block_size=data.block_size,
                        residual=lambda **kw: BlockAttentionResidual(num_blocks=2, **kw))
    residual = model.residual
    forwards, grad_steps = [], []
    run = residual.run

    def spy_run(*args, **kwargs):  # what each forward of the strategy looked like
        forwards.append((residual._record is not None, torch.is_grad_enabled(), residual.training))
        return run(*args, **kwargs)

    residual.run = spy_run
    dashboard = DepthDashboard(every_n_steps=2, probe_size=2)
    log_grad_norms = dashboard.log_grad_norms
    dashboard.log_grad_norms = lambda m, step: (grad_steps.append(step), log_grad_norms(m, step))
    module = LitLanguageModel(model, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3), metric="accuracy")
    tb = pl.loggers.TensorBoardLogger(tmp_path, name="tb", version="") if logger else False
    trainer = pl.Trainer(max_steps=5, logger=tb, callbacks=[dashboard, _Spy()], accelerator="cpu",
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=1, val_check_interval=3, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    return module, dashboard, forwards, grad_steps


@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*val_check_interval")
def test_probe_records_once_and_leaves_nothing_hooked(tmp_path):
    module, dashboard, forwards, grad_steps = _fit(tmp_path, logger=True)
    recorded = [f for f in forwards if f[0]]
    assert len(recorded) == 4  # steps 0, 2, 4 and the end of fit (5)
    assert all(not grad and not training for _, grad, training in recorded)  # no-grad, eval mode
    assert sum(1 for rec, grad, training in forwards if not rec and grad and training) == 5  # the 5 steps, plain
    assert grad_steps == [0, 2, 4]  # 4 is also the last step
    model, residual = module.model, module.model.residual
    assert model.training and residual.recorded is None and not residual._record_next
    for m in model.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
    assert all(p._backward_hooks is None for p in model.parameters())
    assert not torch.nn.modules.module._global_forward_hooks


@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*val_check_interval")
def test_without_a_logger_the_dashboard_does_nothing(tmp_path):
    _, dashboard, forwards, grad_steps = _fit(tmp_path, logger=False)
    assert not any(rec for rec, _, _ in forwards) and grad_steps == [] and dashboard.probe_seconds == 0.0
