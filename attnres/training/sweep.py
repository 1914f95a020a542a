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
  their last checkpoint. Without it (or `overwrite=true`), a sweep with a job whose folder
  already holds a run is refused before anything runs.
- One sweep per folder. The sweep holds an exclusive lock on `<sweep dir>/.sweep.lock` for its
  life; a second sweep into the same folder is refused.
- Nothing outlives the sweep. A worker watches the sweep process and, if it dies (even by
  SIGKILL), stops its job (SIGTERM, then SIGKILL after `stop_grace_s`) and exits; a job process
  gets SIGTERM when its worker dies (PR_SET_PDEATHSIG). A slot lock records the sweep, worker
  and job processes; a lock whose sweep has died is stale: its holders are stopped, so a
  resumed sweep never waits on a dead sweep's lock.

At the end the sweep folder gets summary.csv, summary.md and summary.png (`summary.py`, a
Hydra callback, so that sweeps through other launchers get them too), and the exit status of
`attnres-run -m` is 1 when a job of the sweep did not finish (`exit_status`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra_plugins.hydra_joblib_launcher._core import launch as joblib_launch
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from attnres.training.errors import ConfigError
from attnres.training.io import read_json, write_json
from attnres.training.summary import collect_rows, status_counts

log = logging.getLogger(__name__)

#: the parts of a config that decide what a run computes; everything else (where it logs,
#: how often it checkpoints, its name) does not make two runs different
EFFECTIVE_KEYS = ("residual", "model", "data", "trainer", "optim", "seed", "compile")
#: keys inside those parts that still do not change the result
IGNORED_KEYS = ("data.num_workers", "trainer.enable_progress_bar", "trainer.default_root_dir")
SLOTS_ENV = "ATTNRES_SLOTS"  # the launcher's slot plan, read by its workers
SWEEP_ENV = "ATTNRES_SWEEP"  # the sweep process (pid, start) and stop_grace_s, read by its workers
PARENT_ENV = "ATTNRES_JOB_PARENT"  # a job process's worker, read by the job process
FAKE_GPUS_ENV = "ATTNRES_FAKE_GPUS"  # tests: pretend there are this many GPUs (jobs still use the CPU)
SWEEP_LOCK = ".sweep.lock"
#: how a job's own process starts: `job_process`, then `attnres-run --run-job SPEC`
JOB_PROCESS = "from attnres.training.sweep import job_process; job_process()"


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


# -- processes and lock files ------------------------------------------------------------------------
def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot; tells a pid from its reuse), or None when
    it is not running (a zombie is not). Without /proc: 0 when it runs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    return None if fields[0] in ("Z", "X") else int(fields[19])


