"""The depth dashboard: what the depth attention learned, logged to TensorBoard as the run trains.

`DepthDashboard` probes a fixed validation batch at the first step, every `every_n_steps`
and at the end of fit, and logs (tags in brackets; `<sub>` is `L03_mlp`-style, or `output`):

- depth-attention weights averaged over tokens as a heatmap [depth/heatmap], per-sublayer
  entropy [depth/entropy/<sub>], weight on the embedding [depth/embedding_weight/<sub>] and
  per-token weights as histograms [depth/weights/<sub>]; AttnRes strategies only;
- RMS of each sublayer's input and output [magnitude/plot, magnitude/input/<sub>,
  magnitude/output/<sub>]; every strategy;
- the gradient norm of each Transformer layer's parameters, before clipping, from the
  optimiser step that brings the count to that step [grad_norm/plot, grad_norm/layer_03].

Every step is the number of optimiser steps taken, as the run's log says it and as every other
scalar is logged (`attnres.training.tensorboard.StepAxis`): a probe at step 20 reads the weights
after 20 steps; the gradient norms at 20 are the 20th step's.

Each figure's raw array is logged beside it as a tensor summary ([depth/heatmap_data], ...)
with its labels as plugin metadata, so `attnres-plot` redraws the same picture.
Nothing is hooked: the probe arms the strategy's `record_next()` for one no-grad forward, and
gradient norms are read from `.grad` in `on_before_optimizer_step` on the logged steps only.
"""


from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from attnres.labels import sublayer_label
from attnres.results import figures
from attnres.training.tensorboard import log_array, tensorboard_writer


