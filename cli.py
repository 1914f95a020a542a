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
from omegaconf import DictConfig
from pytorch_lightning.callbacks import ProgressBar

from attnres.training import sweep
from attnres.training.io import AtomicCheckpointIO
from attnres.training.lit import LitLanguageModel
from attnres.training.run import (
    check_checkpoint,
    resolve_precision,
    resume_checkpoint,
    run_child_job,
    user_errors,
    write_summary,
)
from attnres.training.validate import check_command_line, validate_config

CONF_DIR = Path(__file__).resolve().parent / "conf"
# Lightning 2.6 with torch >= 2.10 warns about its own use of a torch API, once per run,
# and advertises a cloud service at every start; neither is the user's concern
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(lambda r: not str(r.msg).startswith("💡"))


def train(cfg: DictConfig, run_dir: Path, info: dict[str, Any]) -> dict:
    """One run into `run_dir`; `cfg` is the composed config, `info` goes into metrics.json."""
    validate_config(cfg)
    ckpt = resume_checkpoint(run_dir, cfg.resume, cfg.ckpt_path, cfg.overwrite, missing_ok=info.get("multirun"))
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
    )
    if ckpt:
        check_checkpoint(ckpt, module)
    loggers = [instantiate(c) for c in cfg.logger.values()]
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
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
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
    if not trainer.fast_dev_run:
        trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
        trainer.validate(module, datamodule=datamodule, verbose=False)
    if not trainer.is_global_zero:
        return {}
    return write_summary(run_dir, trainer, module, time.perf_counter() - start, {**info, "resumed_from": ckpt})


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
    with user_errors():
        train(cfg, run_dir, info)


def main() -> None:
    if sys.argv[1:2] == ["--run-job"]:  # a sweep job's own process (see attnres/training/sweep.py)
        sys.exit(run_child_job(Path(sys.argv[2]), train))
    with user_errors():
        check_command_line(sys.argv[1:], CONF_DIR)
    _hydra_main()
    sys.exit(sweep.exit_status())  # non-zero when a sweep just ran and some of its jobs did not finish


if __name__ == "__main__":
    main()
