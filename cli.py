"""attnres-run: compose the config, instantiate the parts, fit, validate, write the summary.

    attnres-run residual=block num_blocks=8          # one run
    attnres-run -m residual=standard,full,block      # a sweep (attnres/training/sweep.py)
    attnres-run --cfg job                            # print the composed config

In a source checkout this file sits beside the `attnres` package; in a wheel it is
`attnres/cli.py`, with `conf/` as `attnres/conf/`.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from pytorch_lightning.callbacks import ProgressBar
from pytorch_lightning.utilities.exceptions import SIGTERMException

from attnres.training import sweep
from attnres.training.allocator import keep_freed_memory
from attnres.training.faults import (
    GracefulStop,
    Interrupted,
    NonFiniteLoss,
    RunLock,
    clean_stale_tmp,
    stop_signals,
)
from attnres.training.io import AtomicCheckpointIO
from attnres.training.lit import LitLanguageModel
from attnres.training.run import (
    check_checkpoint,
    config_summary,
    end_block,
    end_interrupted,
    end_nonfinite,
    report,
    resolve_precision,
    resume_checkpoint,
    run_child_job,
    run_outcome,
    share_log_file,
    user_errors,
    write_summary,
)
from attnres.training.validate import check_command_line, validate_config

CONF_DIR = Path(__file__).resolve().parent / "conf"
log = logging.getLogger("attnres")
# Lightning 2.6 with torch >= 2.10 warns about its own use of a torch API, once per run,
# and advertises a cloud service at every start; neither is the user's concern
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
# a step skipped by nonfinite.policy=skip|rollback returns None on purpose (and says so in the log)
warnings.filterwarnings("ignore", message=r".*`training_step` returned `None`")
# Lightning's start and stop lines ("GPU available: ...", "`Trainer.fit` stopped: ...") say nothing
# the run's own start and end lines do not say better
_QUIET = ("💡", "GPU available", "TPU available", "HPU available", "`Trainer.fit` stopped")
logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(lambda r: not str(r.msg).startswith(_QUIET))


def train(cfg: DictConfig, run_dir: Path, info: dict[str, Any]) -> dict:
    """One run into `run_dir`; `cfg` is the composed config, `info` goes into metrics.json."""
    validate_config(cfg)
    if cfg.get("keep_freed_memory", True):
        keep_freed_memory()  # before the first large tensor
    if cfg.get("mode", "train") != "train":  # mode=eval | sample: a checkpoint, no training
        from attnres.training.evaluate import run_mode

        return run_mode(cfg, run_dir, info)
    share_log_file()
    last = run_dir / "checkpoints" / "last.ckpt"
    with RunLock(run_dir), stop_signals(GracefulStop(last)) as stop:
        clean_stale_tmp(run_dir)
        ckpt = resume_checkpoint(run_dir, cfg.resume, cfg.ckpt_path, cfg.overwrite)
        log.info(f"run folder: {run_dir}" + (f" (resuming from {ckpt})" if ckpt else ""))
        log.info(config_summary(cfg, info))
        pl.seed_everything(cfg.seed, workers=True, verbose=False)

        datamodule = instantiate(cfg.data)
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
        if ckpt:
            check_checkpoint(ckpt, module)
        loggers = [instantiate(c) for c in cfg.logger.values()]
        callbacks = [instantiate(c) for c in cfg.callbacks.values()] + [stop]
        if not cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar it was told not to show
            callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
        trainer = instantiate(
            cfg.trainer,
            precision=resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator),
            logger=loggers or False,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],
        )

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
        summary = write_summary(run_dir, trainer, module, time.perf_counter() - start, {**info, "resumed_from": ckpt})
        events = Path(trainer.logger.log_dir) if trainer.logger is not None and trainer.logger.log_dir else None
        report(end_block(summary, run_dir, events))
        return summary


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    choices = hydra_cfg.runtime.choices
    info = {"residual": choices.get("residual"), "model": choices.get("model"), "data": choices.get("data"),
            "overrides": list(hydra_cfg.overrides.task), "multirun": hydra_cfg.mode == RunMode.MULTIRUN}
    if info["multirun"]:
        sweep.run_isolated(cfg, run_dir, info)  # a fresh process on a claimed device; never raises
        return
    with user_errors(), run_outcome(run_dir):
        train(cfg, run_dir, info)


def job_config(overrides: list[str]) -> str:
    """`attnres-run --cfg job ...`: the config the run would use, resolved (its run folder filled
    in), without the top-level `num_blocks` when the residual strategy has no blocks."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg), read_write(cfg.hydra):
            cfg.hydra.runtime.output_dir = str(cfg.hydra.run.dir)  # what Hydra sets when the run starts
        HydraConfig.instance().set_config(cfg)
        job = OmegaConf.to_container(cfg, resolve=True)
    finally:
        GlobalHydra.instance().clear()
    job.pop("hydra")
    if "num_blocks" not in (job.get("residual") or {}):
        job.pop("num_blocks", None)
    return OmegaConf.to_yaml(OmegaConf.create(job))


def main() -> None:
    if sys.argv[1:2] == ["--run-job"]:  # a sweep job's own process (see attnres/training/sweep.py)
        sys.exit(run_child_job(Path(sys.argv[2]), train))
    with user_errors():
        check_command_line(sys.argv[1:], CONF_DIR)
    if sys.argv[1:3] == ["--cfg", "job"] and not any(a.startswith(("-", "hydra.")) for a in sys.argv[3:]):
        print(job_config(sys.argv[3:]), end="")
        return
    _hydra_main()
    sys.exit(sweep.exit_status())  # non-zero when a sweep just ran and some of its jobs did not finish


if __name__ == "__main__":
    main()
