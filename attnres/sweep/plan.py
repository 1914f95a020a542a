"""The jobs a sweep runs and how they ended, for every launcher (parallel, SLURM, basic).

- Dedup. Jobs whose effective configuration (`EFFECTIVE_KEYS`, resolved) is the same run
  once: `residual=standard num_blocks=2,4,8` is one run. The others are recorded as
  duplicates of it.
- Resume. With `resume=true`, finished jobs are skipped and unfinished ones continue from
  their last checkpoint. Without it (or `overwrite=true`), a sweep with a job whose folder
  already holds a run is refused before anything runs.
- Names. Each job's name in TensorBoard's HParams table, the overrides that differ between the
  jobs (`<sweep dir>/trial_names.json`, read by the job's `HParamsSummary`).
- The exit status of `attnres-run -m` is 1 when a job of the sweep did not finish (`exit_status`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from attnres.atomic import read_json, write_json
from attnres.config import costs
from attnres.config.errors import ConfigError, user_errors
from attnres.results.summary import (
    DEFAULT_EXCLUDED,
    collect_rows,
    overrides_by_key,
    status_counts,
    write_trial_names,
)
from attnres.sweep.slots import lock_sweep_dir

log = logging.getLogger(__name__)

#: the parts of a config that decide what a run computes; everything else (where it logs,
#: how often it checkpoints, its name) does not make two runs different
EFFECTIVE_KEYS = ("residual", "model", "data", "trainer", "optim", "seed", "compile")
#: keys inside those parts that still do not change the result
IGNORED_KEYS = ("data.num_workers", "trainer.enable_progress_bar", "trainer.default_root_dir")


class AttnresLauncher:
    """What every attnres launcher shares, before its own `_launch(sweep_dir, ...)`: the sweep folder
    locked for the sweep's life (a second sweep into it is refused), a sweep with no jobs refused,
    and every ConfigError as one line and exit status 2 before any job starts (Hydra would print an
    exception from a launcher with its traceback and exit 1)."""

    config: Any
    hydra_context: Any

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        with user_errors():
            assert self.config is not None and self.hydra_context is not None
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            if not job_overrides:
                raise no_jobs_error(self.config)
            lock_sweep_dir(sweep_dir)
            return self._launch(sweep_dir, job_overrides, initial_job_idx)

    def _launch(self, sweep_dir: Path, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        raise NotImplementedError


# -- effective configuration ---------------------------------------------------------------------
def effective_key(config: DictConfig) -> str:
    """A hash of what a job computes: EFFECTIVE_KEYS resolved, IGNORED_KEYS dropped."""
    config = config.copy()
    with open_dict(config):
        config.hydra.runtime.output_dir = "<run>"  # resolves ${hydra:runtime.output_dir} alike for all
    HydraConfig.instance().set_config(config)
    resolved = OmegaConf.to_container(config, resolve=True)
    picked = {k: resolved[k] for k in EFFECTIVE_KEYS if k in resolved}
    for dotted in IGNORED_KEYS:
        head, _, leaf = dotted.partition(".")
        if isinstance(picked.get(head), dict):
            picked[head].pop(leaf, None)
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_status(run_dir: Path) -> str | None:
    return read_json(run_dir / "metrics.json").get("status")


def nothing_to_train(run_dir: Path, config: DictConfig) -> bool:
    """A resumed job whose run finished, unless it was paused (`stop_at_step`) before the step this
    job trains to: a tuned search's rung continues the same folder (attnres.sweep.tuned_halving)."""
    found = read_json(run_dir / "metrics.json")
    if found.get("status") != "finished":
        return False
    stop = config.get("stop_at_step")
    return found.get("stopped_by") != "stop_at_step" or stop is not None and int(found.get("steps") or 0) >= stop


def holds_run(run_dir: Path) -> bool:
    """Whether a job folder holds a run (its metrics or a checkpoint) that running it would replace."""
    return (run_dir / "metrics.json").is_file() or (run_dir / "checkpoints" / "last.ckpt").is_file()


def no_jobs_error(config: DictConfig) -> ConfigError:
    swept = " ".join(str(o) for o in config.hydra.overrides.task) or "(no overrides)"
    return ConfigError(
        f"the sweep has no jobs: {swept} gives no combination to run (a sweep over an empty range or list?); "
        "give every swept key at least one value, e.g. seed='range(0,3)'"
    )


