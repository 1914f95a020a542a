"""SLURM sweeps: `attnres-run -m hydra/launcher=slurm ...` sends each job of the sweep to SLURM as
one task of a job array, through Hydra's submitit launcher, and makes it survive what clusters do.

- Resources fit the machine. `gpus_per_node`, `cpus_per_task` and `mem_gb` left null are derived
  from the runs (`run_needs`: no GPU for `trainer.accelerator=cpu`, or on a partition without
  GPUs under `auto`; one CPU per process and per data worker; memory per process) and capped to
  what the partition's nodes have. What a user sets is checked against `sinfo` before anything
  is submitted: a request no node can meet is one line and exit 2, never an array PENDING forever.
- The sweep's planning is the parallel launcher's (`sweep.plan_jobs`): duplicates run once, and
  with `resume=true` finished jobs are skipped without taking an allocation.
- Requeue continues. A job records its SLURM job id in `<run>/slurm.json`; a job that starts in a
  folder holding its own unfinished run (requeued by `scontrol requeue`, by preemption, or by
  submitit after a time-limit signal) continues it from `last.ckpt` without being told, and one
  whose run finished does nothing. The signal SLURM sends before the time limit or a preemption
  (SIGUSR2, `signal_delay_s` ahead; SIGUSR1 too) reaches the job's training process, which stops
  at the end of its step, writes `last.ckpt` and exits (the runner's SIGTERM path); Lightning's
  own SLURM requeue never installs. Then the job process checkpoints submitit's state and
  requeues itself, at most `max_num_timeout` times for time limits.
- The sweep always ends. The launcher polls `squeue` and `sacct` itself (never waiting on
  submitit's result files): a task no longer queued has ended, and a task that ended without
  saying how is a row with a status: `cancelled` (also when cancelled while still pending, which
  leaves no accounting record), `timed out`, `preempted`, `lost` (a node failure, or no record),
  or `failed` (an out-of-memory kill, with the advice to raise `mem_gb`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from attnres.training import sweep
from attnres.training.errors import ConfigError
from attnres.training.io import read_json, write_json

log = logging.getLogger(__name__)

#: what SLURM sends a job before its time limit or a preemption: submitit's signal (USR2, or
#: $SUBMITIT_PREEMPT_SIGNAL) and Lightning's (USR1); both stop training with a checkpoint
PREEMPT_SIGNALS = (signal.SIGUSR2, signal.SIGUSR1)
MARKER = "slurm.json"  # in a run folder: the SLURM job that last ran there
#: the launcher's own keys (conf/hydra/launcher/slurm.yaml), not passed to submitit
OWN_KEYS = ("poll_s", "mem_gb_per_process", "cpus_per_process")
#: a job's final SLURM state (sacct) -> the status of a job that ended without saying how
STATE_STATUS = {"CANCELLED": "cancelled", "TIMEOUT": "timed out", "PREEMPTED": "preempted",
                "NODE_FAIL": "lost", "BOOT_FAIL": "lost", "DEADLINE": "lost", "REVOKED": "lost",
                "OUT_OF_MEMORY": "failed", "FAILED": "failed", "COMPLETED": "lost"}
RESULT_WAIT_S = 15  # how long a job that ended may take to show its result file (slow file systems)
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
                 "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD", "PREEMPTED")


# -- the partition, as sinfo tells ------------------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    name: str
    cpus: int  # per node (the largest node)
    mem_mb: int  # per node
    gpus: int  # per node
    max_time_min: float  # math.inf without a limit


def _run(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def parse_time_limit(text: str) -> float:
    """sinfo's time limit (`infinite`, `D-HH:MM:SS`, `HH:MM:SS`, `MM:SS`, `MM`) in minutes."""
    text = text.strip()
    if text in ("infinite", "UNLIMITED", "n/a", ""):
        return math.inf
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    hours, minutes, seconds = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return (int(days or 0) * 24 + hours) * 60 + minutes + seconds / 60


