"""Experiment trackers beside TensorBoard (`logger=mlflow`, `wandb`, `many`; conf/logger/): one tracked
run per run folder, grouped by its sweep, with the run's flat hyperparameters (those of the HParams
tab, `tracked_hparams`), its metrics as it trains, its final numbers (`finish_trackers`), and a
sweep's verdict lines (`log_sweep`, called by the sweep's summary callback).

MLflow writes to a SQLite store (conf/logger/mlflow.yaml); W&B writes offline run folders inside
each run folder unless `mode=online`. Neither library is imported before a logger of its own is built.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.loggers import CSVLogger as LightningCSVLogger
from pytorch_lightning.loggers import MLFlowLogger as LightningMLFlowLogger
from pytorch_lightning.loggers import WandbLogger as LightningWandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter as CSVExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.utilities import rank_zero_only

log = logging.getLogger("attnres")

#: Lightning's MLflow logger cuts parameter values at 250 characters; every tracker gets the same values
MAX_VALUE_CHARS = 250
#: the columns a sweep varies, first, when the config names none (`callbacks.hparams.varying`)
FIRST = ("residual", "num_blocks", "seed")
#: the numbers of metrics.json sent as a run's final numbers (beside its last `val/*` and `train/*`)
FINAL_NUMBERS = ("tokens_per_sec", "peak_memory_bytes", "wall_time_s", "tokens_seen", "steps", "parameters",
                 "skipped_steps", "mfu")


def _short(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float)) else str(value)[:MAX_VALUE_CHARS]


def tracked_hparams(cfg: DictConfig, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run's hyperparameters, flat and readable: the HParams tab's columns
    (`callbacks.hparams.hparams`), the ones a sweep varies first (residual, num_blocks, seed), then
    the optimiser's class; without that callback, the same few from the config. String values are
    cut to `MAX_VALUE_CHARS`."""
    info = info or {}
    node = OmegaConf.select(cfg, "callbacks.hparams", default=None)
    values: dict[str, Any] = {}
    varying: Sequence[str] = FIRST
    if isinstance(node, DictConfig) and "hparams" in node:
        with contextlib.suppress(Exception):  # an interpolation this process cannot resolve: the fallback
            values = OmegaConf.to_container(node.hparams, resolve=True)  # type: ignore[assignment]
            varying = list(node.get("varying") or FIRST)
    if not values:
        values = {"residual": info.get("residual"),
                  "num_blocks": OmegaConf.select(cfg, "residual.num_blocks", default=0),
                  "seed": cfg.get("seed"), "model": info.get("model"), "data": info.get("data"),
                  "lr": OmegaConf.select(cfg, "optim.optimizer.lr", default=None)}
    target = str(OmegaConf.select(cfg, "optim.optimizer._target_", default="") or "")
    if target:
        values["optimizer"] = target.rsplit(".", 1)[-1]
    muon_lr = OmegaConf.select(cfg, "optim.optimizer.muon.lr", default=None)
    if muon_lr is not None:
        values["muon_lr"] = muon_lr
    ordered = {k: values[k] for k in varying if k in values}
    ordered.update((k, v) for k, v in values.items() if k not in ordered)
    return {str(k)[:MAX_VALUE_CHARS]: _short(v) for k, v in ordered.items()}


def sweep_label(sweep_dir: str | Path) -> str:
    """How trackers name a sweep: its folder as the user named it (relative to here when inside)."""
    relative = os.path.relpath(Path(sweep_dir).absolute())
    return str(Path(sweep_dir).absolute()) if relative.startswith("..") else relative


class TrackedParams:
    """A logger that gets the run's flat hyperparameters (`make_loggers` passes them as `hparams`,
    with the run's folder and sweep) and sends them at the start of fit (Lightning's `log_graph`
    call: it calls `log_hyperparams` only for a module that saved its own)."""

    tracked: dict[str, Any]
    _params_sent = False

    def log_hyperparams(self, params: Any) -> None:
        super().log_hyperparams({**self.tracked, **dict(params or {})})  # type: ignore[misc]
        self._params_sent = True

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        if not self._params_sent:
            self.log_hyperparams({})
        super().log_graph(model, input_array)  # type: ignore[misc]


class Tracker(TrackedParams):
    """A tracking service: its run ends once, with metrics.json's final numbers (`finish`, from
    `finish_trackers`), or at exit if they never come; a failure or a signal ends it at once."""

    _waiting = False

    def finalize(self, status: str) -> None:
        if status != "success":  # failed, or stopped by a signal: that ends the tracked run now
            self.close(status)
            return
        if not self._waiting:  # fit ended: `finish_trackers` follows (after a final validation, if any)
            self._waiting = True
            atexit.register(self.close, "success")

    def close(self, status: str) -> None:
        raise NotImplementedError

    def finish(self, summary: Mapping[str, Any]) -> str | None:
        """Send the final numbers of metrics.json and end the run; returns a line for the end block."""
        raise NotImplementedError


