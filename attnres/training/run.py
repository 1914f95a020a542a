"""One run under Lightning: check the config, instantiate the parts, fit, validate, write metrics.json.

`train(cfg, run_dir, info)` is the whole life of a run; `attnres-run` calls it for a single run,
and a sweep job's own process calls it directly (`attnres.sweep.job`).
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, read_write
from pytorch_lightning.callbacks import ProgressBar, Timer
from pytorch_lightning.utilities.exceptions import SIGTERMException

from attnres.atomic import read_json
from attnres.config import naming  # noqa: F401  (registers the run-folder resolver)
from attnres.config.computation import computation, recorded_computation, refuse_other_computation
from attnres.config.errors import ConfigError
from attnres.config.moved import update_moved_targets
from attnres.config.rules import validate_config
from attnres.training.checkpoints import (
    AtomicCheckpointIO,
    check_checkpoint,
    checkpoint_step,
    describe_checkpoint,
    resume_checkpoint,
)
from attnres.training.devices import keep_freed_memory, resolve_precision
from attnres.training.evaluate import run_mode
from attnres.training.faults import (
    GracefulStop,
    Interrupted,
    NonFiniteLoss,
    RunLock,
    clean_stale_tmp,
    clear_previous_run,
    secondary_rank,
    stop_signals,
)
from attnres.training.lit import LitLanguageModel
from attnres.training.machine_load import MachineLoad
from attnres.training.report import (
    config_summary,
    end_block,
    end_interrupted,
    end_nonfinite,
    events_dir,
    logs_figures,
    mark_running,
    report,
    share_log_file,
    write_summary,
)
from attnres.training.tensorboard import StepAxis
from attnres.training.trackers import finish_trackers, make_loggers

log = logging.getLogger("attnres")
# Lightning 2.6 with torch >= 2.10 warns about its own use of a torch API, once per run,
# and advertises a cloud service at every start; neither is the user's concern
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
# a step skipped by nonfinite.policy=skip|rollback returns None on purpose (and says so in the log)
warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`")
# where SLURM is installed Lightning advises running every process under `srun`; attnres's SLURM
# launcher places its jobs itself (attnres.sweep.slurm), so the advice is wrong for its runs
warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system")
# the validation numbers are summed over ranks by hand (lit.py, on_validation_epoch_end) before they
# are logged, so Lightning's advice to let it average them again (sync_dist=True) does not apply
warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/")
# a resumed run's checkpoint folder holds its checkpoints by design: the refusal of a folder that
# holds a run (resume=true, overwrite=true, attnres/training/checkpoints.py) is what guards it
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
# Lightning's start and stop lines ("GPU available: ...", "`Trainer.fit` stopped: ...") say nothing
# the run's own start and end lines do not say better
_QUIET = ("💡", "GPU available", "TPU available", "HPU available", "`Trainer.fit` stopped")
logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(lambda r: not str(r.msg).startswith(_QUIET))


def finished_already(run_dir: Path, ckpt: str, max_steps: Any, max_time: Any = None,
                     stop_at_step: Any = None) -> dict | None:
    """`resume=true` on a run that finished at its `max_steps`, at a `max_time` no larger than the
    one it is given now, or paused at a `stop_at_step` no earlier than the one it is given now: nothing
    to train, and its checkpoint and metrics.json stay as they are (a
    resume would rewrite them without the training figures). Returns its metrics after saying so;
    None when there is more to train."""
    summary = read_json(run_dir / "metrics.json")
    step = checkpoint_step(ckpt)
    if summary.get("status") != "finished" or not isinstance(max_steps, int) or max_steps < 1 or step is None:
        return None
    if step < max_steps and isinstance(stop_at_step, int) and step >= stop_at_step:
        report(f"{run_dir} holds a run paused at step {step} of {max_steps}: nothing to do for stop_at_step="
               f"{stop_at_step}; its metrics are in {run_dir / 'metrics.json'} (a larger stop_at_step, or none, "
               "continues it)")
        return summary
    if step < max_steps:
        limit, before = time_limit_s(max_time), time_limit_s(summary.get("max_time"))
        if summary.get("stopped_by") != "trainer.max_time" or limit is None or before is None or limit > before:
            return None
        report(f"{run_dir} holds a run that trainer.max_time={max_time} ended (step {step} of {max_steps}): "
               f"nothing to do; its metrics are in {run_dir / 'metrics.json'} (a larger trainer.max_time, or none, "
               "continues it)")
        return summary
    report(f"{run_dir} holds a finished run (step {step} of {max_steps}): nothing to do; its metrics are in "
           f"{run_dir / 'metrics.json'} (a larger trainer.max_steps continues it)")
    return summary


MAX_TIME = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def time_limit_s(max_time: Any) -> float | None:
    """Seconds of `trainer.max_time` (DD:HH:MM:SS), None without one; ConfigError for another form."""
    if max_time is None:
        return None
    found = MAX_TIME.match(str(max_time).strip())
    if not found or isinstance(max_time, bool):
        raise ConfigError(f"trainer.max_time={max_time} is not a time; write DD:HH:MM:SS, e.g. "
                          "trainer.max_time=00:00:30:00 for 30 minutes (or trainer.max_time=null for none)")
    days, hours, minutes, seconds = map(int, found.groups())
    if hours > 23 or minutes > 59 or seconds > 59 or days * 86400 + hours * 3600 + minutes * 60 + seconds == 0:
        raise ConfigError(f"trainer.max_time={max_time} is out of range; write DD:HH:MM:SS with hours under 24 and "
                          "minutes and seconds under 60, above zero, e.g. trainer.max_time=00:00:30:00")
    return float(days * 86400 + hours * 3600 + minutes * 60 + seconds)


class StopAtStep(pl.Callback):
    """`stop_at_step`: training pauses at that step; the schedule, which reads `trainer.max_steps`,
    goes on spanning the whole run, so a resume with a later stop continues the same run exactly."""

    def __init__(self, step: int) -> None:
        self.step = step

    def _check(self, trainer: pl.Trainer) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer)  # resumed at or past it: not one step more

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer)


def stopped_by(trainer: pl.Trainer) -> str | None:
    """Which limit ended training: `trainer.max_steps`, `stop_at_step`, `trainer.max_time`, or None
    (e.g. fast_dev_run)."""
    if trainer.max_steps and 0 < trainer.max_steps <= trainer.global_step:
        return "trainer.max_steps"
    pause = next((c for c in trainer.callbacks if isinstance(c, StopAtStep)), None)
    if pause is not None and trainer.global_step >= pause.step:
        return "stop_at_step"
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is not None and timer.time_remaining("train") is not None and timer.time_remaining("train") <= 0:
        return "trainer.max_time"
    return None


def check_nodes(cfg: DictConfig) -> None:
    """`trainer.num_nodes` > 1 needs the other nodes started by a cluster (SLURM's tasks, or
    torchrun's): on one machine Lightning would wait for them forever."""
    nodes = cfg.trainer.get("num_nodes") or 1
    if isinstance(nodes, int) and nodes > 1 and not ({"SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"} & set(os.environ)):
        raise ConfigError(f"trainer.num_nodes={nodes} needs a launcher that starts every node's processes "
                          "(attnres-run -m hydra/launcher=slurm, or torchrun); on one machine pass trainer.num_nodes=1 "
                          "(experiment=paper_*: gpus_per_job=<the GPUs here>)")


def end_tasks(tasks: Any, cfg: DictConfig, datamodule: Any) -> Any:
    """`eval.tasks`, checked before training by `tasks.prepare`; without `tasks` a config that names
    some is refused (a caller of `train` that runs no tasks must not drop them silently)."""
    if tasks is not None:
        return tasks.prepare(cfg, datamodule)
    if (cfg.get("eval") or {}).get("tasks"):
        raise ConfigError("eval.tasks is set but this caller of train() runs no tasks; pass tasks=attnres.tasks.main")
    return None


def train(cfg: DictConfig, run_dir: Path, info: dict[str, Any], tasks: Any = None) -> dict:
    """One run into `run_dir`; `cfg` is the composed config, `info` goes into metrics.json. `tasks`
    runs `eval.tasks` at the end (its `prepare` before training, `after_training` after): the caller
    passes `attnres.tasks.main`, which sits above training (it evaluates finished runs), so training
    cannot import it."""
    with read_write(cfg):
        update_moved_targets(cfg)  # a config written before the runner was split names old paths
    validate_config(cfg)
    check_nodes(cfg)
    time_limit_s(cfg.trainer.get("max_time"))  # a limit Lightning cannot read is refused before any work
    if cfg.get("threads"):  # the user's word wins over the launcher's per-slot default
        torch.set_num_threads(int(cfg.threads))
    if cfg.get("keep_freed_memory", True):
        keep_freed_memory()  # before the first large tensor
    if cfg.get("mode", "train") != "train":  # mode=eval | sample: a checkpoint, no training
        return run_mode(cfg, run_dir, info)
    share_log_file()
    last = run_dir / "checkpoints" / "last.ckpt"
    with RunLock(run_dir), stop_signals(GracefulStop(last, describe_checkpoint)) as stop:
        clean_stale_tmp(run_dir)
        ckpt = resume_checkpoint(run_dir, cfg.resume, cfg.ckpt_path, cfg.overwrite)
        if ckpt and cfg.resume and not cfg.ckpt_path:
            done = finished_already(run_dir, ckpt, cfg.trainer.get("max_steps"), cfg.trainer.get("max_time"),
                                    cfg.get("stop_at_step"))
            if done is not None:
                return done
        log.info(f"run folder: {run_dir}" + (f" (resuming from {ckpt})" if ckpt else ""))
        log.info(config_summary(cfg, info))
        pl.seed_everything(cfg.seed, workers=True, verbose=False)

        datamodule = instantiate(cfg.data)
        prepared = end_tasks(tasks, cfg, datamodule)  # lm-eval installed and every task's data local, or refused now
        model = instantiate(cfg.model, vocab_size=datamodule.vocab_size, residual=instantiate(cfg.residual))
        module = LitLanguageModel(
            model,
            optimizer=instantiate(cfg.optim.optimizer),
            schedule=instantiate(cfg.optim.schedule),
            query_lr_scale=cfg.optim.query_lr_scale,
            total_steps=cfg.optim.total_steps,
            compile=cfg.compile,
            metric=datamodule.metric,
            seed=cfg.seed,
            nonfinite=OmegaConf.to_container(cfg.nonfinite),
            rollback_checkpoint=last,
        )
        module.run_config = computation(cfg)
        if ckpt:
            loaded = check_checkpoint(ckpt, module)
            # Hydra has rewritten this run's .hydra/ by now: only another run's folder still tells
            elsewhere = Path(ckpt).resolve().parent.parent != run_dir.resolve()
            recorded = recorded_computation(ckpt, run_config=elsewhere, loaded=loaded)
            refuse_other_computation(ckpt, recorded, module.run_config)
        if cfg.overwrite:  # every check has passed: only now is the previous run removed
            clear_previous_run(run_dir)
        loggers = make_loggers(cfg, run_dir, info)  # trackers get the run folder, its sweep and its hparams
        callbacks = [instantiate(c) for c in cfg.callbacks.values()] + [stop, StepAxis()]
        if not cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar it was told not to show
            callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
        load = MachineLoad()  # the machine's load while it trains: metrics.json (results/cost.py reads it)
        callbacks.append(load)
        if cfg.get("stop_at_step") is not None:
            callbacks.append(StopAtStep(int(cfg.stop_at_step)))
        trainer = instantiate(
            cfg.trainer,
            precision=resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator),
            logger=loggers or False,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
        )

        if not secondary_rank():  # from here the checkpoints change: the old record describes none of them
            mark_running(run_dir, ckpt)
        start = time.perf_counter()
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        except (Interrupted, SIGTERMException) as err:  # Lightning's own, if the signal beat our handler
            raise end_interrupted(err, stop, trainer, module, run_dir, {**info, "resumed_from": ckpt},
                                  time.perf_counter() - start) from err
        except NonFiniteLoss as err:
            raise end_nonfinite(err, trainer, module, run_dir, last, {**info, "resumed_from": ckpt},
                                time.perf_counter() - start) from err
        if not trainer.fast_dev_run:
            trainer.save_checkpoint(last, weights_only=False)
            if module.last_validation_step != trainer.global_step:  # e.g. a resumed run that had finished
                trainer.validate(module, datamodule=datamodule, verbose=False)
        if not trainer.is_global_zero:
            return {}
        limits = {"stopped_by": stopped_by(trainer), "max_time": cfg.trainer.get("max_time")}
        summary = write_summary(run_dir, trainer, module, time.perf_counter() - start,
                                {**info, "resumed_from": ckpt, **limits, "machine_load": load.record()})
        report(end_block(summary, run_dir, events_dir(trainer), logs_figures(trainer)))
        for line in tasks.after_training(prepared, cfg, run_dir, trainer, summary) if tasks else ():
            report(line)  # into metrics.json and the loggers, then said
        for line in finish_trackers(trainer.loggers, summary):  # their final numbers, then each run ends
            report(line)
        return summary