def parse_gpus(gres: str) -> int:
    """GPUs per node from sinfo's GRES column (`gpu:4`, `gpu:a100:8(S:0-1)`, `(null)`)."""
    total = 0
    for item in gres.split(","):
        fields = re.sub(r"\(.*?\)", "", item).split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def read_partition(name: str | None) -> Partition:
    """The partition the jobs go to (the cluster's default when `name` is None), from `sinfo`."""
    if shutil.which("sinfo") is None:
        raise ConfigError("hydra/launcher=slurm needs SLURM's commands (sinfo, sbatch, squeue, sacct) on this "
                          "machine; run the sweep on a login node of the cluster, or drop hydra/launcher=slurm")
    try:
        out = _run(["sinfo", "-h", "-o", "%P|%c|%m|%G|%l"])
    except subprocess.TimeoutExpired as err:
        raise ConfigError("sinfo did not answer within 30 s: the SLURM controller is down or unreachable; "
                          "try again, or ask the cluster's admins") from err
    if out.returncode != 0:
        said = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit status {out.returncode}"
        raise ConfigError(f"sinfo failed ({said}); the SLURM controller must answer before a sweep can be sent to it")
    rows: dict[str, list[list[str]]] = {}
    default = None
    for line in out.stdout.splitlines():
        fields = line.split("|")
        if len(fields) != 5:
            continue
        part = fields[0]
        if part.endswith("*"):
            part = default = part[:-1]
        rows.setdefault(part, []).append(fields)
    wanted = name or default
    if wanted not in rows:
        known = ", ".join(sorted(rows)) or "none"
        if name is None:
            raise ConfigError(f"this cluster has no default partition; pass hydra.launcher.partition=<one of: {known}>")
        raise ConfigError(f"hydra.launcher.partition={name} is not a partition of this cluster; "
                          f"pass one of: {known}")

    def number(text: str) -> int:
        return int(re.sub(r"\D.*$", "", text) or 0)

    found = rows[wanted]
    return Partition(
        name=wanted, cpus=max(number(f[1]) for f in found), mem_mb=max(number(f[2]) for f in found),
        gpus=max(parse_gpus(f[3]) for f in found), max_time_min=max(parse_time_limit(f[4]) for f in found),
    )


# -- what the runs need, and what is asked for -------------------------------------------------------
def run_needs(config: DictConfig, partition: Partition, cpus_per_process: int, mem_gb_per_process: float
              ) -> dict[str, Any]:
    """Resources one job of the sweep needs, from its config: the devices its trainer uses (a GPU
    only where the trainer asks for one, or under `auto` on a partition with GPUs), a CPU per
    process and per data-loading worker, memory per process."""
    trainer, data = config.get("trainer", {}), config.get("data", {})
    accelerator = str(trainer.get("accelerator", "auto"))
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and partition.gpus > 0)
    devices = trainer.get("devices", 1)
    if isinstance(devices, int) and devices > 0:
        processes = devices
    elif isinstance(devices, (list, tuple)):
        processes = len(devices)
    else:  # auto / -1: every device of the node
        processes = partition.gpus if gpu else 1
    workers = int(data.get("num_workers", 0) or 0)
    return {"gpus_per_node": processes if gpu else 0,
            "cpus_per_task": max(1, processes * (cpus_per_process + workers)),
            "mem_gb": max(1, math.ceil(processes * mem_gb_per_process))}


