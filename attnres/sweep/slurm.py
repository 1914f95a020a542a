"""SLURM sweeps: `attnres-run -m hydra/launcher=slurm ...` sends each job of the sweep to SLURM as
one element of a job array, through Hydra's submitit launcher, and makes it survive what clusters do.

- A job may span GPUs and nodes: `tasks_per_node` x `nodes` SLURM tasks started by srun, one DDP
  rank each (`slurm_resources.job_shape`, `slurm_job.shape_trainer`); rank 0 alone writes the run
  folder, and a rank that dies stops the others and fails the job in one line naming it.

- Resources fit the machine. `gpus_per_node`, `cpus_per_task` and `mem_gb` left null are derived
  from the runs (`run_needs`: no GPU for `trainer.accelerator=cpu`, or on a partition without
  GPUs under `auto`; one CPU per process and per data worker; memory per process) and capped to
  what the partition's nodes have. What a user sets is checked against `sinfo` before anything
  is submitted: a request no node can meet is one line and exit 2, never an array PENDING forever.
- The sweep's planning is the parallel launcher's (`plan.plan_jobs`): duplicates run once, and
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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import DictConfig, OmegaConf

from attnres.atomic import read_json, write_json
from attnres.config.errors import ConfigError
from attnres.sweep import on_demand, slurm_job
from attnres.sweep.plan import AttnresLauncher, holds_run, plan_jobs, read_status
from attnres.sweep.slurm_job import MARKER, PREEMPT_SIGNALS
from attnres.sweep.slurm_resources import fit_groups, read_partition, run_command

log = logging.getLogger(__name__)

#: the launcher's own keys (conf/hydra/launcher/slurm.yaml), not passed to submitit
OWN_KEYS = ("poll_s", "mem_gb_per_process", "cpus_per_process")
#: a job's final SLURM state (sacct) -> the status of a job that ended without saying how
STATE_STATUS = {"CANCELLED": "cancelled", "TIMEOUT": "timed out", "PREEMPTED": "preempted",
                "NODE_FAIL": "lost", "BOOT_FAIL": "lost", "DEADLINE": "lost", "REVOKED": "lost",
                "OUT_OF_MEMORY": "failed", "FAILED": "failed", "COMPLETED": "lost"}
RESULT_WAIT_S = 15  # how long a job that ended may take to show its result file (slow file systems)
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
                 "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD", "PREEMPTED")


# -- the launcher ---------------------------------------------------------------------------------------
class SlurmLauncher(AttnresLauncher, SubmititSlurmLauncher):
    """Hydra's submitit SLURM launcher, with resources that fit, dedup, resume, requeue that
    continues, and a sweep that always ends with a status for every job."""

    def _launch(self, sweep_dir: Path, job_overrides: Sequence[Sequence[str]],
                initial_job_idx: int) -> Sequence[JobReturn]:
        return on_demand.launch(self, sweep_dir, job_overrides, initial_job_idx, self._launch_batch)  # seeds.on_demand

    def _launch_batch(self, sweep_dir: Path, job_overrides: Sequence[Sequence[str]],
                      initial_job_idx: int) -> Sequence[JobReturn]:
        partition = read_partition(self.params.get("partition"))
        groups: list[tuple[list[int], dict[str, Any]]] = []

        def fit(configs: list[DictConfig]) -> None:  # before the plan is recorded: a refusal writes nothing
            if configs:
                groups[:] = fit_groups(self.params, configs, partition)

        planned = plan_jobs(self, job_overrides, sweep_dir, check=fit)
        log.info(f"{len(job_overrides)} jobs: {len(planned)} to run, {len(job_overrides) - len(planned)} skipped "
                 f"(duplicate or finished); partition {partition.name}")
        if not planned:
            return []
        job_params = [(list(overrides), "hydra.sweep.dir", initial_job_idx + idx,
                       f"job_id_for_{initial_job_idx + idx}", _singleton_state())
                      for idx, (overrides, _) in enumerate(planned)]
        order, jobs = [], []
        poll_s = float(groups[0][1].get("poll_s") or 5)
        for indices, params in groups:  # one job array per job shape
            try:
                jobs += self._submit(params, partition, sweep_dir, [job_params[i] for i in indices])
            except ConfigError:  # sbatch refused this shape: the arrays already submitted go too
                for job in jobs:
                    with contextlib.suppress(Exception):
                        job.cancel(check=False)
                raise
            order += indices
        configs = [planned[i][1] for i in order]
        try:
            return wait_for_jobs(jobs, configs, sweep_dir, poll_s)  # in the order they end; None left out
        except KeyboardInterrupt:  # the jobs are the cluster's now: say how to follow them
            arrays = " ".join(sorted({job.job_id.split("_")[0] for job in jobs}))
            print(f"attnres-run: stopped waiting; the sweep's jobs keep running on the cluster (squeue -j {arrays}; "
                  f"scancel {arrays} stops them); summarise them later with attnres-summarize "
                  f"{sweep_dir}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    def _submit(self, params: dict[str, Any], partition: Any, sweep_dir: Path, job_params: list[tuple]) -> list[Any]:
        """One job array of `job_params` (jobs of one shape) with the fitted `params`."""
        import submitit

        executor = submitit.AutoExecutor(cluster="slurm", folder=params["submitit_folder"],
                                         slurm_max_num_timeout=int(params.get("max_num_timeout") or 0))
        base = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
                "stderr_to_stdout"}
        skip = {"submitit_folder", "max_num_timeout", *OWN_KEYS}
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()
                                      if k not in skip and not k.startswith("_")})
        ranks = f"{params['nodes']} node(s) x {params['tasks_per_node']} task(s), each task "
        log.info(f"SLURM: {len(job_params)} job(s) to partition {partition.name}, each {ranks}"
                 f"{params['cpus_per_task']} CPU(s); per node {params['mem_gb']} GB, "
                 f"{params.get('gpus_per_node') or 0} GPU(s); "
                 f"{params['timeout_min']} min -> {sweep_dir}")
        for overrides, _, number, _, _ in job_params:
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
        try:
            return list(executor.map_array(self, *zip(*job_params, strict=True)))
        except Exception as err:  # sbatch refused the array: its own words, on one line
            words = " ".join(str(err).split())
            raise ConfigError(f"sbatch refused the sweep's jobs: {words[-300:]}; check the hydra.launcher.* "
                              "keys (docs/sweeps.md, SLURM)") from err

    # -- in the SLURM job ---------------------------------------------------------------------------
    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict) -> JobReturn:
        """Runs in the SLURM job: the job (job.run_isolated, whose training process stops with a
        checkpoint on the preemption signal), then submitit's checkpoint-and-requeue if that signal
        came and the run is not finished."""
        if slurm_job.ranks()[0] > 0:  # rank 0 alone writes the run folder (Hydra's .hydra/ and log too)
            sweep_overrides = [*sweep_overrides, "hydra.output_subdir=null"]
            handlers = OmegaConf.select(self.config, "hydra.job_logging.handlers") if self.config else None
            if handlers is not None and "file" in handlers:  # this rank logs to its task's own log only
                sweep_overrides.append(f"hydra.job_logging.handlers.file.filename={os.devnull}")
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
            if run_dir is None or read_status(run_dir) != "finished":
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
        out = run_command(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(sorted(array_ids))])
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
        out = run_command(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(sorted(array_ids))])
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
    status = read_status(run_dir)
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
    log.info(f"{where}: {read_status(run_dir)} ({run_dir.name})")
    return None


def started(run_dir: Path) -> bool:
    return (run_dir / MARKER).is_file() or holds_run(run_dir)


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


