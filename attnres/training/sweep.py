"""Sweeps: a parallel launcher over device slots, with dedup, failure isolation and resume.

`attnres-run -m residual=standard,full,block seed=0,1,2` goes through `ParallelLauncher`, an
extension of Hydra's joblib launcher:

- Device slots. With G visible GPUs there are `jobs_per_gpu * G` slots, one joblib worker
  each; without GPUs, `cpu_jobs` slots that split the cores between them. A worker claims a
  free slot with an exclusive `flock` on a file in `lock_dir` before anything touches CUDA,
  and holds it for its whole life (joblib reuses workers), so no two live processes share a
  slot and a slot frees itself when its holder dies. Never derived from the job number.
- Isolation. Each job trains in a fresh child process (`attnres-run --run-job SPEC`) pinned
  to its slot with CUDA_VISIBLE_DEVICES: an exception, an out-of-memory error or a kill ends
  that job as `failed`, with its error in `metrics.json`, and the sweep goes on. A fresh
  process per job is also what lets Lightning's DDP launcher re-run the job, not the sweep.
- Dedup. Jobs whose effective configuration (`EFFECTIVE_KEYS`, resolved) is the same run
  once: `residual=standard num_blocks=2,4,8` is one run. The others are recorded as
  duplicates of it.
- Resume. With `resume=true`, finished jobs are skipped and unfinished ones continue from
  their last checkpoint.

At the end the sweep folder gets summary.csv, summary.md and summary.png (`summary.py`, a
Hydra callback, so that sweeps through other launchers get them too).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra_plugins.hydra_joblib_launcher._core import launch as joblib_launch
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from attnres.training.io import read_json, write_json

log = logging.getLogger(__name__)

#: the parts of a config that decide what a run computes; everything else (where it logs,
#: how often it checkpoints, its name) does not make two runs different
EFFECTIVE_KEYS = ("residual", "model", "data", "trainer", "optim", "seed", "compile")
#: keys inside those parts that still do not change the result
IGNORED_KEYS = ("data.num_workers", "trainer.enable_progress_bar", "trainer.default_root_dir")
SLOTS_ENV = "ATTNRES_SLOTS"  # the launcher's slot plan, read by its workers
FAKE_GPUS_ENV = "ATTNRES_FAKE_GPUS"  # tests: pretend there are this many GPUs (jobs still use the CPU)


@dataclass(frozen=True)
class Slot:
    """One place a job can run: a GPU (`device` is its CUDA_VISIBLE_DEVICES entry) or a CPU share."""

    name: str  # "gpu0.1" = GPU 0, second job on it; "cpu1"
    device: str | None  # None on the CPU
    threads: int
    simulated: bool = False


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of the GPUs this process may use (counting initialises
    CUDA only in the launcher, never in a job)."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        return [str(i) for i in range(int(fake))]
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_slots(gpus: Sequence[str], jobs_per_gpu: int, cpu_jobs: int | None) -> list[Slot]:
    if jobs_per_gpu < 1:
        raise ValueError(f"hydra.launcher.jobs_per_gpu={jobs_per_gpu} must be >= 1")
    cores = os.cpu_count() or 1
    simulated = bool(os.environ.get(FAKE_GPUS_ENV))
    if gpus:
        n = len(gpus) * jobs_per_gpu
        threads = max(1, cores // n)
        return [Slot(f"gpu{g}.{k}", gpu, threads, simulated) for g, gpu in enumerate(gpus) for k in range(jobs_per_gpu)]
    n = cpu_jobs or max(min(2, cores), cores // 2)  # half the cores, but 2 jobs on a 2-core machine
    return [Slot(f"cpu{k}", None, max(1, cores // n)) for k in range(n)]


# -- slot claiming (in each joblib worker, held for the worker's life) ---------------------------
_claimed: tuple[Slot, int] | None = None


def claim_slot(lock_dir: Path, poll_s: float = 0.5) -> tuple[Slot, int]:
    """Lock a free slot of the launcher's plan for this process; returns (slot, lock fd)."""
    global _claimed
    if _claimed is not None:
        return _claimed
    slots = [Slot(**s) for s in json.loads(os.environ[SLOTS_ENV])]
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for slot in slots:
            fd = os.open(lock_dir / f"{slot.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _claimed = (slot, fd)
            return _claimed
        time.sleep(poll_s)  # every slot is held (e.g. by another sweep on this machine): wait


def default_lock_dir() -> Path:
    return Path(os.environ.get("ATTNRES_LOCK_DIR", f"/tmp/attnres-slots-{os.getuid()}"))


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


# -- the launcher --------------------------------------------------------------------------------
class ParallelLauncher(JoblibLauncher):
    """Hydra's joblib launcher, with device slots, dedup, resume and a sweep summary."""

    def __init__(
        self, jobs_per_gpu: int = 1, cpu_jobs: int | None = None, lock_dir: str | None = None, **joblib: Any
    ) -> None:
        super().__init__(**joblib)
        self.jobs_per_gpu, self.cpu_jobs = jobs_per_gpu, cpu_jobs
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        slots = plan_slots(visible_gpus(), self.jobs_per_gpu, self.cpu_jobs)
        os.environ[SLOTS_ENV] = json.dumps([asdict(s) for s in slots])  # workers inherit it
        os.environ["ATTNRES_LOCK_DIR"] = str(self.lock_dir)

        to_run, notes, first_by_key = [], {}, {}
        for overrides in job_overrides:
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            run_dir = sweep_dir / str(config.hydra.sweep.subdir)
            key = effective_key(config)
            if key in first_by_key:
                notes[run_dir.name] = {"status": "duplicate", "same_as": first_by_key[key].name}
                continue
            first_by_key[key] = run_dir
            if config.get("resume") and read_status(run_dir) == "finished":
                notes[run_dir.name] = {"status": "finished", "skipped": True}
                continue
            to_run.append(list(overrides))
        write_json(sweep_dir / "jobs.json", notes)
        skipped = len(job_overrides) - len(to_run)
        log.info(
            f"{len(job_overrides)} jobs: {len(to_run)} to run, {skipped} skipped (duplicate or finished); "
            f"{len(slots)} slots: {', '.join(s.name for s in slots)}"
        )
        results: Sequence[JobReturn] = []
        if to_run:
            self.joblib["n_jobs"] = min(len(slots), len(to_run))
            results = joblib_launch(self, job_overrides=to_run, initial_job_idx=initial_job_idx)
        return results  # the summary is written by the SweepSummary callback (conf/config.yaml)


def exit_status() -> int:
    """The process's exit status after `attnres-run` returns: 0 unless a sweep ran in this
    process and some of its jobs did not finish."""
    return 0


# -- one job (in a launcher's worker): train in a child process, on the claimed slot ---------------
def run_isolated(cfg: DictConfig, run_dir: Path, info: dict[str, Any]) -> None:
    """Run one sweep job in a fresh process and record how it ended; never raises.

    Under ParallelLauncher the process is pinned to this worker's slot; under another launcher
    (basic, SLURM) it inherits this process's devices as they are.
    """
    slot = None
    if SLOTS_ENV in os.environ:
        slot = claim_slot(Path(os.environ.get("ATTNRES_LOCK_DIR", default_lock_dir())))[0]
    env = {k: v for k, v in os.environ.items() if k != SLOTS_ENV}
    job_info = {**info, "slot": None, "device": "inherited"}
    if slot is not None:
        env.update(OMP_NUM_THREADS=str(slot.threads), ATTNRES_SLOT=slot.name,
                   CUDA_VISIBLE_DEVICES=slot.device if slot.device is not None and not slot.simulated else "")
        job_info.update(slot=slot.name, threads=slot.threads, simulated_gpu=slot.simulated,
                        device=f"cuda:{slot.device}" if slot.device is not None and not slot.simulated else "cpu")
    spec_path = run_dir / ".hydra" / "job.json"
    write_json(spec_path, {"config": OmegaConf.to_container(cfg, resolve=True), "run_dir": str(run_dir),
                           "info": job_info})
    name = f"job {HydraConfig.get().job.num}"
    where = f"slot {slot.name} ({job_info['device']})" if slot else "this process's devices"
    log.info(f"{name} on {where} -> {run_dir}")
    start = time.time()
    with open(run_dir / "train.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnres", "--run-job", str(spec_path)], stdout=out, stderr=subprocess.STDOUT,
            env=env, pass_fds=(_claimed[1],) if slot is not None and _claimed else (),
        )
        proc.wait()
    end = time.time()
    status = read_status(run_dir)
    if proc.returncode != 0 and status != "failed":  # died without saying why: it was killed
        why = (f"killed by signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        if proc.returncode == -signal.SIGKILL:
            why += " (out of memory?)"
        write_json(run_dir / "metrics.json", {"status": "failed", "error": why, "slot": job_info["slot"],
                                              "wall_time_s": round(end - start, 3)})
        status = "failed"
    write_json(run_dir / "slot.json", {"slot": job_info["slot"], "device": job_info["device"], "pid": proc.pid,
                                       "worker_pid": os.getpid(), "start": start, "end": end})
    log.info(f"{name}: {status or 'no status'} on {where} after {end - start:.0f} s")