def fit_resources(params: dict[str, Any], configs: Sequence[DictConfig], partition: Partition) -> dict[str, Any]:
    """`params` with the resources left null derived from the runs (capped to a node of the
    partition, with a warning), and those set by hand checked against it (ConfigError)."""
    params = dict(params)
    needs = [run_needs(c, partition, int(params.get("cpus_per_process") or 1),
                       float(params.get("mem_gb_per_process") or 4)) for c in configs]
    have = {"gpus_per_node": partition.gpus, "cpus_per_task": partition.cpus, "mem_gb": partition.mem_mb // 1024}
    what = {"gpus_per_node": "GPUs", "cpus_per_task": "CPUs", "mem_gb": "GB of memory"}
    for key in ("gpus_per_node", "cpus_per_task", "mem_gb"):
        value = params.get(key)
        if value is None:
            value = max(n[key] for n in needs)
            if key == "gpus_per_node" and value > have[key]:
                raise ConfigError(
                    f"the runs ask for {value} GPU(s) (trainer.accelerator={configs[0].trainer.get('accelerator')}) "
                    f"but a node of partition {partition.name} has {have[key]}; pass hydra.launcher.partition=<a GPU "
                    "partition>, or trainer.accelerator=cpu to train on the CPU")
            if value > have[key]:
                capped = max(1, have[key])
                log.warning(f"the runs would use {value} {what[key]} but a node of partition {partition.name} has "
                            f"{have[key]:g}: asking for {capped} (hydra.launcher.{key})")
                value = capped
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"hydra.launcher.{key}={value!r} must be a number >= 0, or null (derived from the runs)")
        elif value > have[key]:
            raise ConfigError(
                f"hydra.launcher.{key}={value:g} is more than the {have[key]:g} {what[key]} of a node in partition "
                f"{partition.name} (sinfo): the jobs would never start; pass hydra.launcher.{key}={have[key]:g} or "
                "less, null to derive it from the runs, or another hydra.launcher.partition")
        params[key] = value
    timeout = params.get("timeout_min")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 1:
        raise ConfigError(f"hydra.launcher.timeout_min={timeout!r} must be a whole number of minutes >= 1")
    if timeout > partition.max_time_min:
        raise ConfigError(f"hydra.launcher.timeout_min={timeout} is more than partition {partition.name}'s time "
                          f"limit of {partition.max_time_min:g} min (sinfo); pass "
                          f"hydra.launcher.timeout_min={int(partition.max_time_min)} or less")
    delay = params.get("signal_delay_s")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0 or delay >= timeout * 60:
        raise ConfigError(f"hydra.launcher.signal_delay_s={delay!r} must be a whole number of seconds >= 0 and "
                          f"below the time limit ({timeout} min = {timeout * 60} s)")
    if params.get("gpus_per_node") == 0:
        params["gpus_per_node"] = None  # sbatch is never asked about GPUs for a CPU job
    return params