def is_alive(pid: Any, start: Any = None) -> bool:
    """Whether `pid` runs and (when `start` is known) is the process that started at `start`."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    now = process_start(pid)
    return now is not None and (not start or not now or now == start)


def _read_lock(fd: int) -> dict[str, Any]:
    """What a lock file says about its holder: JSON, or a bare pid (older lock files)."""
    text = os.pread(fd, 1 << 16, 0).decode(errors="replace").strip()
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {"pid": int(text.split()[0])} if text[:1].isdigit() else {}


def _write_lock(fd: int, info: dict[str, Any]) -> None:
    data = (json.dumps(info, sort_keys=True) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when the thread that started it ends (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


# -- the sweep folder lock (in the sweep process, held for its life) -----------------------------------
_sweep_locks: dict[str, int] = {}


def lock_sweep_dir(sweep_dir: Path) -> None:
    """Take the exclusive lock on `<sweep_dir>/.sweep.lock`, or raise ConfigError naming the
    sweep that holds it. Idempotent in one process (the callback and the launcher both ask)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    key = str(sweep_dir.resolve())
    if key in _sweep_locks:
        return
    fd = os.open(sweep_dir / SWEEP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy = None
    except BlockingIOError:
        busy = _read_lock(fd)
    except OSError:  # no flock on this file system (some network mounts): the pid in the file decides
        holder = _read_lock(fd)
        mine = holder.get("pid") == os.getpid()
        busy = holder if not mine and is_alive(holder.get("pid"), holder.get("start")) else None
    if busy is not None:
        os.close(fd)
        pid = busy.get("pid", "?")
        gone = "" if is_alive(pid, busy.get("start")) else ", which has ended, though a process it started holds on"
        raise ConfigError(
            f"another sweep (pid {pid}{gone}) is running into {sweep_dir}; wait for it to end, "
            "or pass name=<new name> for a new sweep folder"
        )
    _write_lock(fd, {"pid": os.getpid(), "start": process_start(os.getpid())})
    _sweep_locks[key] = fd


# -- orphans of a dead sweep -------------------------------------------------------------------------
_stopping: dict[tuple[int, Any], float] = {}  # (pid, start) -> when it was sent SIGTERM


def is_stale(info: dict[str, Any]) -> bool:
    """A held slot lock is stale when the sweep that claimed it has died: its holders are orphans."""
    return bool(info.get("sweep")) and not is_alive(info["sweep"], info.get("sweep_start"))


def _stop_orphans(info: dict[str, Any], grace_s: float) -> None:
    """SIGTERM the job and worker processes of a stale slot lock; SIGKILL them after `grace_s`."""
    now = time.monotonic()
    for role in ("child", "worker"):
        pid, start = info.get(role), info.get(f"{role}_start")
        if not is_alive(pid, start):
            continue
        first = _stopping.setdefault((pid, start), now)
        sig = signal.SIGTERM if first == now else signal.SIGKILL if now - first > grace_s else None
        if sig is not None:
            if sig == signal.SIGTERM:
                log.warning(f"stopping pid {pid} ({role} of slot {info.get('slot')}, job {info.get('run_dir')}): "
                            f"the sweep that started it (pid {info['sweep']}) has died")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def reap_stale_slots(lock_dir: Path, grace_s: float, wait_s: float) -> None:
    """Stop the orphans that hold slot locks in `lock_dir` for a dead sweep, and wait (at most
    `wait_s`) for their locks to free, so that a resumed sweep never runs beside them."""
    deadline = time.monotonic() + wait_s
    while lock_dir.is_dir():
        stale = []
        for path in sorted(lock_dir.glob("*.lock")):
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: released again by the close
                except BlockingIOError:
                    info = _read_lock(fd)
                    if is_stale(info):
                        stale.append(info)
                finally:
                    os.close(fd)
        if not stale or time.monotonic() > deadline:
            return
        for info in stale:
            _stop_orphans(info, grace_s)
        time.sleep(0.2)


# -- slot claiming (in each joblib worker, held for the worker's life) ---------------------------
_claimed: tuple[Slot, int] | None = None
_slot_info: dict[str, Any] = {}


def _sweep_of_worker() -> dict[str, Any]:
    try:
        return json.loads(os.environ.get(SWEEP_ENV, "{}"))
    except ValueError:
        return {}


def claim_slot(lock_dir: Path, poll_s: float = 0.5) -> tuple[Slot, int]:
    """Lock a free slot of the launcher's plan for this process; returns (slot, lock fd)."""
    global _claimed
    if _claimed is not None:
        return _claimed
    slots = [Slot(**s) for s in json.loads(os.environ[SLOTS_ENV])]
    sweep = _sweep_of_worker()
    _start_watchdog(sweep)
    lock_dir.mkdir(parents=True, exist_ok=True)
    waiting_since = None
    while True:
        for slot in slots:
            fd = os.open(lock_dir / f"{slot.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_lock(fd)
                os.close(fd)
                if is_stale(holder):
                    _stop_orphans(holder, float(sweep.get("grace_s", 30)))
                continue
            _slot_info.clear()
            _slot_info.update(slot=slot.name, worker=os.getpid(), worker_start=process_start(os.getpid()),
                              sweep=sweep.get("pid"), sweep_start=sweep.get("start"), child=None)
            _write_lock(fd, _slot_info)
            _claimed = (slot, fd)
            return _claimed
        if waiting_since is None:  # every slot is held (e.g. by another sweep on this machine): wait
            waiting_since = time.monotonic()
            log.info(f"all {len(slots)} slots in {lock_dir} are held by live processes; waiting for one")
        time.sleep(poll_s)


def default_lock_dir() -> Path:
    return Path(os.environ.get("ATTNRES_LOCK_DIR", f"/tmp/attnres-slots-{os.getuid()}"))


# -- the worker's watchdog: nothing outlives the sweep ----------------------------------------------
_child: subprocess.Popen | None = None  # the job process this worker waits for
_orphaned = threading.Event()
_recorded = threading.Event()
_watchdog: threading.Thread | None = None


def _start_watchdog(sweep: dict[str, Any], poll_s: float = 0.5) -> None:
    global _watchdog
    if _watchdog is not None or not sweep.get("pid"):
        return
    parent = os.getppid()
    grace_s = float(sweep.get("grace_s", 30))

    def watch() -> None:
        while os.getppid() == parent and is_alive(sweep["pid"], sweep.get("start")):
            time.sleep(poll_s)
        _orphaned.set()
        child = _child
        if child is not None and child.returncode is None:
            log.warning(f"the sweep process (pid {sweep['pid']}) died: stopping job process {child.pid}")
            stop_process(child, grace_s)
            _recorded.wait(5)  # let the worker's main thread record how the job ended
        os._exit(1)

    _watchdog = threading.Thread(target=watch, name="attnres-sweep-watchdog", daemon=True)
    _watchdog.start()


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `proc` (a job checkpoints and ends as `interrupted`); SIGKILL it after `grace_s`."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    while proc.returncode is None and is_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.returncode is None and is_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def job_process() -> None:
    """The start of a sweep job's own process: it gets SIGTERM when its worker dies, then it is
    `attnres-run --run-job SPEC` (sys.argv[1:])."""
    _die_with_parent(signal.SIGTERM)
    from attnres.training import slurm

    if slurm.in_slurm_job():  # SLURM's warning before a preemption or its time limit: checkpoint and exit
        slurm.forward_preemption()
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit() and os.getppid() != int(parent):  # the worker died before the line above
        sys.exit(128 + signal.SIGTERM)
    sys.argv = ["attnres-run", *sys.argv[1:]]
    from attnres._entry import main

    main()


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
    to_run, notes, first_by_key, jobs, held = [], {}, {}, {}, []
    for overrides in job_overrides:
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        run_dir = sweep_dir / str(config.hydra.sweep.subdir)
        name = run_dir.relative_to(sweep_dir).as_posix()
        key = effective_key(config)
        if key in first_by_key:
            notes[name] = {"status": "duplicate", "same_as": first_by_key[key], "overrides": list(overrides)}
            jobs[name] = first_by_key[key]
            continue
        first_by_key[key], jobs[name] = name, None
        if config.get("resume") and read_status(run_dir) == "finished":
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
    write_json(sweep_dir / "jobs.json", notes)
    _sweep_jobs[_key(sweep_dir)] = jobs
    return to_run


# -- the launcher --------------------------------------------------------------------------------
class ParallelLauncher(JoblibLauncher):
    """Hydra's joblib launcher, with device slots, dedup, resume and a sweep summary."""

    def __init__(
        self, jobs_per_gpu: int = 1, cpu_jobs: int | None = None, lock_dir: str | None = None,
        stop_grace_s: float = 30, **joblib: Any,
    ) -> None:
        super().__init__(**joblib)
        self.jobs_per_gpu, self.cpu_jobs, self.stop_grace_s = jobs_per_gpu, cpu_jobs, float(stop_grace_s)
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from attnres.training.run import user_errors

        # Hydra prints an exception from a launcher with its traceback and exits 1; a ConfigError
        # here is the user's to fix: one line and exit status 2, before any job starts
        with user_errors():
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if not job_overrides:
            raise no_jobs_error(self.config)
        lock_sweep_dir(sweep_dir)
        slots = plan_slots(visible_gpus(), self.jobs_per_gpu, self.cpu_jobs)
        os.environ[SLOTS_ENV] = json.dumps([asdict(s) for s in slots])  # workers inherit it
        os.environ["ATTNRES_LOCK_DIR"] = str(self.lock_dir)
        os.environ[SWEEP_ENV] = json.dumps({"pid": os.getpid(), "start": process_start(os.getpid()),
                                            "grace_s": self.stop_grace_s})
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
            results = joblib_launch(self, job_overrides=to_run, initial_job_idx=initial_job_idx)
        return results  # the summary is written by the SweepSummary callback (conf/config.yaml)


# -- how the sweep ended -----------------------------------------------------------------------------
#: the jobs of the sweeps run by this process: sweep folder -> {job folder: the job it duplicates}
_sweep_jobs: dict[str, dict[str, str | None]] = {}
_outcomes: dict[str, Counter] = {}  # sweep folder -> how its jobs ended (record_outcome)
OK_STATUSES = ("finished", "duplicate")  # any other status of a job makes the exit status 1


def _key(sweep_dir: Path) -> str:
    return str(Path(sweep_dir).resolve())


def record_outcome(sweep_dir: Path) -> Counter:
    """Count how the jobs of the sweep that just ran into `sweep_dir` ended (status -> jobs), for
    the sweep's last line and `exit_status`. The jobs are the ones this process launched or ran;
    with a launcher whose jobs run elsewhere (SLURM), every job folder of `sweep_dir`."""
    jobs = _sweep_jobs.get(_key(sweep_dir))
    if jobs:
        statuses = ["duplicate" if same_as else read_status(sweep_dir / name) or "unfinished"
                    for name, same_as in jobs.items()]
    else:
        statuses = [row["status"] for row in collect_rows(sweep_dir)]
    counts = _outcomes[_key(sweep_dir)] = status_counts(statuses)
    return counts


def exit_status() -> int:
    """The process's exit status after `attnres-run` returns: 0 unless a sweep ran in this
    process and some of its jobs did not finish (failed, interrupted, or no status): then 1."""
    for sweep_dir in _sweep_jobs:  # the summary callback was not configured: count here
        if sweep_dir not in _outcomes:
            record_outcome(Path(sweep_dir))
    unfinished = sum(n for counts in _outcomes.values() for status, n in counts.items()
                     if status not in OK_STATUSES)
    return 1 if unfinished else 0


# -- one job (in a launcher's worker): train in a child process, on the claimed slot ---------------
def run_isolated(cfg: DictConfig, run_dir: Path, info: dict[str, Any]) -> None:
    """Run one sweep job in a fresh process and record how it ended; never raises.

    Under ParallelLauncher the process is pinned to this worker's slot; under another launcher
    (basic, SLURM) it inherits this process's devices as they are.
    """
    global _child
    slot = None
    from attnres.training import slurm

    if slurm.in_slurm_job() and not slurm.continue_own_run(cfg, run_dir):
        return  # a requeue of a job whose run has finished
    if SLOTS_ENV in os.environ:
        slot = claim_slot(Path(os.environ.get("ATTNRES_LOCK_DIR", default_lock_dir())))[0]
    else:  # the basic launcher runs the jobs in the sweep process: count them for exit_status
        with contextlib.suppress(Exception):
            sweep_dir = Path(str(HydraConfig.get().sweep.dir))
            _sweep_jobs.setdefault(_key(sweep_dir), {})[run_dir.relative_to(sweep_dir).as_posix()] = None
    env = {k: v for k, v in os.environ.items() if k != SLOTS_ENV}
    env[PARENT_ENV] = str(os.getpid())
    job_info = {**info, "slot": None, "device": "inherited"}
    if slot is not None:
        env.update(OMP_NUM_THREADS=str(slot.threads), ATTNRES_SLOT=slot.name,
                   CUDA_VISIBLE_DEVICES=slot.device if slot.device is not None and not slot.simulated else "")
        job_info.update(slot=slot.name, threads=slot.threads, simulated_gpu=slot.simulated,
                        device=f"cuda:{slot.device}" if slot.device is not None and not slot.simulated else "cpu")
    elif slurm.in_slurm_job() and slurm.job_threads():  # the CPUs SLURM gave the job, not the node's
        env["OMP_NUM_THREADS"] = str(slurm.job_threads())
        job_info.update(threads=slurm.job_threads(), slurm_job=slurm.current_job_id())
    spec_path = run_dir / ".hydra" / "job.json"
    write_json(spec_path, {"config": OmegaConf.to_container(cfg, resolve=True), "run_dir": str(run_dir),
                           "info": job_info})
    name = f"job {HydraConfig.get().job.num}"
    where = f"slot {slot.name} ({job_info['device']})" if slot else "this process's devices"
    log.info(f"{name} on {where} -> {run_dir}")
    start = end = time.time()
    _recorded.clear()
    # under SLURM the training process starts deaf to the preemption signals until it has its own
    # handlers (slurm.forward_preemption): SLURM signals every process of the job
    deaf = slurm.deaf_to_preemption() if slurm.in_slurm_job() else contextlib.nullcontext()
    try:
        with open(run_dir / "train.log", "ab") as out:
            with deaf:
                proc = subprocess.Popen(
                    [sys.executable, "-c", JOB_PROCESS, "--run-job", str(spec_path)], stdout=out,
                    stderr=subprocess.STDOUT, env=env, pass_fds=(_claimed[1],) if slot is not None and _claimed else (),
                )
            _child = proc
            if slot is not None and _claimed:  # a stale-lock check can then find the job process too
                _slot_info.update(child=proc.pid, child_start=process_start(proc.pid), run_dir=str(run_dir))
                _write_lock(_claimed[1], _slot_info)
            proc.wait()
        end = time.time()
        _record_end(proc, run_dir, job_info, end - start)
        write_json(run_dir / "slot.json", {"slot": job_info["slot"], "device": job_info["device"], "pid": proc.pid,
                                           "worker_pid": os.getpid(), "start": start, "end": end})
    finally:
        _child = None
        if slot is not None and _claimed:
            _slot_info.update(child=None, child_start=None, run_dir=None)
            with contextlib.suppress(OSError):
                _write_lock(_claimed[1], _slot_info)
        _recorded.set()
    log.info(f"{name}: {read_status(run_dir) or 'no status'} on {where} after {end - start:.0f} s")


def _record_end(proc: subprocess.Popen, run_dir: Path, job_info: dict[str, Any], wall_time_s: float) -> None:
    """metrics.json for a job process that could not say how it ended."""
    status = read_status(run_dir)
    if status in ("failed", "interrupted") or (status == "finished" and proc.returncode == 0):
        return
    if _orphaned.is_set():  # the watchdog stopped it: the sweep died
        why = f"stopped when its sweep process died (exit status {proc.returncode}); resume=true continues it"
        record = {"status": "interrupted", "error": why}
    elif proc.returncode != 0:  # died without saying why: it was killed
        why = (f"killed by signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        if proc.returncode == -signal.SIGKILL:
            why += " (out of memory?)"
        record = {"status": "failed", "error": why}
    else:
        return
    write_json(run_dir / "metrics.json", {**record, "slot": job_info["slot"], "wall_time_s": round(wall_time_s, 3)})