# -- the jobs a sweep runs (every launcher) ----------------------------------------------------------
def plan_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], sweep_dir: Path,
              check: Callable[[list[Any]], None] | None = None) -> list[tuple[list[str], Any]]:
    """The jobs of the sweep that must run, as (overrides, composed config): duplicates and (with
    `resume=true`) finished jobs are left out and recorded in `<sweep_dir>/jobs.json`. Raises
    ConfigError, touching nothing, when a job would replace a run without resume/overwrite, or
    when `check` (given the configs to run, before anything is recorded) raises it."""
    to_run, notes, first_by_key, jobs, held, named = [], {}, {}, {}, [], {}
    for overrides in job_overrides:
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        run_dir = sweep_dir / str(config.hydra.sweep.subdir)
        name = run_dir.relative_to(sweep_dir).as_posix()
        excluded = OmegaConf.select(config, "hydra.job.config.override_dirname.exclude_keys", default=None)
        named[name] = overrides_by_key([str(o) for o in overrides], DEFAULT_EXCLUDED if excluded is None else excluded)
        key = effective_key(config)
        if key in first_by_key:
            notes[name] = {"status": "duplicate", "same_as": first_by_key[key], "overrides": list(overrides)}
            jobs[name] = first_by_key[key]
            continue
        first_by_key[key], jobs[name] = name, None
        if config.get("resume") and nothing_to_train(run_dir, config):
            notes[name] = {"status": "finished", "skipped": True}
            continue
        if holds_run(run_dir) and not (config.get("resume") or config.get("overwrite") or config.get("ckpt_path")):
            held.append(name)
        to_run.append((list(overrides), config))
    if held:  # refuse them all, touching none: not one finished run is rewritten as failed
        raise ConfigError(
            f"{len(held)} of the sweep's {len(job_overrides)} jobs already hold a run in {sweep_dir} "
            f"(first: {held[0]}); pass resume=true to skip the finished ones and continue the others, "
            "overwrite=true to start them all again, or name=<new name> for a new sweep folder"
        )
    if check is not None:
        check([config for _, config in to_run])
    for line in costs.announce(to_run, skipped=len(job_overrides) - len(to_run)):  # experiments with `costs:`
        print(line, flush=True)
    # a sweep that launches several batches (the tuned sweeper's stages) records them all
    notes = sweep_notes.setdefault(folder_key(sweep_dir), {}) | notes
    sweep_notes[folder_key(sweep_dir)] = notes
    write_json(sweep_dir / "jobs.json", notes)
    write_trial_names(sweep_dir, named)  # the jobs' names in TensorBoard's HParams table
    sweep_jobs[folder_key(sweep_dir)] = sweep_jobs.get(folder_key(sweep_dir), {}) | jobs
    return to_run


# -- how the sweep ended -----------------------------------------------------------------------------
#: the jobs of the sweeps run by this process: sweep folder -> {job folder: the job it duplicates}
sweep_jobs: dict[str, dict[str, str | None]] = {}
sweep_notes: dict[str, dict[str, Any]] = {}  # sweep folder -> its jobs.json, over the batches this process launched
outcomes: dict[str, Counter] = {}  # sweep folder -> how its jobs ended (record_outcome)
OK_STATUSES = ("finished", "duplicate", "diverged")  # any other status of a job makes the exit status 1
#: sweep folder -> the trials of a tuned sweep's search whose loss went non-finite: a finding of the search
#: (an lr too high), scored as its worst, "diverged" in the counts rather than "failed" (attnres.sweep.tuned)
diverged: dict[str, set[str]] = {}
summary_unwritten: list[Path] = []  # sweep folders whose summary a full disk refused (SweepSummary)
#: sweep folders whose question found no answer though no job failed (a tuned arm all of whose trials
#: diverged, a search stopped on a trial that failed twice): exit status 1 (attnres.sweep.tuned)
unanswered: set[str] = set()


def folder_key(sweep_dir: Path) -> str:
    return str(Path(sweep_dir).resolve())


def record_outcome(sweep_dir: Path) -> Counter:
    """Count how the jobs of the sweep that just ran into `sweep_dir` ended (status -> jobs), for
    the sweep's last line and `exit_status`. The jobs are the ones this process launched or ran;
    with a launcher whose jobs run elsewhere (SLURM), every job folder of `sweep_dir`."""
    jobs = sweep_jobs.get(folder_key(sweep_dir))
    if jobs:
        gone = diverged.get(folder_key(sweep_dir), set())
        statuses = ["duplicate" if same_as else "diverged" if name in gone else
                    read_status(sweep_dir / name) or "unfinished" for name, same_as in jobs.items()]
    else:
        statuses = [row["status"] for row in collect_rows(sweep_dir)]
    counts = outcomes[folder_key(sweep_dir)] = status_counts(statuses)
    return counts


def exit_status() -> int:
    """The process's exit status after `attnres-run` returns: 0 unless a sweep ran in this
    process and some of its jobs did not finish (failed, interrupted, or no status): then 1; a sweep
    stopped by SIGINT or SIGTERM (`stopping`) exits as a stopped single run does, 130 or 143."""
    from attnres.sweep import stopping

    if stopping.stopped_by is not None:
        return 128 + int(stopping.stopped_by)
    if summary_unwritten:  # a write the disk refused, as for a single run
        return 2
    for sweep_dir in sweep_jobs:  # the summary callback was not configured: count here
        if sweep_dir not in outcomes:
            record_outcome(Path(sweep_dir))
    unfinished = sum(n for counts in outcomes.values() for status, n in counts.items()
                     if status not in OK_STATUSES)
    return 1 if unfinished or unanswered else 0