# -- the launcher ---------------------------------------------------------------------------------------
class SlurmLauncher(SubmititSlurmLauncher):
    """Hydra's submitit SLURM launcher, with resources that fit, dedup, resume, requeue that
    continues, and a sweep that always ends with a status for every job."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from attnres.training.run import user_errors

        with user_errors():
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if not job_overrides:
            raise sweep.no_jobs_error(self.config)
        sweep.lock_sweep_dir(sweep_dir)
        partition = read_partition(self.params.get("partition"))
        fitted: dict[str, Any] = {}

        def fit(configs: list[DictConfig]) -> None:  # before the plan is recorded: a refusal writes nothing
            if configs:
                fitted.update(fit_resources(self.params, configs, partition))

        planned = sweep.plan_jobs(self, job_overrides, sweep_dir, check=fit)
        log.info(f"{len(job_overrides)} jobs: {len(planned)} to run, {len(job_overrides) - len(planned)} skipped "
                 f"(duplicate or finished); partition {partition.name}")
        if not planned:
            return []
        params = fitted
        poll_s = float(params.get("poll_s") or 5)
        executor = submitit.AutoExecutor(cluster="slurm", folder=params["submitit_folder"],
                                         slurm_max_num_timeout=int(params.get("max_num_timeout") or 0))
        base = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
                "stderr_to_stdout"}
        skip = {"submitit_folder", "max_num_timeout", *OWN_KEYS}
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()
                                      if k not in skip and not k.startswith("_")})
        log.info(f"SLURM: {len(planned)} job(s) to partition {partition.name}, each "
                 f"{params['cpus_per_task']} CPU(s), {params['mem_gb']} GB, {params.get('gpus_per_node') or 0} GPU(s), "
                 f"{params['timeout_min']} min -> {sweep_dir}")
        job_params = []
        for idx, (overrides, _) in enumerate(planned):
            log.info(f"\t#{initial_job_idx + idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", initial_job_idx + idx,
                               f"job_id_for_{initial_job_idx + idx}", _singleton_state()))
        try:
            jobs = executor.map_array(self, *zip(*job_params, strict=True))
        except Exception as err:  # sbatch refused the array: its own words, on one line
            words = " ".join(str(err).split())
            raise ConfigError(f"sbatch refused the sweep's jobs: {words[-300:]}; check the hydra.launcher.* "
                              "keys (README: Sweeps, SLURM)") from err
        try:
            return wait_for_jobs(jobs, [c for _, c in planned], sweep_dir, poll_s)
        except KeyboardInterrupt:  # the jobs are the cluster's now: say how to follow them
            arrays = " ".join(sorted({job.job_id.split("_")[0] for job in jobs}))
            print(f"attnres-run: stopped waiting; the sweep's jobs keep running on the cluster (squeue -j {arrays}; "
                  f"scancel {arrays} stops them); summarise them later with python experiments/summarize.py "
                  f"{sweep_dir}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    # -- in the SLURM job ---------------------------------------------------------------------------
    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict) -> JobReturn:
        """Runs in the SLURM job: the job (sweep.run_isolated, whose training process stops with a
        checkpoint on the preemption signal), then submitit's checkpoint-and-requeue if that signal
        came and the run is not finished."""
        received: list[int] = []
        previous = {}
        for sig in PREEMPT_SIGNALS:
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, lambda signum, frame: received.append(signum))
        try:
            result = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if received:
            run_dir = Path(str(result.hydra_cfg.hydra.runtime.output_dir)) if result.hydra_cfg else None
            if run_dir is None or sweep.read_status(run_dir) != "finished":
                submitit_handler = previous.get(_submitit_signal())
                log.warning(f"received {signal.Signals(received[0]).name}: the run is checkpointed; requeueing")
                if callable(submitit_handler):  # checkpoint, requeue and exit; raises when out of tries
                    submitit_handler(_submitit_signal(), None)
        return result


def _singleton_state() -> dict:
    from hydra.core.singleton import Singleton

    return Singleton.get_state()


def _submitit_signal() -> int:
    from submitit.core.job_environment import JobEnvironment

    return JobEnvironment._usr_sig()


# -- waiting for the array -------------------------------------------------------------------------------
def queued_states(array_ids: set[str]) -> dict[str, str] | None:
    """Tasks of these arrays still in SLURM's queue (task id -> state), or None when squeue fails."""
    try:
        out = _run(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(sorted(array_ids))])
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return {} if "Invalid job id" in out.stderr else None  # every job has left the queue
    states = {}
    for line in out.stdout.splitlines():
        task, _, state = line.partition("|")
        states[task.strip()] = state.strip()
    return states


def accounted_states(array_ids: set[str]) -> dict[str, str]:
    """The last recorded state of each task of these arrays (sacct), e.g. {"12_0": "CANCELLED"}."""
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        out = _run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(sorted(array_ids))])
        if out.returncode == 0:
            states = {}
            for line in out.stdout.splitlines():
                task, _, state = line.partition("|")
                if state:
                    states[task.strip()] = state.split()[0]  # "CANCELLED by 0"
            return states
    return {}