def final_numbers(summary: Mapping[str, Any]) -> dict[str, float]:
    numbers = {k: v for k, v in (summary.get("metrics") or {}).items() if isinstance(v, (int, float))}
    for key in FINAL_NUMBERS:
        value = summary.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[f"run/{key}"] = value
    return numbers


@contextlib.contextmanager
def _store_lock(tracking_uri: str) -> Iterator[None]:
    """For a SQLite store: its folder made, and one process at a time creating tables, experiments
    and runs in it (the jobs of a sweep start together)."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    path = Path(tracking_uri.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in ("alembic", "mlflow.store.db.utils"):  # the store's first use: a page of table migrations
        logging.getLogger(name).setLevel(logging.WARNING)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


#: MLflow 3 files each experiment under GenAI apps or model training by this tag (else it guesses)
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
#: the UI's own query parameter that opens an experiment on its table of runs: MLflow 3.x's UI starts in
#: its GenAI view (an empty traces page for these experiments) until the toggle says "Model training"
RUNS_VIEW = "workflowType=machine_learning"


def mlflow_where(tracking_uri: str, experiment_id: str) -> str:
    """How to open an experiment's runs: the `mlflow ui` command for a local store, then the page."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}?{RUNS_VIEW}"
    return (f"mlflow ui --backend-store-uri {tracking_uri}, then open "
            f"http://127.0.0.1:5000/#/experiments/{experiment_id}?{RUNS_VIEW}")


