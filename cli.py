"""attnres-run: check the command line, compose the config with Hydra, then run it: one run
(`attnres.training.run.train`) or, with -m, a sweep (`attnres.sweep`).

    attnres-run residual=block num_blocks=8          # one run
    attnres-run -m residual=standard,full,block      # a sweep (attnres/sweep/)
    attnres-run --cfg job                            # print the composed config

In a source checkout this file sits beside the `attnres` package; in a wheel it is
`attnres/cli.py`, with `conf/` as `attnres/conf/`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from attnres.config.command import check_command_line
from attnres.config.errors import ConfigError, user_errors
from attnres.config.selectors import explain

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    # torch and Lightning are imported here, for a run, not on import: `--cfg job` needs neither
    from attnres.sweep import job
    from attnres.tasks import main as tasks
    from attnres.training.report import run_outcome
    from attnres.training.run import train

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    choices = hydra_cfg.runtime.choices
    info = {"residual": choices.get("residual"), "model": choices.get("model"), "data": choices.get("data"),
            "overrides": list(hydra_cfg.overrides.task), "multirun": hydra_cfg.mode == RunMode.MULTIRUN}
    if info["multirun"]:
        job.run_isolated(cfg, run_dir, info)  # a fresh process on a claimed device; never raises
        return
    with user_errors(), run_outcome(run_dir):
        train(cfg, run_dir, info, tasks)  # eval.tasks at its end (the tasks sit above training)


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
        try:
            job = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as err:  # a broken ${...}: one line, as a run gets it
            where = err.full_key or "a key"
            raise ConfigError(explain(cfg, err) or f"{where}: {str(err).splitlines()[0]}; fix that ${{...}} "
                              "reference") from err
    finally:
        GlobalHydra.instance().clear()
    job.pop("hydra")
    if "num_blocks" not in (job.get("residual") or {}):
        job.pop("num_blocks", None)
    return OmegaConf.to_yaml(OmegaConf.create(job))


def main(checked: bool = False) -> None:
    """`checked`: the command line has been checked already (attnres/_entry.py does it before this
    module's imports, so that a mistake is answered at once)."""
    if not checked:
        with user_errors():
            check_command_line(sys.argv[1:], CONF_DIR)
    if sys.argv[1:3] == ["--cfg", "job"] and not any(a.startswith(("-", "hydra.")) for a in sys.argv[3:]):
        with user_errors():
            print(job_config(sys.argv[3:]), end="")
        return
    from attnres.config import naming

    if {"-m", "--multirun"} & set(sys.argv[1:]):  # the job folders lead with what differs between them
        naming.set_swept_keys(sys.argv[1:])
    else:
        os.environ.pop(naming.SWEPT_ENV, None)  # a run alone, even one started from a sweep's job
    _hydra_main()
    from attnres.sweep import plan

    sys.exit(plan.exit_status())  # non-zero when a sweep just ran and some of its jobs did not finish


if __name__ == "__main__":
    main()