def wait_for_jobs(jobs: Sequence[Any], configs: Sequence[DictConfig], sweep_dir: Path, poll_s: float,
                  settle_s: float = 30) -> list[JobReturn]:
    """Wait until every task has left the queue, then give each job its status (`job_outcome`).
    A task that left the queue but whose final state sacct does not know yet gets `settle_s`."""
    pending = {job.job_id: (job, config) for job, config in zip(jobs, configs, strict=True)}
    array_ids = {job_id.split("_")[0] for job_id in pending}
    gone_since: dict[str, float] = {}
    results: list[JobReturn] = []
    last_report = 0.0
    while pending:
        queued = queued_states(array_ids)
        if queued is None:  # squeue did not answer: ask again later
            time.sleep(poll_s)
            continue
        left = [job_id for job_id in pending if job_id not in queued]
        accounted = accounted_states(array_ids) if left else {}
        now = time.monotonic()
        for job_id in left:
            state = accounted.get(job_id)
            if (state in ACTIVE_STATES or state is None) and now - gone_since.setdefault(job_id, now) < settle_s:
                continue  # sacct lags behind the queue
            job, config = pending.pop(job_id)
            result = job_outcome(job, config, sweep_dir, None if state in ACTIVE_STATES else state)
            if result is not None:
                results.append(result)
        if pending and now - last_report > 60:
            counts: dict[str, int] = {}
            for job_id in pending:
                counts[queued.get(job_id, "ENDING")] = counts.get(queued.get(job_id, "ENDING"), 0) + 1
            log.info("SLURM: waiting for " + ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())))
            last_report = now
        if pending:
            time.sleep(poll_s)
    return results


def _result(job: Any, wait_s: float = 15) -> tuple[str, Any] | None:
    """submitit's result file of the job, ("success", JobReturn) or ("error", trace), or None."""
    from submitit.core import utils

    path = job.paths.result_pickle
    deadline = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    if not path.exists():
        return None
    try:
        return utils.pickle_load(path)
    except Exception:  # a torn or unreadable file: as if there were none
        return None


def job_outcome(job: Any, config: DictConfig, sweep_dir: Path, state: str | None) -> JobReturn | None:
    """How one task ended: its JobReturn when it returned one; its run folder's metrics.json says
    the status when the job could not (cancelled, timed out, preempted, lost, out of memory)."""
    run_dir = sweep_dir / str(config.hydra.sweep.subdir)
    outcome = _result(job, wait_s=RESULT_WAIT_S if state in (None, "COMPLETED", "FAILED") else 2)
    status = sweep.read_status(run_dir)
    where = f"SLURM job {job.job_id}"
    limit = config.hydra.launcher.get("timeout_min")
    if outcome is not None and outcome[0] == "success" and state in (None, "COMPLETED") and status:
        return outcome[1]  # the job said how it ended (finished, failed, interrupted)
    if outcome is not None and outcome[0] == "error" and "timed-out too many times" in str(outcome[1]):
        why = (f"timed out {config.hydra.launcher.get('max_num_timeout')} time(s) and was requeued each time "
               f"({limit} min each, hydra.launcher.timeout_min); resume=true continues it")
        record(run_dir, config, "timed out", why, job.job_id, state)
    elif state == "OUT_OF_MEMORY":
        record(run_dir, config, "failed", f"out of memory ({where}, {config.hydra.launcher.get('mem_gb')} GB); raise "
               "hydra.launcher.mem_gb (null: derived), then resume=true", job.job_id, state)
    elif state in ("CANCELLED", None) and not started(run_dir):
        record(run_dir, config, "cancelled", f"cancelled before it started ({where}); resume=true runs it",
               job.job_id, state)
    elif state == "CANCELLED":
        record(run_dir, config, "cancelled", f"cancelled while running ({where}); resume=true continues it from its "
               "last checkpoint", job.job_id, state)
    elif state == "TIMEOUT":
        record(run_dir, config, "timed out", f"hit its time limit ({limit} min, hydra.launcher.timeout_min) without "
               "being requeued; raise it or hydra.launcher.max_num_timeout, then resume=true", job.job_id, state)
    elif state == "PREEMPTED":
        record(run_dir, config, "preempted", f"preempted ({where}) and not requeued; resume=true continues it",
               job.job_id, state)
    elif outcome is not None and outcome[0] == "error":
        last = [line for line in str(outcome[1]).splitlines() if line.strip()][-1:] or ["?"]
        record(run_dir, config, "failed", f"{last[0].strip()[:300]} ({where})", job.job_id, state)
    elif status in ("failed",):
        pass  # the run said why
    else:
        why = f"ended without a result ({where}, state {state or 'not recorded'}); resume=true continues it"
        record(run_dir, config, "lost", why, job.job_id, state)
    log.info(f"{where}: {sweep.read_status(run_dir)} ({run_dir.name})")
    return None


