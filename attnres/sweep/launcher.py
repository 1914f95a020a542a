"""`hydra/launcher=parallel`: Hydra's joblib launcher over device slots (`slots.py`), with dedup
and resume (`plan.py`), each job in its own process (`job.py`).

`attnres-run -m residual=standard,full,block seed=0,1,2` runs every job on a free slot: with G
visible GPUs `jobs_per_gpu * G` of them, without GPUs `cpu_jobs` shares of the cores. One sweep
per folder: the sweep holds an exclusive lock on `<sweep dir>/.sweep.lock` for its life. At the
end the sweep folder gets summary.csv, summary.md and summary.png (`callback.SweepSummary`, a
Hydra callback, so that sweeps through other launchers get them too).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_joblib_launcher._core import launch as joblib_launch
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher

from attnres.sweep import on_demand
from attnres.sweep.plan import AttnresLauncher, plan_jobs
from attnres.sweep.slots import (
    SLOTS_ENV,
    SWEEP_ENV,
    default_lock_dir,
    plan_slots,
    process_start,
    reap_stale_slots,
    visible_gpus,
)
from attnres.sweep.stopping import SweepStop, ignore_signals

log = logging.getLogger(__name__)


class _NoJoblibCall(logging.Filter):
    """Drops the joblib launcher's `Joblib.Parallel(n_jobs=...,backend=loky,...) is launching N jobs`
    line: a raw call of a library a user never named; the sweep says what it runs in its own line
    (jobs to run and skipped, its slots) before Hydra lists the jobs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Joblib.Parallel(")


logging.getLogger(joblib_launch.__module__).addFilter(_NoJoblibCall())


class ParallelLauncher(AttnresLauncher, JoblibLauncher):
    """Hydra's joblib launcher, with device slots, dedup, resume and a sweep summary."""

    def __init__(
        self, jobs_per_gpu: int = 1, cpu_jobs: int | None = None, lock_dir: str | None = None,
        stop_grace_s: float = 30, gpus_per_job: int = 1, **joblib: Any,
    ) -> None:
        super().__init__(**joblib)
        self.jobs_per_gpu, self.cpu_jobs, self.stop_grace_s = jobs_per_gpu, cpu_jobs, float(stop_grace_s)
        self.gpus_per_job = gpus_per_job
        self.lock_dir = Path(lock_dir) if lock_dir else None  # None: default_lock_dir, once the devices are known

    def _launch(self, sweep_dir: Path, job_overrides: Sequence[Sequence[str]],
                initial_job_idx: int) -> Sequence[JobReturn]:
        return on_demand.launch(self, sweep_dir, job_overrides, initial_job_idx, self._launch_batch)  # seeds.on_demand

    def _launch_batch(self, sweep_dir: Path, job_overrides: Sequence[Sequence[str]],
                      initial_job_idx: int) -> Sequence[JobReturn]:
        gpus = visible_gpus()
        slots = plan_slots(gpus, self.jobs_per_gpu, self.cpu_jobs, self.gpus_per_job)
        self.lock_dir = self.lock_dir or default_lock_dir(cpu_only=not gpus)
        os.environ[SLOTS_ENV] = json.dumps([asdict(s) for s in slots])  # workers inherit it
        os.environ["ATTNRES_LOCK_DIR"] = str(self.lock_dir)
        stop = SweepStop(sweep_dir)
        os.environ[SWEEP_ENV] = json.dumps({"pid": os.getpid(), "start": process_start(os.getpid()),
                                            "grace_s": self.stop_grace_s, "stop_file": str(stop.path)})
        # the orphans of a sweep that died (a resumed sweep's previous run) end before any job starts
        reap_stale_slots(self.lock_dir, self.stop_grace_s, wait_s=self.stop_grace_s + 10)

        to_run = [list(o) for o, _ in plan_jobs(self, job_overrides, sweep_dir)]
        skipped = len(job_overrides) - len(to_run)
        log.info(
            f"{len(job_overrides)} jobs: {len(to_run)} to run, {skipped} skipped (duplicate or finished); "
            f"{len(slots)} slots: {', '.join(s.name for s in slots)}"
        )
        results: Sequence[JobReturn] = []
        if to_run:
            self.joblib["n_jobs"] = min(len(slots), len(to_run))
            self.joblib["initializer"] = ignore_signals  # a worker's first act: the sweep process takes the signals
            with stop.catching():  # Ctrl-C / SIGTERM: the jobs save, the summary is still written
                results = joblib_launch(self, job_overrides=to_run, initial_job_idx=initial_job_idx)
        return results  # the summary is written by the SweepSummary callback (conf/config.yaml)


