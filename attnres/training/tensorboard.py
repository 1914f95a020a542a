"""TensorBoard: the logger and its layout, the step axis every logger shares, raw arrays beside the
figures (`log_array`, read back by `attnres-plot`), and the HParams tab's callback (`HParamsSummary`;
what the tab shows of a run in its sweep is attnres/training/hparams.py).
"""


from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger as LightningTensorBoardLogger
from pytorch_lightning.utilities import rank_zero_only

from attnres.training.hparams import column_value, hparams_summaries, run_stage, short_trial_name, sweep_varying

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


class StepAxis(pl.Callback):
    """Every logger's x-axis is the number of optimiser steps taken, as the run's log says it: the
    metrics after the 20th step are at step 20. (Lightning's own axis counts from 0 during fit, so
    a 20-step run's losses and in-fit validations ended at 19, a validation after fit at 20, the
    dashboard's figures at 20.) Lightning takes a logged `step` as the axis of that call's metrics."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.log("step", float(trainer.global_step), on_step=True, on_epoch=False)

    # A second call, not one serving both: Lightning writes a training step's metrics and a validation's from
    # two result collections, and a value logged into one never reaches the other's write. Without this one a
    # validation during fit falls back to Lightning's count, one early (9 and 19 in a 20-step run validated
    # every 10; measured on Lightning 2.6).
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            pl_module.log("step", float(trainer.global_step), on_step=False, on_epoch=True, sync_dist=True)


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger, for the dashboards of docs/dashboards.md:

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

    A job of a sweep is named in the table by what differs between the sweep's jobs, as its sweep
    planned it (`attnres.results.summary.write_trial_names`); a run alone, by its folder.

    Every run of a sweep over one kind of data writes the same experiment definition (same
    names, same types), because TensorBoard reads it from one run only: integers are written as
    text (TensorBoard shows numbers with four decimals: seed 1.0000) and a None as "-" (num_blocks
    of a strategy without blocks read 0.0000). The columns a sweep varies are declared as differing
    too (`sweep_varying`: a tuned sweep's searched lr), and a `stage` column says which runs are a
    tuned sweep's search and which its verdict (`run_stage`). `parameters` (the model's parameter
    count) is added when the model can count them.
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
        run_dir = Path(self._writer.get_logdir())
        values["stage"] = run_stage(run_dir)
        values = {k: column_value(v) for k, v in values.items()}
        experiment, start, _ = hparams_summaries(values, metrics, varying=sweep_varying(run_dir, values, self.varying),
                                                 trial=short_trial_name(run_dir))
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

