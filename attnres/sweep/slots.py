"""Device slots, the locks that claim them, and the processes that hold them.

With G visible GPUs there are `jobs_per_gpu * G` slots, one joblib worker each; without GPUs,
`cpu_jobs` slots that split the cores between them. For each job a worker claims a free slot
with an exclusive `flock` on a file in `lock_dir`, before the job's process starts (so before
anything touches CUDA), and frees it when the job has ended: no two live processes share a slot,
a slot frees itself when its holder dies, and a worker between jobs holds none, so sweeps that
share the slots all finish.
A slot lock records the sweep, worker and job processes; a lock whose sweep has died is stale:
its holders are stopped, so a resumed sweep never waits on a dead sweep's lock. A worker
watches the sweep process and, if it dies (even by SIGKILL), stops its job and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnres.config.errors import ConfigError

log = logging.getLogger(__name__)

SLOTS_ENV = "ATTNRES_SLOTS"  # the launcher's slot plan, read by its workers
SWEEP_ENV = "ATTNRES_SWEEP"  # the sweep process (pid, start) and stop_grace_s, read by its workers
PARENT_ENV = "ATTNRES_JOB_PARENT"  # a job process's worker, read by the job process
FAKE_GPUS_ENV = "ATTNRES_FAKE_GPUS"  # tests: pretend there are this many GPUs (jobs still use the CPU)
SWEEP_LOCK = ".sweep.lock"


@dataclass(frozen=True)
class Slot:
    """One place a job can run: a GPU (`device` is its CUDA_VISIBLE_DEVICES entry) or a CPU share."""

    name: str  # "gpu0.1" = GPU 0, second job on it; "cpu1"
    device: str | None  # None on the CPU
    threads: int
    simulated: bool = False
    gpus: int = 1  # devices of one job (gpus_per_job): its DDP ranks; `device` lists them ("0,1")


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


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a SLURM or container cpuset),
    not every core of the machine, so a sweep pinned to one core plans one thread, not two."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def plan_slots(gpus: Sequence[str], jobs_per_gpu: int, cpu_jobs: int | None, gpus_per_job: int = 1) -> list[Slot]:
    """The slots of a sweep: `jobs_per_gpu` per GPU, or per group of `gpus_per_job` GPUs (a job of G
    DDP ranks; slots count GPUs, so 8 GPUs are 4 slots of 2); without GPUs `cpu_jobs` CPU shares,
    each of `gpus_per_job` processes when that is more than 1."""
    if jobs_per_gpu < 1:
        raise ValueError(f"hydra.launcher.jobs_per_gpu={jobs_per_gpu} must be >= 1")
    if isinstance(gpus_per_job, bool) or not isinstance(gpus_per_job, int) or gpus_per_job < 1:
        raise ConfigError(f"hydra.launcher.gpus_per_job={gpus_per_job!r} must be a whole number >= 1")
    cores = usable_cores()
    simulated = bool(os.environ.get(FAKE_GPUS_ENV))
    if gpus and gpus_per_job > 1:
        if gpus_per_job > len(gpus):
            raise ConfigError(f"hydra.launcher.gpus_per_job={gpus_per_job} but {len(gpus)} GPU(s) are visible here; "
                              f"pass hydra.launcher.gpus_per_job={len(gpus)} or less")
        groups = [gpus[i:i + gpus_per_job] for i in range(0, len(gpus) - gpus_per_job + 1, gpus_per_job)]
        threads = max(1, cores // (len(groups) * gpus_per_job * jobs_per_gpu))
        return [Slot(f"gpu{'+'.join(group)}.{k}", ",".join(group), threads, simulated, gpus_per_job)
                for group in groups for k in range(jobs_per_gpu)]
    if gpus:
        n = len(gpus) * jobs_per_gpu
        threads = max(1, cores // n)
        return [Slot(f"gpu{g}.{k}", gpu, threads, simulated) for g, gpu in enumerate(gpus) for k in range(jobs_per_gpu)]
    n = cpu_jobs or max(min(2, cores), cores // 2)  # half the cores, but 2 jobs on a 2-core machine
    if gpus_per_job > 1:  # jobs of several CPU processes (gloo): the shares count processes
        n = max(1, n // gpus_per_job)
        return [Slot(f"cpu{k}", None, max(1, cores // (n * gpus_per_job)), False, gpus_per_job) for k in range(n)]
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


def read_lock(fd: int) -> dict[str, Any]:
    """What a lock file says about its holder: JSON, or a bare pid (older lock files)."""
    text = os.pread(fd, 1 << 16, 0).decode(errors="replace").strip()
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {"pid": int(text.split()[0])} if text[:1].isdigit() else {}


def write_lock(fd: int, info: dict[str, Any]) -> None:
    data = (json.dumps(info, sort_keys=True) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def die_with_parent(sig: int) -> None:
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
        busy = read_lock(fd)
    except OSError:  # no flock on this file system (some network mounts): the pid in the file decides
        holder = read_lock(fd)
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
    write_lock(fd, {"pid": os.getpid(), "start": process_start(os.getpid())})
    _sweep_locks[key] = fd


# -- orphans of a dead sweep -------------------------------------------------------------------------
_stopping: dict[tuple[int, Any], float] = {}  # (pid, start) -> when it was sent SIGTERM


def is_stale(info: dict[str, Any]) -> bool:
    """A held slot lock is stale when the sweep that claimed it has died: its holders are orphans."""
    return bool(info.get("sweep")) and not is_alive(info["sweep"], info.get("sweep_start"))


def stop_orphans(info: dict[str, Any], grace_s: float) -> None:
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
                    info = read_lock(fd)
                    if is_stale(info):
                        stale.append(info)
                finally:
                    os.close(fd)
        if not stale or time.monotonic() > deadline:
            return
        for info in stale:
            stop_orphans(info, grace_s)
        time.sleep(0.2)


# -- slot claiming (in each joblib worker, held for one job) ------------------------------------
claimed: tuple[Slot, int] | None = None
slot_info: dict[str, Any] = {}


def _sweep_of_worker() -> dict[str, Any]:
    try:
        return json.loads(os.environ.get(SWEEP_ENV, "{}"))
    except ValueError:
        return {}


def claim_slot(
    lock_dir: Path, poll_s: float = 0.5, stop: Callable[[], bool] | None = None,
) -> tuple[Slot, int] | None:
    """Lock a free slot of the launcher's plan for this process, for one job (`release_slot` frees
    it when the job has ended: a worker with no job left must not hold a slot that another sweep's
    worker waits for); returns (slot, lock fd), or None when `stop()` turns true while it waits."""
    global claimed
    if claimed is not None:
        return claimed
    slots = [Slot(**s) for s in json.loads(os.environ[SLOTS_ENV])]
    sweep = _sweep_of_worker()
    start_watchdog(sweep)
    lock_dir.mkdir(parents=True, exist_ok=True)
    waiting_since = None
    while True:
        for slot in slots:
            fd = os.open(lock_dir / f"{slot.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_lock(fd)
                os.close(fd)
                if is_stale(holder):
                    stop_orphans(holder, float(sweep.get("grace_s", 30)))
                continue
            slot_info.clear()
            slot_info.update(slot=slot.name, worker=os.getpid(), worker_start=process_start(os.getpid()),
                              sweep=sweep.get("pid"), sweep_start=sweep.get("start"), child=None)
            write_lock(fd, slot_info)
            claimed = (slot, fd)
            return claimed
        if waiting_since is None:  # every slot is held (e.g. by another sweep on this machine): wait
            waiting_since = time.monotonic()
            log.info(f"all {len(slots)} slots in {lock_dir} are held by live processes; waiting for one")
        if stop is not None and stop():
            return None
        time.sleep(poll_s)


def release_slot() -> None:
    """Free the slot this worker claimed (its job process has ended, and with it the lock it shared)."""
    global claimed
    if claimed is not None:
        with contextlib.suppress(OSError):
            os.close(claimed[1])
        claimed = None


def default_lock_dir(cpu_only: bool = False) -> Path:
    """/tmp/attnres-slots-<uid>, shared by every sweep of the user on this machine. A sweep without
    GPUs confined to some of the cores (`taskset -c 1`) shares the slots of that set of cores alone,
    so two sweeps pinned to different cores run side by side instead of waiting for each other's
    slots; GPU slots stay shared whatever the cores, so no two sweeps put jobs on one GPU."""
    if "ATTNRES_LOCK_DIR" in os.environ:
        return Path(os.environ["ATTNRES_LOCK_DIR"])
    base = f"/tmp/attnres-slots-{os.getuid()}"
    if not cpu_only:
        return Path(base)
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return Path(base)
    if len(mine) < (os.cpu_count() or len(mine)):
        return Path(f"{base}-cpus{_ranges(mine)}")
    return Path(base)


def _ranges(cores: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": taskset's own spelling of a core list."""
    spans: list[list[int]] = []
    for c in cores:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


# -- the worker's watchdog: nothing outlives the sweep ----------------------------------------------
current_job: subprocess.Popen | None = None  # the job process this worker waits for
orphaned = threading.Event()
recorded = threading.Event()
_watchdog: threading.Thread | None = None


def start_watchdog(sweep: dict[str, Any], poll_s: float = 0.5) -> None:
    global _watchdog
    if _watchdog is not None or not sweep.get("pid"):
        return
    parent = os.getppid()
    grace_s = float(sweep.get("grace_s", 30))

    def watch() -> None:
        while os.getppid() == parent and is_alive(sweep["pid"], sweep.get("start")):
            time.sleep(poll_s)
        orphaned.set()
        child = current_job
        if child is not None and child.returncode is None:
            log.warning(f"the sweep process (pid {sweep['pid']}) died: stopping job process {child.pid}")
            stop_process(child, grace_s)
            recorded.wait(5)  # let the worker's main thread record how the job ended
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


