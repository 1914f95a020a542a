"""The depth dashboard (attnres/training/dashboard.py): what the shared CLI runs logged per strategy
(magnitudes, gradient norms, depth-weight heatmaps whose rows are distributions), read back with
TensorBoard's own event reader; and, in-process, a probe that records once and leaves nothing behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from attnres import BlockAttentionResidual, Transformer
from attnres.data import SyntheticDataModule
from attnres.results import figures
from attnres.training import LitLanguageModel
from attnres.training.dashboard import DepthDashboard
from tests.helpers import RUN_N_LAYER as N_LAYER
from tests.helpers import RUN_NUM_BLOCKS as N
from tests.helpers import tensor_array as _array

L = 2 * N_LAYER
# every 2 steps and the end; a step's gradient at the count of steps it makes: the first (1), every 2, the last (6)
PROBE_STEPS, GRAD_STEPS = [0, 2, 4, 6], [1, 2, 4, 6]


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_magnitudes_and_grad_norms_for_every_strategy(strategy_events, residual):
    acc = strategy_events[residual]
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
def test_depth_heatmap_rows_are_distributions(strategy_events, residual):
    acc = strategy_events[residual]
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
@pytest.mark.parametrize("residual", ["full", "block"])
def test_constant_depth_scalars_are_not_logged(strategy_events, residual):
    tags = strategy_events[residual].Tags()
    first = figures.sublayer_tag(0, L)  # one source (the embedding): weight 1, entropy 0 by construction
    assert f"depth/entropy/{first}" not in tags["scalars"]
    assert f"depth/embedding_weight/{first}" not in tags["scalars"]
    assert f"depth/weights/{first}" not in tags["histograms"]
    assert f"depth/entropy/{figures.sublayer_tag(1, L)}" in tags["scalars"]


@pytest.mark.slow
def test_callbacks_none_still_runs(strategy_events, strategy_runs):
    assert (strategy_runs["no_callbacks"].dir / "metrics.json").is_file()
    tags = strategy_events["no_callbacks"].Tags()
    assert not any(t.startswith(("depth/", "magnitude/", "grad_norm/")) for t in tags["scalars"] + tags["images"])


# -- fast: figures sized to what they show -------------------------------------------------------


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
    assert grad_steps == [1, 2, 4, 5]  # the first step's, every 2, and the last (5th) step's
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