class MLflowLogger(Tracker, LightningMLFlowLogger):
    """Lightning's MLFlowLogger, one MLflow run per run folder: the experiment is `experiment_name`,
    else the sweep's folder for a sweep job and the config's `name` for a single run; the run is
    named after its folder and tagged with it (`attnres_run_dir`, and `attnres_sweep`).

    The store is opened when the run starts logging, not when the logger is built (Lightning's
    builds an MlflowClient at once, and for SQLite that creates the file): a run refused before
    it starts, or a rank other than 0, leaves no store behind."""

    #: what Lightning's constructor gets instead of the store: an MlflowClient for it opens nothing
    _UNOPENED = "http://127.0.0.1:1"

    def __init__(self, tracking_uri: str, experiment_name: str | None = None, run_name: str | None = None,
                 tags: Mapping[str, Any] | None = None, *, run_dir: str | None = None, sweep: str | None = None,
                 name: str = "default", hparams: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        run_tags = dict(tags or {})
        if run_dir:
            run_tags["attnres_run_dir"] = str(Path(run_dir).absolute())
        if sweep:
            run_tags["attnres_sweep"] = sweep
        super().__init__(experiment_name=experiment_name or sweep or name,
                         run_name=run_name or (Path(run_dir).name if run_dir else None),
                         tracking_uri=self._UNOPENED, tags=run_tags, **kwargs)
        self._tracking_uri, self._mlflow_client, self._continues = tracking_uri, None, None
        self.tracked = dict(hparams or {})

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._initialized:
            return self._mlflow_client
        from mlflow.tracking import MlflowClient

        with _store_lock(self._tracking_uri):  # the store made, the experiment found or made, once
            if self._mlflow_client is None:
                self._mlflow_client = MlflowClient(self._tracking_uri)
            if self._experiment_id is None:  # another job may have just made it: look again under the lock
                found = self._mlflow_client.get_experiment_by_name(self._experiment_name)
                if found is not None and found.lifecycle_stage != "deleted":
                    self._experiment_id = found.experiment_id
                else:
                    self._experiment_id = self._mlflow_client.create_experiment(
                        self._experiment_name, artifact_location=self._artifact_location)
                found = self._mlflow_client.get_experiment(self._experiment_id)
                if EXPERIMENT_KIND not in (found.tags or {}):  # MLflow 3's UI then opens it on its runs
                    self._mlflow_client.set_experiment_tag(self._experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
            if self._run_id is None and (self.tags or {}).get("attnres_run_dir"):
                self.tags.update(self._earlier_runs(self.tags["attnres_run_dir"]))
            client = LightningMLFlowLogger.experiment.fget(self)
            if self._continues:  # the earlier run points at the one that continues it
                client.set_tag(self._continues, "attnres_continued_in", self._run_id)
                self._continues = None
            return client

    def _earlier_runs(self, run_dir: str) -> dict[str, str]:
        """The MLflow runs an earlier start of this run folder left: one still RUNNING was killed
        (this process holds the folder's lock, so no live process logs to it) and is marked KILLED;
        the new run is tagged with the newest of them (`attnres_continues`), which gets
        `attnres_continued_in` once the new run exists."""
        quote = "'" if "'" not in run_dir else '"'
        earlier = self._mlflow_client.search_runs(
            [self._experiment_id], filter_string=f"tags.attnres_run_dir = {quote}{run_dir}{quote}",
            order_by=["attributes.start_time DESC"], max_results=50)
        for run in earlier:
            if run.info.status == "RUNNING":
                self._mlflow_client.set_tag(run.info.run_id, "attnres_status", "killed")
                self._mlflow_client.set_terminated(run.info.run_id, status="KILLED")
        self._continues = earlier[0].info.run_id if earlier else None
        return {"attnres_continues": self._continues} if earlier else {}

    @rank_zero_only
    def close(self, status: str) -> None:
        LightningMLFlowLogger.finalize(self, status)

    @rank_zero_only
    def finish(self, summary: Mapping[str, Any]) -> str | None:
        if not self._initialized:
            return None
        from mlflow.entities import Metric, RunTag

        step = int(summary.get("steps") or 0)
        now = int(time.time() * 1000)
        metrics = [Metric(key=k, value=float(v), timestamp=now, step=step) for k, v in final_numbers(summary).items()]
        tags = [RunTag("attnres_status", str(summary.get("status")))]
        self.experiment.log_batch(run_id=self.run_id, metrics=metrics, tags=tags)
        self.close("success" if summary.get("status") == "finished" else "failed")
        return f"  MLflow       {mlflow_where(self._tracking_uri, self._experiment_id)}  (run {self._run_name})"

    @classmethod
    def log_sweep(cls, node: DictConfig, sweep_dir: Path, lines: Sequence[str],
                  rows: Sequence[Mapping[str, Any]] = ()) -> None:
        """The verdict lines, then summary.md, as the sweep's experiment's note (its description
        in the MLflow UI, which shows the first line folded), each verdict line as an experiment
        tag `attnres_verdict_N`, and each job's run renamed to the summary's short label (the
        overrides that differ between the jobs; the folder stays in `attnres_run_dir`)."""
        from mlflow.tracking import MlflowClient
        from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

        uri = str(node.tracking_uri)
        name = OmegaConf.select(node, "experiment_name", default=None) or sweep_label(sweep_dir)
        with _store_lock(uri):
            client = MlflowClient(uri)
            experiment = client.get_experiment_by_name(name)
            if experiment is None:  # no job reached its tracker
                return
            summary = sweep_dir / "summary.md"
            note = "\n\n".join(f"verdict: {line}" for line in lines)
            if summary.is_file():
                note += "\n\n" + summary.read_text()
            client.set_experiment_tag(experiment.experiment_id, "mlflow.note.content", note[:20000])
            for i, line in enumerate(lines):
                client.set_experiment_tag(experiment.experiment_id, f"attnres_verdict_{i}", line[:8000])
            labels = {str(Path(r["path"]).absolute()): str(r["job"]) for r in rows
                      if r.get("path") and r.get("job") and not str(r.get("status", "")).startswith("duplicate")}
            for run in client.search_runs([experiment.experiment_id], max_results=50000):
                label = labels.get(run.data.tags.get("attnres_run_dir", ""))
                if label and run.info.run_name != label:
                    client.set_tag(run.info.run_id, MLFLOW_RUN_NAME, label[:MAX_VALUE_CHARS])


class WandbLogger(Tracker, LightningWandbLogger):
    """Lightning's WandbLogger, one W&B run per run folder (`name`: the folder's name), grouped by
    its sweep (`group`: the sweep's folder) and finished at the end of its job, so that a sweep is
    never merged into one run. `mode` offline writes `<save_dir>/wandb/offline-run-*`, for
    `wandb sync` to upload later; online uploads as it goes."""

    def __init__(self, project: str = "attnres", mode: str = "offline", name: str | None = None,
                 group: str | None = None, *, run_dir: str | None = None, sweep: str | None = None,
                 hparams: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(project=project, mode=mode, name=name or (Path(run_dir).name if run_dir else None),
                         group=group or sweep, job_type="train", **kwargs)
        self._wandb_init.pop("anonymous", None)  # Lightning passes it; wandb warns that it does nothing
        self.tracked = dict(hparams or {})

    @rank_zero_only
    def close(self, status: str) -> None:
        if self._experiment is None:
            return
        LightningWandbLogger.finalize(self, status)
        self._experiment.finish(exit_code=0 if status == "success" else 1)

    @rank_zero_only
    def finish(self, summary: Mapping[str, Any]) -> str | None:
        if self._experiment is None:
            return None
        self._experiment.summary.update({**final_numbers(summary), "run/status": str(summary.get("status"))})
        folder = getattr(self._experiment, "dir", None)
        offline = getattr(getattr(self._experiment, "settings", None), "mode", "") in ("offline", "dryrun")
        self.close("success" if summary.get("status") == "finished" else "failed")
        if offline and folder:
            return f"  W&B          wandb sync {os.path.relpath(Path(folder).parent)}  (offline run; uploads it)"
        return f"  W&B          {getattr(self._experiment, 'url', None) or 'run ' + str(self._name)}"

    @classmethod
    def log_sweep(cls, node: DictConfig, sweep_dir: Path, lines: Sequence[str],
                  rows: Sequence[Mapping[str, Any]] = ()) -> None:
        """A `sweep summary` run in the sweep's group: the verdict lines as its notes and summary."""
        import wandb

        group = OmegaConf.select(node, "group", default=None) or sweep_label(sweep_dir)
        keys = ("project", "entity", "mode", "tags")
        settings = {k: OmegaConf.select(node, k, default=None) for k in keys}
        run = wandb.init(**{k: v for k, v in settings.items() if v is not None}, dir=str(sweep_dir), group=group,
                         name="sweep summary", job_type="summary", notes="\n".join(lines), reinit="create_new")
        run.summary.update({f"verdict/{i}": line for i, line in enumerate(lines)})
        run.finish()


class CSVLogger(TrackedParams, LightningCSVLogger):
    """Lightning's CSVLogger with the run's hyperparameters in hparams.yaml, except that a resumed
    run appends to the run folder's metrics.csv instead of deleting it (Lightning starts the file
    again, and warns, in any folder not empty)."""

    def __init__(self, *args: Any, run_dir: str | None = None, sweep: str | None = None,
                 hparams: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracked = dict(hparams or {})

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class _AppendingWriter(CSVExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):  # the header so far: new columns rewrite it, old rows kept
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = next(csv.reader(file), [])


def make_loggers(cfg: DictConfig, run_dir: Path, info: Mapping[str, Any]) -> list[Any]:
    """The run's loggers (`cfg.logger`); trackers get the run's folder, its sweep and its hparams."""
    from hydra.utils import get_class, instantiate

    loggers = []
    for node in cfg.logger.values():
        target = OmegaConf.select(node, "_target_", default=None)
        cls = get_class(target) if isinstance(target, str) else None
        if isinstance(cls, type) and issubclass(cls, TrackedParams):
            sweep = sweep_label(run_dir.parent) if info.get("multirun") else None
            extra: dict[str, Any] = {"run_dir": str(run_dir), "sweep": sweep, "hparams": tracked_hparams(cfg, info)}
            if cls is MLflowLogger or issubclass(cls, MLflowLogger):
                extra["name"] = str(cfg.get("name") or "default")
            loggers.append(instantiate(node, _convert_="all", **extra))
        else:
            loggers.append(instantiate(node))
    return loggers


def finish_trackers(loggers: Sequence[Any], summary: Mapping[str, Any]) -> list[str]:
    """End every tracked run with metrics.json's final numbers; the lines that say where they are."""
    lines = []
    for logger in loggers:
        if isinstance(logger, Tracker):
            line = logger.finish(summary)
            if line:
                lines.append(line)
    return lines


def log_sweep(config: DictConfig, sweep_dir: Path, lines: Sequence[str],
              rows: Sequence[Mapping[str, Any]] = ()) -> None:
    """Send a sweep's verdict lines (and, for MLflow, the summary's short job labels as run names;
    `rows` are the summary's) to the trackers its jobs used; a tracker that fails says so in one
    line and the sweep's own summary stands."""
    import sys

    from hydra.utils import get_class

    for key in list((OmegaConf.select(config, "logger", default=None) or {}).keys()):
        node = config.logger[key]
        try:
            target = OmegaConf.select(node, "_target_", default=None)
            cls = get_class(target) if isinstance(target, str) else None
            if isinstance(cls, type) and issubclass(cls, Tracker):
                cls.log_sweep(node, sweep_dir, lines, rows)
        except Exception as err:  # the summary files are written; a tracker must not lose them
            print(f"summary: verdicts not sent to logger {key} ({type(err).__name__}: {err})", file=sys.stderr,
                  flush=True)
