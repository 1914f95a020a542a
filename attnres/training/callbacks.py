"""TensorBoard dashboards: what the depth attention learned, and what the run was.

`DepthDashboard` probes a fixed validation batch at the first step, every `every_n_steps`
and at the end of fit, and logs (tags in brackets; `<sub>` is `L03_mlp`-style, or `output`):

- depth-attention weights averaged over tokens as a heatmap [depth/heatmap], per-sublayer
  entropy [depth/entropy/<sub>], weight on the embedding [depth/embedding_weight/<sub>] and
  per-token weights as histograms [depth/weights/<sub>]; AttnRes strategies only;
- RMS of each sublayer's input and output [magnitude/plot, magnitude/input/<sub>,
  magnitude/output/<sub>]; every strategy;
- the gradient norm of each Transformer layer's parameters, before clipping, from the
  training step of the same number [grad_norm/plot, grad_norm/layer_03].

Each figure's raw array is logged beside it as a tensor summary ([depth/heatmap_data], ...)
with its labels as plugin metadata, so `experiments/plot_run.py` redraws the same picture.
Nothing is hooked: the probe arms the strategy's `record_next()` for one no-grad forward, and
gradient norms are read from `.grad` in `on_before_optimizer_step` on the logged steps only.

Rows with a single source (the first sublayer, and the first of Block AttnRes's first block)
have entropy 0 and embedding weight 1 by construction: they stay in the heatmap, but get no
scalars and no histogram.

`HParamsSummary` writes the run's hyperparameters for TensorBoard's HParams tab; the metric
columns are the last values of the listed scalar tags that this run's data produces (the
final validation, once `attnres-run` has run it).

`RoutingProbes` (off unless `enabled`) runs the causal routing probes of `attnres.probes` once
at the end of training, on the first `batches` validation batches: source knock-outs (a
knock-out heatmap beside the mass heatmap, and their per-sublayer rank correlation
[probe/routing]) and layer knock-outs [probe/layer_knockout], their raw arrays beside them
[probe/routing_data, probe/layer_knockout_data], `probes.json` in the run folder and PNGs in
its `plots/` (`write_probes`, shared with `experiments/probe_routing.py`).

`TensorBoardLogger` is Lightning's, writing its event files straight into the run folder (so
TensorBoard's run names are the run folders), with the run's own metrics under `Train/` and
`Val/` (capitalised: TensorBoard orders tag groups by name, capitals first, so the losses come
before `depth/`, `grad_norm/`, `lr/`, `magnitude/` and `perf/`), no `epoch` scalar, and a
Custom Scalars layout whose first charts are the losses, one line per run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger as LightningTensorBoardLogger
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor

from attnres import probes
from attnres.labels import sublayer_label
from attnres.training import figures
from attnres.training.io import atomic_write, write_json

log = logging.getLogger("attnres")

# The run's own metrics (logged by the LightningModule as train/*, val/*, as in metrics.json) are
# written to TensorBoard under these group names: capitals sort before every lowercase group.
TAG_GROUPS = {"train": "Train", "val": "Val"}
METRIC_NAMES = ("bpb", "accuracy")  # the LightningModule's `metric`: which val/<metric> a run logs


def tensorboard_tag(name: str) -> str:
    """The TensorBoard tag of a metric the LightningModule logs: 'val/loss' -> 'Val/loss'."""
    group, sep, rest = name.partition("/")
    return f"{TAG_GROUPS[group]}{sep}{rest}" if sep and group in TAG_GROUPS else name


def run_metric(trainer: Any, pl_module: Any) -> str | None:
    """'bpb' or 'accuracy': the LightningModule's `metric`, else the data module's; None if neither says."""
    for owner in (pl_module, getattr(trainer, "datamodule", None)):
        metric = getattr(owner, "metric", None)
        if metric in METRIC_NAMES:
            return metric
    return None


def logged_metrics(names: Sequence[str], metric: str | None) -> list[str]:
    """`names` less the ones this run never logs: `val/bpb` and `train/bpb` only when the metric is
    bpb, `val/accuracy` only when it is accuracy (every name is kept when the metric is unknown)."""
    def logged(name: str) -> bool:
        last = name.rsplit("/", 1)[-1]
        return metric is None or last not in METRIC_NAMES or last == metric
    return [n for n in names if logged(n)]


def scalars_layout(metric: str | None) -> Any:
    """The Custom Scalars layout (a Summary proto): first the losses, each chart one line per run
    (`Train/loss`, `Val/loss`, and `Val/bpb` or `Val/accuracy`), then, closed, the learning rates
    and the throughput. TensorBoard merges the layouts of all runs, charts of the same title once."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    def chart(title: str, regex: str) -> Any:
        return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=[regex]))

    val_metric = [metric] if metric in METRIC_NAMES else list(METRIC_NAMES)
    losses = [chart(tensorboard_tag(t), f"^{tensorboard_tag(t)}$")
              for t in ("train/loss", "val/loss", *(f"val/{m}" for m in val_metric))]
    training = [chart("lr", "^lr/"), chart("perf/tokens_per_sec", "^perf/tokens_per_sec$")]
    layout = layout_pb2.Layout(category=[layout_pb2.Category(title="losses (one line per run)", chart=losses),
                                         layout_pb2.Category(title="training", chart=training, closed=True)])
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME)
    return Summary(value=[Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor,
                                        metadata=SummaryMetadata(plugin_data=plugin))])


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger, for the dashboards of README "Dashboards":

    - metrics logged as `train/*` and `val/*` are written as `Train/*` and `Val/*`
      (`tensorboard_tag`), so TensorBoard lists the losses first (it sorts tag groups by name);
    - no `epoch` scalar (Lightning adds one to every call);
    - a Custom Scalars layout with the losses first (`scalars_layout`), written once at the start
      of fit, for the LightningModule's `metric`;
    - no `hparams.yaml` (the run's config is in `.hydra/config.yaml`; the HParams tab is
      `HParamsSummary`'s).

    With `name: ""` and `version: ""` the event files go straight into `save_dir`, the run folder,
    so that TensorBoard names each run by its folder.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layout_written = False

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        metrics = {tensorboard_tag(k): v for k, v in metrics.items() if k != "epoch"}
        if metrics:
            super().log_metrics(metrics, step)

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        # Lightning calls this once per fit / validate, with the LightningModule, before any metric
        if not self._layout_written:
            _write_summary(self.experiment, scalars_layout(run_metric(getattr(model, "_trainer", None), model)))
            self._layout_written = True
        super().log_graph(model, input_array)

    @rank_zero_only
    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.flush()


def tensorboard_writer(trainer: pl.Trainer) -> Any:
    """The SummaryWriter of the trainer's TensorBoardLogger on rank 0, else None."""
    if not trainer.is_global_zero:
        return None
    for logger in trainer.loggers:
        if isinstance(logger, LightningTensorBoardLogger):
            return logger.experiment
    return None


def _write_summary(writer: Any, summary: Any, step: int | None = None) -> None:
    # SummaryWriter has no public call for a prebuilt Summary proto; Lightning's own
    # TensorBoardLogger.log_hyperparams goes through the same file writer.
    writer._get_file_writer().add_summary(summary, step)


def log_array(writer: Any, tag: str, array: np.ndarray, meta: Mapping[str, Any], step: int) -> None:
    """A float32 tensor summary with `meta` (JSON) as its plugin data: the raw data of a figure."""
    from torch.utils.tensorboard.summary import tensor_proto

    summary = tensor_proto(tag, torch.as_tensor(np.asarray(array, dtype=np.float32)))
    plugin = summary.value[0].metadata.plugin_data
    plugin.plugin_name, plugin.content = "attnres_dashboard", json.dumps(dict(meta)).encode()
    _write_summary(writer, summary, step)


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
        step = trainer.global_step
        last = trainer.max_steps is not None and step == trainer.max_steps - 1
        if self._writer is not None and (self._due(step) or last):
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
PROBE_FILES = {"probe/routing": "routing.png", "probe/layer_knockout": "layer_knockout.png"}
PROBE_JSON = "probes.json"


def evaluation_batches(datamodule: Any, batches: int) -> list[tuple[Tensor, Tensor]]:
    """The probes' evaluation set: the first `batches` batches of the validation loader, in its
    order (all of them when it has fewer). The validation set is fixed, so this is too."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches={batches!r} must be an int >= 1 (validation batches the probes evaluate on)")
    out = []
    for batch in datamodule.val_dataloader():
        out.append((batch[0], batch[1]))
        if len(out) == batches:
            break
    if not out:
        raise ValueError("the validation set is empty; the probes need at least one validation batch")
    return out


def probe_figures(probe: probes.RoutingProbe, effect_limit: float | None = None) -> dict[str, tuple[np.ndarray, dict]]:
    """image tag -> (raw array, metadata) of the probe's figures (`figures.render_probe` draws them)."""
    common = {"strategy": probe.strategy, "mode": probe.mode, "clean_loss": probe.clean_loss, "tokens": probe.tokens}
    out = {}
    if probe.mass is not None and probe.source_effect is not None:
        R, C = probe.mass.shape
        data = np.full((4, R, C), np.nan)
        data[0], data[1] = probe.mass, probe.source_effect
        data[2, :, 0], data[3, :, 0] = probe.rank_correlation(), probe.top_agreement()
        finite = np.abs(probe.source_effect[np.isfinite(probe.source_effect)])
        limit = effect_limit or (float(finite.max()) if finite.size else None)
        out["probe/routing"] = (data, {**common, "rows": probe.row_labels, "cols": probe.col_labels,
                                       "sources": probe.sources, "effect_limit": limit})
    if probe.layer_effect is not None:
        out["probe/layer_knockout"] = (probe.layer_effect, {**common, "labels": probe.layer_labels})
    return out


def write_probes(probe: probes.RoutingProbe, run_dir: Path, step: int, writer: Any = None,
                 effect_limit: float | None = None, extra: Mapping[str, Any] | None = None) -> list[Path]:
    """`probes.json` (every number, `extra` added) in `run_dir`, the PNGs in `run_dir/plots/` and,
    given a SummaryWriter, the images and their raw arrays; each file written atomically.
    Returns the files written."""
    run_dir = Path(run_dir)
    written = [run_dir / PROBE_JSON]
    write_json(written[0], {**probe.to_dict(), "step": step, **(extra or {})})
    for tag, (data, meta) in probe_figures(probe, effect_limit).items():
        fig = figures.render_probe(tag, data, meta, step)
        path = run_dir / "plots" / PROBE_FILES[tag]
        atomic_write(path, lambda f, fig=fig: fig.savefig(f, dpi=figures.DPI, format="png"))
        written.append(path)
        if writer is not None:
            log_array(writer, figures.PROBE_TAGS[tag], data, meta, step)
            writer.add_image(tag, figures.to_rgb(fig), step, dataformats="HWC")
    if writer is not None:
        writer.flush()
    return written


class RoutingProbes(pl.Callback):
    """Source and layer knock-outs (`attnres.probes`) at the end of training (module docstring).

    enabled: off by default (a cost: about 42 forward passes of each batch for the default
    Block AttnRes model, 11 for the standard residual; README "Routing probes"). batches:
    validation batches in the evaluation set. mode: "remove" (renormalise over the other
    sources) or "mean" (replace the source by its mean over tokens). sources / layers: which
    knock-outs. max_stack: at most this many copies of a batch in one pass (memory grows with
    it: the logits are max_stack x B x T x V). dirpath: the run folder (default: the trainer's
    `default_root_dir`). Runs on rank 0, in eval mode without gradients, under the trainer's
    precision; a stop signal (SIGTERM, SIGINT) ends it between passes, and a failure is logged
    without failing the run, whose checkpoints are written already.
    """

    def __init__(self, enabled: bool = False, batches: int = 4, mode: str = "remove", sources: bool = True,
                 layers: bool = True, max_stack: int = 16, dirpath: str | None = None) -> None:
        for name, value in (("enabled", enabled), ("sources", sources), ("layers", layers)):
            if not isinstance(value, bool):
                raise ValueError(f"callbacks.routing_probes.{name} must be true or false, got {value!r}")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"callbacks.routing_probes.batches must be an int >= 1 (validation batches), "
                             f"got {batches!r}")
        if isinstance(max_stack, bool) or not isinstance(max_stack, int) or max_stack < 1:
            raise ValueError(f"callbacks.routing_probes.max_stack must be an int >= 1 (copies of a batch in one "
                             f"pass), got {max_stack!r}")
        if mode not in probes.MODES:
            raise ValueError(f"callbacks.routing_probes.mode must be one of {', '.join(probes.MODES)}, got {mode!r}")
        self.enabled, self.batches, self.mode, self.sources, self.layers = enabled, batches, mode, sources, layers
        self.max_stack, self.dirpath = max_stack, dirpath
        self.seconds = 0.0  # wall time of the last probe (for the record)
        self.result: probes.RoutingProbe | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero:
            return
        if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
            rank_zero_warn(f"RoutingProbes: off under {type(trainer.strategy).__name__} (sharded parameters)")
            return
        stop = next((c for c in trainer.callbacks if hasattr(c, "received") and hasattr(c, "exit_code")), None)
        if stop is not None and stop.received is not None:
            return
        start = time.perf_counter()
        try:
            batches = evaluation_batches(trainer.datamodule, self.batches)
            with trainer.precision_plugin.forward_context():
                self.result = probes.probe_routing(
                    pl_module.model, batches, mode=self.mode, sources=self.sources, layers=self.layers,
                    max_stack=self.max_stack,
                    should_stop=(lambda: stop.received is not None) if stop is not None else None)
            run_dir = Path(self.dirpath or trainer.default_root_dir)
            write_probes(self.result, run_dir, trainer.global_step, tensorboard_writer(trainer),
                         extra={"evaluation_set": f"the first {len(batches)} validation batches"})
        except probes.ProbesStopped:
            log.warning("routing probes: stopped by a signal; no probe results written")
            return
        except Exception as err:  # the run itself has finished: a probe failure must not fail it
            log.warning(f"routing probes failed and were skipped: {type(err).__name__}: {err}")
            return
        finally:
            self.seconds = time.perf_counter() - start
        log.info(f"routing probes: {self.seconds:.1f} s on {self.result.tokens} validation tokens; "
                 f"{run_dir / PROBE_JSON}, {run_dir / 'plots'}/")