class DepthDashboard(pl.Callback):
    """Depth-attention heatmaps, magnitudes and gradient norms across depth (module docstring).

    every_n_steps: log at step 0 (or the first step of a resumed run), at every multiple of
    this, and at the end of fit. probe_size: validation examples in the fixed probe batch.
    histograms: also log the per-token weights of each sublayer as histograms.
    """

    def __init__(self, every_n_steps: int = 100, probe_size: int = 8, histograms: bool = True) -> None:
        if every_n_steps < 1 or probe_size < 1:
            raise ValueError(f"every_n_steps and probe_size must be >= 1, got {every_n_steps} and {probe_size}")
        self.every_n_steps, self.probe_size, self.histograms = every_n_steps, probe_size, histograms
        self._writer: Any = None
        self._probe: Tensor | None = None
        self._first_step = 0
        self._last_probe_step: int | None = None
        self.probe_seconds = 0.0  # time spent in probes and drawing (for the record)

    # -- schedule ---------------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        return step == self._first_step or step % self.every_n_steps == 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._writer, self._probe, self._last_probe_step = tensorboard_writer(trainer), None, None
        if self._writer is None:
            return
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            # sharded parameters (FSDP, DeepSpeed): rank 0 can neither run the model alone nor
            # see whole gradients
            rank_zero_warn(f"DepthDashboard: off under {type(trainer.strategy).__name__} (sharded parameters)")
            self._writer = None
            return
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "probe_batch"):
            rank_zero_warn("DepthDashboard: the data module has no probe_batch(n); depth and magnitude plots are off")
            return
        n = self.probe_size
        if hasattr(datamodule, "val_dataset") and len(datamodule.val_dataset()) < n:
            n = len(datamodule.val_dataset())
            rank_zero_warn(f"DepthDashboard: probe_size={self.probe_size} but the validation set has {n} examples; "
                           f"probing {n}")
        self._probe = datamodule.probe_batch(n)[0]  # (n, T) token ids, taken once

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if self._probe is not None and step != self._last_probe_step and self._due(step):
            self.probe(trainer, pl_module, step)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # the gradient of the step about to be taken, logged at the count of steps once it is (as every
        # other scalar, `StepAxis`): the first step's at 1, the last's at max_steps
        step = trainer.global_step + 1
        due = step == self._first_step + 1 or step % self.every_n_steps == 0
        if self._writer is not None and (due or step == trainer.max_steps):
            self.log_grad_norms(pl_module.model, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is not None and trainer.global_step != self._last_probe_step:
            self.probe(trainer, pl_module, trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe, self._writer = None, None

    # -- the probe --------------------------------------------------------------------------
    def probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """One recorded, no-grad, eval-mode forward of the probe batch; logs what it saw."""
        start = time.perf_counter()
        model = pl_module.model  # the plain module: never the compiled wrapper
        residual = model.residual
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                residual.record_next()
                model(self._probe.to(pl_module.device))
                record = residual.recorded
        finally:
            residual._record_next = False  # even if the forward failed before taking it
            residual.recorded = None  # drop the recorded tensors now
            model.train(was_training)
        self._last_probe_step = step
        if record is not None:
            name, cols, sources = residual.depth_layout()
            self.log_magnitudes(record, name, step)
            if residual.has_depth_attention and record.weights:
                self.log_depth_weights(record, name, cols, sources, step)
        self.probe_seconds += time.perf_counter() - start

    def _image(self, tag: str, data: np.ndarray, meta: Mapping[str, Any], step: int) -> None:
        log_array(self._writer, figures.FIGURE_TAGS[tag], data, meta, step)
        fig = figures.render(tag, data, meta, step)
        self._writer.add_image(tag, figures.to_rgb(fig), step, dataformats="HWC")

    def log_magnitudes(self, record: Any, name: str, step: int) -> None:
        if not record.input_rms:
            return
        L = len(record.input_rms)
        data = torch.stack([torch.stack(record.input_rms), torch.stack(record.output_rms)]).cpu().numpy()  # (2, L)
        for index in range(L):
            sub = figures.sublayer_tag(index, L)
            self._writer.add_scalar(f"magnitude/input/{sub}", float(data[0, index]), step)
            self._writer.add_scalar(f"magnitude/output/{sub}", float(data[1, index]), step)
        self._image("magnitude/plot", data, {"strategy": name, "labels": [sublayer_label(i, L)
                                                                           for i in range(L)]}, step)

    def log_depth_weights(self, record: Any, name: str, cols: Sequence[str], sources: str, step: int) -> None:
        L = record.num_layers
        rows = sorted(record.weights)
        width = max(record.weights[r].shape[0] for r in rows)
        cols = list(cols) if len(cols) >= width else [f"source {i}" for i in range(width)]
        grid = np.full((len(rows), len(cols)), np.nan, dtype=np.float32)
        for r, index in enumerate(rows):
            w = record.weights[index].float()  # (S_l, B, T)
            grid[r, : w.shape[0]] = w.mean(dim=(1, 2)).cpu().numpy()
            if w.shape[0] == 1:
                continue  # one source: weight 1 and entropy 0 by construction, nothing to watch
            sub = figures.sublayer_tag(index, L)
            entropy = -(w * w.clamp_min(1e-12).log()).sum(dim=0).mean()  # nats, mean over tokens
            self._writer.add_scalar(f"depth/entropy/{sub}", entropy.item(), step)
            self._writer.add_scalar(f"depth/embedding_weight/{sub}", w[0].mean().item(), step)
            if self.histograms:
                self._writer.add_histogram(f"depth/weights/{sub}", w.flatten().cpu().numpy(), step,
                                           bins=np.linspace(0.0, 1.0, 41))
        row_labels = [sublayer_label(i, L) for i in rows]
        meta = {"strategy": name, "rows": row_labels, "cols": cols, "sources": sources}
        self._image("depth/heatmap", grid, meta, step)

    def log_grad_norms(self, model: torch.nn.Module, step: int) -> None:
        start = time.perf_counter()
        sublayers = model.sublayers
        norms = []
        for k in range(len(sublayers) // 2):  # layer k = sublayers 2k (attention) and 2k+1 (MLP)
            grads = [p.grad.detach().float().norm() for i in (2 * k, 2 * k + 1)
                     for p in sublayers[i].parameters() if p.grad is not None]
            norms.append(torch.stack(grads).norm() if grads else torch.tensor(float("nan")))
        values = torch.stack([n.cpu() for n in norms]).numpy()  # one sync
        for k, value in enumerate(values):
            if not math.isnan(value):
                self._writer.add_scalar(f"grad_norm/layer_{k:02d}", float(value), step)
        name = model.residual.depth_layout()[0]
        self._image("grad_norm/plot", values, {"strategy": name, "labels": [f"L{k}" for k in range(len(values))]},
                    step)
        self.probe_seconds += time.perf_counter() - start


# == routing probes ==================================================================================