def started(run_dir: Path) -> bool:
    return (run_dir / MARKER).is_file() or sweep.holds_run(run_dir)


def record(run_dir: Path, config: DictConfig, status: str, why: str, job_id: str, state: str | None) -> None:
    """metrics.json of a job that could not say how it ended: its status and why, over what the
    run wrote (an interrupted run keeps its metrics); `.hydra/` too for a job that never started,
    so that the summary has its row."""
    hydra_dir = run_dir / ".hydra"
    if not (hydra_dir / "config.yaml").is_file():
        hydra_dir.mkdir(parents=True, exist_ok=True)
        task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        OmegaConf.save(task, hydra_dir / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(config.hydra, resolve=False)}),
                       hydra_dir / "hydra.yaml")
        OmegaConf.save(OmegaConf.create(list(config.hydra.overrides.task)), hydra_dir / "overrides.yaml")
    metrics = read_json(run_dir / "metrics.json")
    write_json(run_dir / "metrics.json", {**metrics, "status": status, "error": why,
                                          "slurm": {"job_id": job_id, "state": state}})


# -- in the job: a requeued job continues its own run ---------------------------------------------------
def current_job_id() -> str | None:
    """This SLURM task's id as submitit and sacct name it (`12_3` in an array), or None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def in_slurm_job() -> bool:
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and current_job_id() is not None


def continue_own_run(cfg: DictConfig, run_dir: Path) -> bool:
    """In a SLURM job, before its run starts: when `run_dir` holds this job's own run (a requeue or
    a retry of the same task), set `resume=true` to continue it; returns False when that run has
    finished (nothing to do). Records this job in `<run_dir>/slurm.json` either way."""
    job_id = current_job_id()
    mark = read_json(run_dir / MARKER)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if mark.get("job_id") == job_id and sweep.holds_run(run_dir):
        if sweep.read_status(run_dir) == "finished":
            log.info(f"SLURM job {job_id} (restart {restarts}): its run in {run_dir} has finished; nothing to do")
            return False
        log.warning(f"SLURM job {job_id} (restart {restarts}): continuing its own run in {run_dir} "
                    "from its last checkpoint (resume=true)")
        with read_write(cfg), open_dict(cfg):
            cfg.resume, cfg.overwrite = True, False
    write_json(run_dir / MARKER, {"job_id": job_id, "restarts": restarts, "node": socket.gethostname(),
                                  "start": time.time()})
    return True


def job_threads() -> int | None:
    """The CPUs SLURM gave this task (torch threads for its training process)."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    return int(cpus) if cpus and cpus.isdigit() else None


@contextlib.contextmanager
def deaf_to_preemption() -> Any:
    """While starting the training process: the preemption signals ignored (a process inherits an
    ignored signal across exec), this process's own handlers back afterwards."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in PREEMPT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def forward_preemption() -> None:
    """In a job's training process under SLURM: the first preemption signal (SIGUSR2/SIGUSR1) becomes
    the runner's SIGTERM (stop after this step, write last.ckpt, exit); later ones are ignored.
    Installed before Lightning starts, so Lightning's own SLURM requeue handler stays out."""
    done: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        if not done:
            done.append(signum)
            log.warning(f"received {signal.Signals(signum).name} from SLURM (preemption or time limit): "
                        "stopping after this step with a checkpoint")
            os.kill(os.getpid(), signal.SIGTERM)

    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, handle)

