"""Inside a SLURM job: a requeued job continues its own run, and the signal SLURM sends before a
preemption or the time limit reaches the training process as the runner's SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

from attnres.atomic import read_json, write_json
from attnres.sweep.plan import holds_run, read_status

log = logging.getLogger(__name__)


#: what SLURM sends a job before its time limit or a preemption: submitit's signal (USR2, or
#: $SUBMITIT_PREEMPT_SIGNAL) and Lightning's (USR1); both stop training with a checkpoint
PREEMPT_SIGNALS = (signal.SIGUSR2, signal.SIGUSR1)
MARKER = "slurm.json"  # in a run folder: the SLURM job that last ran there


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
    if mark.get("job_id") == job_id and holds_run(run_dir):
        if read_status(run_dir) == "finished":
            log.info(f"SLURM job {job_id} (restart {restarts}): its run in {run_dir} has finished; nothing to do")
            return False
        log.warning(f"SLURM job {job_id} (restart {restarts}): continuing its own run in {run_dir} "
                    "from its last checkpoint (resume=true)")
        with read_write(cfg), open_dict(cfg):
            cfg.resume, cfg.overwrite = True, False
    if ranks()[0] > 0:
        return True  # rank 0 records the job
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



# -- a job of several tasks: one rank each (srun), rank 0 alone writes the run folder -----------------
def ranks() -> tuple[int, int]:
    """(this task's rank, the job's tasks) under srun; (0, 1) outside a multi-task job."""
    rank, tasks = os.environ.get("SLURM_PROCID", "0"), os.environ.get("SLURM_NTASKS", "1")
    return (int(rank) if rank.isdigit() else 0), (int(tasks) if tasks.isdigit() else 1)


def shape_trainer(cfg: DictConfig) -> dict[str, str]:
    """In a SLURM job, before its run starts: the trainer runs as the job's tasks (one DDP rank per
    task: `devices` = tasks per node, `num_nodes` = nodes, strategy ddp unless the run set one).
    Returns the environment its training process needs: a one-task job whose run asks for several
    devices hides SLURM from Lightning, which then starts the other processes itself."""
    _, tasks = ranks()
    trainer = cfg.get("trainer")
    if trainer is None:
        return {}
    if tasks == 1:
        devices = trainer.get("devices", 1)
        return {"SLURM_JOB_NAME": "interactive"} if devices not in (1, "1") else {}
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", str(tasks)).split("(")[0])
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    with read_write(cfg), open_dict(cfg):
        cfg.trainer.devices, cfg.trainer.num_nodes = per_node, nodes
        if str(trainer.get("strategy", "auto")) in ("auto", "single_device"):
            cfg.trainer.strategy = "ddp"
    return {}


def notes_dir() -> Path:
    """Where the ranks of this job say that they died: submitit's folder of the job (shared by its
    nodes, outside the run folder)."""
    from submitit.core.job_environment import JobEnvironment

    return Path(JobEnvironment().paths.folder)


def _note_path(rank: int) -> Path:
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    return notes_dir() / f"{current_job_id()}_rank{rank}_restart{restarts}_died.json"


def note_death(why: str) -> None:
    """This rank's training process died (`why`): the job's other ranks stop theirs, and rank 0 says so."""
    rank, tasks = ranks()
    write_json(_note_path(rank), {"rank": rank, "tasks": tasks, "node": socket.gethostname(), "why": why,
                                  "time": time.time()})


def first_death(other_than: int | None = None) -> dict | None:
    """The note of the rank of this job that died first, or None (`other_than`: not this rank's)."""
    _, tasks = ranks()
    notes = [read_json(_note_path(rank)) for rank in range(tasks) if rank != other_than]
    notes = [n for n in notes if n]
    return min(notes, key=lambda n: n.get("time", 0)) if notes else None


def death_line(note: dict) -> str:
    return (f"rank {note['rank']} of {note['tasks']} (node {note['node']}) died: {note['why']}; the job's other "
            "ranks were stopped; resume=true continues it from its last checkpoint")