class HParamsSummary(pl.Callback):
    """Writes `hparams` (name -> bool/int/float/str, None = not applicable to this run) and
    the metric names for TensorBoard's HParams tab at fit start, and the session's end status
    at fit end. TensorBoard fills each metric column with the last value of that scalar tag in
    the run, so a run shows its final validation once `attnres-run` has run it after fit.

    `metrics` are named as the LightningModule logs them (`val/loss`); only those this run logs
    are declared (`val/bpb` for bits-per-byte data, `val/accuracy` for the synthetic task: the
    LightningModule's `metric`), under their TensorBoard tags (`Val/loss`, see
    `tensorboard_tag`). `varying` names the columns a sweep varies: they are declared as
    differing across runs, which makes TensorBoard list them first and show them by default (it
    shows the first five hyperparameters: these, then the others by name).

    Every run of a sweep over one kind of data writes the same experiment definition (same
    names, same types: a None is declared numeric and left empty, and TensorBoard then leaves
    that run out of the parallel coordinates), because TensorBoard reads it from one run only.
    `parameters` (the model's parameter count) is added when the model can count them.
    """

    def __init__(self, hparams: Mapping[str, Any], metrics: Sequence[str] = ("val/loss",),
                 varying: Sequence[str] = ()) -> None:
        bad = {k: v for k, v in hparams.items() if v is not None and not isinstance(v, (bool, int, float, str))}
        if bad:
            raise ValueError(f"hparams values must be bool, int, float, str or null; got {bad}")
        unknown = [k for k in varying if k not in hparams and k != "parameters"]
        if unknown:
            raise ValueError(f"varying names {unknown}, which are not in hparams ({', '.join(hparams)})")
        self.hparams, self.metrics, self.varying = dict(hparams), list(metrics), list(varying)
        self._writer: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._writer = tensorboard_writer(trainer)
        if self._writer is None:
            return
        values = dict(self.hparams)
        model = getattr(pl_module, "model", None)
        if hasattr(model, "num_parameters"):
            values["parameters"] = model.num_parameters()
        metrics = [tensorboard_tag(m) for m in logged_metrics(self.metrics, run_metric(trainer, pl_module))]
        experiment, start, _ = hparams_summaries(values, metrics, varying=self.varying)
        _write_summary(self._writer, experiment)
        _write_summary(self._writer, start)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end("STATUS_SUCCESS")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end("STATUS_FAILURE")

    def _end(self, status: str) -> None:
        if self._writer is not None:
            _write_summary(self._writer, hparams_summaries({}, [], status)[2])
            self._writer = None


def hparams_summaries(values: Mapping[str, Any], metrics: Sequence[str], status: str = "STATUS_SUCCESS",
                      varying: Sequence[str] = ()) -> tuple:
    """(experiment, session start, session end) Summary protos of the HParams plugin; the
    hyperparameters named in `varying` are declared as differing across the runs."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    def summary(tag: str, **content: Any) -> Summary:
        data = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **content)
        plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString())
        return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])

    infos, start = [], plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, value in values.items():
        if isinstance(value, bool):
            kind = "DATA_TYPE_BOOL"
            start.hparams[name].bool_value = value
        elif isinstance(value, str):
            kind = "DATA_TYPE_STRING"
            start.hparams[name].string_value = value
        else:  # int, float, or None (declared numeric, left empty in this run)
            kind = "DATA_TYPE_FLOAT64"
            if value is not None:
                start.hparams[name].number_value = value
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind), differs=name in varying))
    experiment = api_pb2.Experiment(
        hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metrics]
    )
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(status), end_time_secs=time.time())
    return (summary(metadata.EXPERIMENT_TAG, experiment=experiment),
            summary(metadata.SESSION_START_INFO_TAG, session_start_info=start),
            summary(metadata.SESSION_END_INFO_TAG, session_end_info=end))
