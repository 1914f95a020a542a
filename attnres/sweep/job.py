"""One sweep job: a fresh process on the claimed slot, which calls `training.run.train` directly.

An exception, an out-of-memory error or a kill ends that job as `failed`, with its error in
`metrics.json`, and the sweep goes on. A fresh process per job is also what lets Lightning's
DDP launcher re-run the job, not the sweep. A job process gets SIGTERM when its worker dies
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from attnres.atomic import WRITE_ERRORS, read_json, write_json
from attnres.sweep import slots, slurm_job, stopping
from attnres.sweep.plan import folder_key, read_status, sweep_jobs
from attnres.sweep.slots import (
    PARENT_ENV,
    SLOTS_ENV,
    Slot,
    _sweep_of_worker,
    claim_slot,
    default_lock_dir,
    die_with_parent,
    process_start,
    write_lock,
)

log = logging.getLogger(__name__)

#: how a job's own process starts (`job_process`), with the spec its worker wrote as argument; as a
#: module, so that Lightning's DDP launcher starts the job's other ranks the same way
JOB_PROCESS = [sys.executable, "-m", "attnres.sweep.job"]


def job_process() -> None:
    """A sweep job's own process (`python -m attnres.sweep.job SPEC`): it gets SIGTERM when its
    worker dies, then trains the job its spec describes and exits with its status."""
    die_with_parent(signal.SIGTERM)
    if slurm_job.in_slurm_job():  # SLURM's warning before a preemption or its time limit: checkpoint and exit
        slurm_job.forward_preemption()
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit() and os.getppid() != int(parent):  # the worker died before the line above
        sys.exit(128 + signal.SIGTERM)
    sys.exit(run_child_job(Path(sys.argv[1])))


def run_child_job(spec_path: Path) -> int:
    """Body of a sweep job's own process: `training.run.train` on the spec the launcher's worker
    wrote; any failure is recorded in metrics.json (status "failed" and the error), not raised."""
    import torch  # here, as Lightning below: Hydra's workers import this module and need neither

    from attnres.tasks import main as tasks
    from attnres.training.faults import RunEnded, RunRefused, secondary_rank
    from attnres.training.run import train

    spec = json.loads(spec_path.read_text())
    run_dir, info = Path(spec["run_dir"]), spec["info"]
    threads = info.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    start = time.perf_counter()
    try:
        train(OmegaConf.create(spec["config"]), run_dir, info, tasks)  # eval.tasks at each job's end
        return 0
    except RunEnded as err:  # interrupted, or stopped on a non-finite loss: metrics.json says so already
        print(f"attnres-run: {err}", file=sys.stderr)
        return err.exit_code
    except RunRefused as err:  # the folder is another run's: its metrics.json is not this job's to write
        print(f"attnres-run: error: {err}", file=sys.stderr)
        return 2
    except BaseException as err:  # a job's failure is data for the summary, not a crash of the sweep
        traceback.print_exc()
        if secondary_rank():  # rank 0 writes the run folder; this rank's job process tells the others
            return 1
        message = str(err).splitlines()[0] if str(err) else ""
        cause = err
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
            message = str(cause).splitlines()[0] if str(cause) else message
        write_json(run_dir / "metrics.json", {
            "status": "failed", "error": f"{type(cause).__name__}: {message}"[:500], "slot": info.get("slot"),
            "wall_time_s": round(time.perf_counter() - start, 3), "overrides": info.get("overrides"),
        })
        return 1


def fit_to_slot(cfg: DictConfig, slot: Slot) -> None:
    """A job of this machine's parallel launcher runs on its slot's devices, on this one machine:
    a run that asks for more nodes (`trainer.num_nodes`, which only a cluster launcher can start)
    or more GPUs than its slot holds (experiment=paper_scaling's 8 or 16) runs on the slot's, and
    says so; its global batch (`data.tokens_per_step`) stays, the gradient accumulation follows."""
    devices, nodes = cfg.trainer.get("devices"), int(cfg.trainer.get("num_nodes") or 1)
    on_gpus = slot.device is not None and not slot.simulated
    if nodes == 1 and not (on_gpus and isinstance(devices, int) and devices > slot.gpus):
        return
    with read_write(cfg), open_dict(cfg):
        cfg.trainer.devices, cfg.trainer.num_nodes = slot.gpus, 1
    log.info(f"job {HydraConfig.get().job.num}: trainer.devices={devices} x trainer.num_nodes={nodes} asked, on one "
             f"machine it runs on slot {slot.name}'s {slot.gpus} device(s), the global batch kept "
             "(hydra.launcher.gpus_per_job=G gives a job G GPUs; hydra/launcher=slurm spans nodes)")


# -- one job (in a launcher's worker): train in a child process, on the claimed slot ---------------
def run_isolated(cfg: DictConfig, run_dir: Path, info: dict[str, Any]) -> None:
    """Run one sweep job in a fresh process and record how it ended; never raises.

    Under ParallelLauncher the process is pinned to this worker's slot; under another launcher
    (basic, SLURM) it inherits this process's devices as they are.
    """
    slot = None
    if slurm_job.in_slurm_job() and not slurm_job.continue_own_run(cfg, run_dir):
        return  # a requeue of a job whose run has finished
    stop_file = _sweep_of_worker().get("stop_file")
    if SLOTS_ENV in os.environ:  # a ParallelLauncher worker: the sweep process takes the signals
        if _sweep_of_worker().get("pid") != os.getpid():  # with one slot joblib runs the jobs in the sweep
            stopping.ignore_signals()                     # process itself, whose SweepStop must keep them
        stopped = lambda: stopping.requested(stop_file)[0] is not None  # noqa: E731
        claim = None if stopped() else claim_slot(Path(os.environ.get("ATTNRES_LOCK_DIR", default_lock_dir())),
                                                  stop=stopped)
        if claim is None:
            log.info(f"job {HydraConfig.get().job.num}: not started, the sweep was stopped ({run_dir})")
            return
        slot = claim[0]
    else:  # the basic launcher runs the jobs in the sweep process: count them for exit_status
        with contextlib.suppress(Exception):
            sweep_dir = Path(str(HydraConfig.get().sweep.dir))
            sweep_jobs.setdefault(folder_key(sweep_dir), {})[run_dir.relative_to(sweep_dir).as_posix()] = None
    env = {k: v for k, v in os.environ.items() if k != SLOTS_ENV}
    env[PARENT_ENV] = str(os.getpid())
    job_info = {**info, "slot": None, "device": "inherited"}
    if slot is not None:
        env.update(OMP_NUM_THREADS=str(slot.threads), ATTNRES_SLOT=slot.name,
                   CUDA_VISIBLE_DEVICES=slot.device if slot.device is not None and not slot.simulated else "")
        job_info.update(slot=slot.name, threads=slot.threads, simulated_gpu=slot.simulated,
                        device=f"cuda:{slot.device}" if slot.device is not None and not slot.simulated else "cpu")
        if slot.gpus > 1:  # gpus_per_job: the job runs as that many DDP ranks (Lightning starts them)
            with read_write(cfg), open_dict(cfg):
                cfg.trainer.devices = slot.gpus
                if str(cfg.trainer.get("strategy", "auto")) in ("auto", "single_device"):
                    cfg.trainer.strategy = "ddp"
        fit_to_slot(cfg, slot)
    elif slurm_job.in_slurm_job() and slurm_job.job_threads():  # the CPUs SLURM gave the job, not the node's
        env["OMP_NUM_THREADS"] = str(slurm_job.job_threads())
        job_info.update(threads=slurm_job.job_threads(), slurm_job=slurm_job.current_job_id())
    rank, tasks = slurm_job.ranks() if slurm_job.in_slurm_job() else (0, 1)
    if slurm_job.in_slurm_job():  # one DDP rank per SLURM task
        env.update(slurm_job.shape_trainer(cfg))
    spec_path = run_dir / ".hydra" / "job.json"
    if rank > 0:  # rank 0 alone writes the run folder
        spec_path = slurm_job.notes_dir() / f"{slurm_job.current_job_id()}_rank{rank}_job.json"
    write_json(spec_path, {"config": OmegaConf.to_container(cfg, resolve=True), "run_dir": str(run_dir),
                           "info": job_info})
    name = f"job {HydraConfig.get().job.num}"
    where = f"slot {slot.name} ({job_info['device']})" if slot else "this process's devices"
    log.info(f"{name} on {where} -> {run_dir}")
    start = end = time.time()
    slots.recorded.clear()
    # under SLURM the training process starts deaf to the preemption signals until it has its own
    # handlers (slurm_job.forward_preemption): SLURM signals every process of the job
    deaf = slurm_job.deaf_to_preemption() if slurm_job.in_slurm_job() else contextlib.nullcontext()
    try:
        # rank k > 0 logs to its SLURM task's own log (submitit's folder)
        with open(run_dir / "train.log", "ab") if rank == 0 else contextlib.nullcontext() as out:
            with deaf:
                proc = subprocess.Popen(
                    [*JOB_PROCESS, str(spec_path)], stdout=out, stderr=subprocess.STDOUT,
                    env=env, pass_fds=(slots.claimed[1],) if slot is not None and slots.claimed else (),
                    start_new_session=slot is not None,  # signals reach it once: through its worker
                )
            slots.current_job = proc
            if slot is not None and slots.claimed:  # a stale-lock check can then find the job process too
                slots.slot_info.update(child=proc.pid, child_start=process_start(proc.pid), run_dir=str(run_dir))
                write_lock(slots.claimed[1], slots.slot_info)
            if tasks > 1:
                death = _wait_ranks(proc, rank)
            else:
                stopping.wait_forwarding(proc, stop_file if slot is not None else None)
        end = time.time()
        if tasks > 1:
            _end_of_rank(proc, run_dir, rank, death)
            if rank > 0:
                return
        try:  # a disk that fills as the job ends loses these notes only: the run's own files are whole
            _record_end(proc, run_dir, job_info, end - start, stopping.requested(stop_file)[0])
            write_json(run_dir / "slot.json", {"slot": job_info["slot"], "device": job_info["device"],
                                               "pid": proc.pid, "worker_pid": os.getpid(), "start": start, "end": end})
        except OSError as err:
            if err.errno not in WRITE_ERRORS:
                raise
            log.warning(f"could not record how {run_dir.name} ended ({err.strerror} writing {err.filename}); "
                        "its run's own files are as the job left them")
    finally:
        slots.current_job = None
        if slot is not None and slots.claimed:
            slots.slot_info.update(child=None, child_start=None, run_dir=None)
            with contextlib.suppress(OSError):
                write_lock(slots.claimed[1], slots.slot_info)
            slots.release_slot()  # per job: a worker between jobs holds no slot another sweep waits for
        slots.recorded.set()
    log.info(f"{name}: {read_status(run_dir) or 'no status'} on {where} after {end - start:.0f} s")


def _wait_ranks(proc: subprocess.Popen, rank: int, poll_s: float = 1.0) -> dict | None:
    """Wait for this rank's training process; when another rank of the job dies first, kill it
    (its collectives would wait for the dead rank until their timeout) and return that rank's note."""
    while True:
        try:
            proc.wait(timeout=poll_s)
            return None
        except subprocess.TimeoutExpired:
            pass
        death = slurm_job.first_death(other_than=rank)
        if death is not None:
            proc.kill()
            proc.wait()
            return death


def _end_of_rank(proc: subprocess.Popen, run_dir: Path, rank: int, death: dict | None, grace_s: float = 10) -> None:
    """After a rank's training process of a multi-task job ended: a rank whose process died (killed,
    or failed) says so for the others; rank 0 then records the rank that died first, in one line."""
    code = proc.returncode
    if death is None and (code < 0 or code == 1):
        why = f"killed by signal {signal.Signals(-code).name}" if code < 0 else "its training failed"
        if code == 1 and rank == 0:
            why = str(read_json(run_dir / "metrics.json").get("error") or why)
        slurm_job.note_death(why[:300])
    if rank > 0 or (death is None and not (code < 0 or code == 1)):
        return
    deadline = time.monotonic() + grace_s  # the rank that died first may say so after this one noticed
    while death is None and time.monotonic() < deadline:
        death = slurm_job.first_death(other_than=0)
        time.sleep(0.5)
    death = slurm_job.first_death() if death is None else min(
        [d for d in (death, slurm_job.first_death()) if d], key=lambda d: d.get("time", 0))
    if death is not None:
        metrics = read_json(run_dir / "metrics.json")
        write_json(run_dir / "metrics.json", {**metrics, "status": "failed", "error": slurm_job.death_line(death)})


def _record_end(proc: subprocess.Popen, run_dir: Path, job_info: dict[str, Any], wall_time_s: float,
                stopped_by: signal.Signals | None = None) -> None:
    """metrics.json for a job process that could not say how it ended."""
    status = read_status(run_dir)
    by_signal = proc.returncode < 0 or "KeyboardInterrupt" in str(read_json(run_dir / "metrics.json").get("error"))
    if stopped_by is not None and status not in ("finished", "interrupted") and by_signal:
        # stopped before its handlers were in place, or at once by a second signal
        why = f"stopped by {stopped_by.name} sent to the sweep; resume=true continues it from its last checkpoint"
        record = {"status": "interrupted", "error": why}
    elif status in ("failed", "interrupted") or (status == "finished" and proc.returncode == 0):
        return
    elif slots.orphaned.is_set():  # the watchdog stopped it: the sweep died
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


if __name__ == "__main__":
    job_process()
