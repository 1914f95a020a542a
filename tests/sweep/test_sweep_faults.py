"""Sweeps under faults (issue 10): a killed sweep process, a sweep re-run over finished jobs,
two sweeps into one folder, override values holding paths, jobs that fail, an empty sweep."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnres.config.naming import run_id
from attnres.results.summary import collect_rows

TINY = [
    "data.batch_size=8", "data.val_batches=1", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
    "trainer.accelerator=cpu", "trainer.max_steps=3", "trainer.val_check_interval=3", "logger=none",
]
SYNTHETIC = ["data=synthetic", *TINY]

# A residual strategy that, with SLEEPER_HOLD set, holds its job while that file exists: a job
# still running when the sweep is killed. It leaves <hold>.started.<pid> once it holds.
SLEEPER = """
import os, pathlib, signal, time
from attnres import StandardResidual

class Sleeper(StandardResidual):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hold = os.environ.get("SLEEPER_HOLD")
        if hold:
            signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
            pathlib.Path(f"{hold}.started.{os.getpid()}").touch()
            while pathlib.Path(hold).exists():
                time.sleep(0.1)
"""


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "attnres", *args]


def attnres_run(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "SLEEPER_HOLD"}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cli(*args), cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("attnres-run: error: "), result.stderr[-3000:]
    return lines[0]


def job_folders(sweep: Path) -> list[Path]:
    return sorted(d for d in sweep.iterdir() if (d / ".hydra").is_dir())


def status(run_dir: Path) -> str | None:
    path = run_dir / "metrics.json"
    return json.loads(path.read_text()).get("status") if path.is_file() else None


# -- processes (from /proc: no psutil here) ---------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            parents[int(entry.name)] = int(fields[1])
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:160]
    return "?"


def wait_for(predicate, timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def start_held_sweep(tmp_path: Path, args: list[str], jobs: int) -> tuple[subprocess.Popen, Path]:
    """Start `args` with the Sleeper holding every job; return once `jobs` jobs hold."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    hold = tmp_path / "hold"
    hold.touch()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLEEPER_HOLD": str(hold)}
    proc = subprocess.Popen(cli(*args), cwd=tmp_path, env=env, stdout=open(tmp_path / "held.out", "w"),
                            stderr=subprocess.STDOUT)
    started = wait_for(lambda: len(list(tmp_path.glob("hold.started.*"))) >= jobs or proc.poll() is not None, 240)
    assert started and proc.poll() is None, (tmp_path / "held.out").read_text()[-3000:]
    return proc, hold


# -- 3: the sweep process is SIGKILLed mid-job ---------------------------------------------------------
@pytest.mark.slow
def test_parent_sigkill_leaves_no_orphans_and_resume_finishes(tmp_path):
    args = ["-m", *SYNTHETIC, "residual._target_=sleeper.Sleeper", "seed=0,1", "hydra.sweep.dir=sweep",
            "hydra.launcher.cpu_jobs=2", f"hydra.launcher.lock_dir={tmp_path}/locks"]
    proc, hold = start_held_sweep(tmp_path, args, jobs=2)
    tree = descendants(proc.pid)
    try:
        assert len([p for p in tree if "loky" in command(p)]) >= 2, [command(p) for p in tree]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        gone = wait_for(lambda: not any(alive(p) for p in tree), 15)
        assert gone, f"orphans of the killed sweep: {[command(p) for p in tree if alive(p)]}"
        print(f"all {len(tree)} processes of the killed sweep ended {time.monotonic() - killed:.1f} s after it")

        start = time.monotonic()
        resumed = attnres_run(*args, "resume=true", cwd=tmp_path, timeout=180)
        took = time.monotonic() - start
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        jobs = job_folders(tmp_path / "sweep")
        assert len(jobs) == 2 and all(status(d) == "finished" for d in jobs)
        assert took < 150, f"the resumed sweep took {took:.0f} s"
        print(f"the resumed sweep finished in {took:.1f} s")
    finally:  # on a failure, leave no process of ours behind
        hold.unlink(missing_ok=True)
        for pid in tree:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# -- 4: a sweep over jobs that already hold runs, and two sweeps into one folder ----------------------
@pytest.mark.slow
def test_exit_status_and_rerun_without_resume_refuses_touching_nothing(tmp_path):
    # a job that fails (12): the sweep ends 1 and its last line counts the jobs
    (tmp_path / "strategies.py").write_text(
        "from attnres import StandardResidual\n"
        "class Good(StandardResidual):\n    pass\n"
        "class Raiser(StandardResidual):\n"
        "    def __init__(self, *args, **kwargs):\n        raise RuntimeError('boom')\n"
    )
    args = ["-m", *SYNTHETIC, "residual._target_=strategies.Good,strategies.Raiser", "hydra.sweep.dir=sweep",
            f"hydra.launcher.lock_dir={tmp_path}/locks"]
    first = attnres_run(*args, cwd=tmp_path)
    assert first.returncode == 1, first.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1] == "sweep: 2 jobs, 1 finished, 1 failed -> sweep/summary.md"
    jobs = job_folders(tmp_path / "sweep")
    assert sorted(status(d) for d in jobs) == ["failed", "finished"]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for d in jobs for p in d.rglob("*") if p.is_file()}

    again = attnres_run(*args, cwd=tmp_path)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-3000:]
    line = one_error_line(again)
    assert "2 of the sweep's 2 jobs" in line
    assert all(word in line for word in ("resume=true", "overwrite=true", "name=")), line
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for d in jobs for p in d.rglob("*") if p.is_file()}
    assert after == before, "the refused sweep touched a run"


@pytest.mark.slow
def test_a_second_sweep_into_the_same_folder_is_refused(tmp_path):
    args = ["-m", *SYNTHETIC, "residual._target_=sleeper.Sleeper", "seed=0", "hydra.sweep.dir=sweep",
            "hydra.launcher.cpu_jobs=2", f"hydra.launcher.lock_dir={tmp_path}/locks"]
    proc, hold = start_held_sweep(tmp_path, args, jobs=1)
    try:
        second = attnres_run(*args, cwd=tmp_path, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        line = one_error_line(second)
        assert f"pid {proc.pid}" in line and "name=" in line, line
        hold.unlink()
        assert proc.wait(timeout=180) == 0, (tmp_path / "held.out").read_text()[-3000:]
        (job,) = job_folders(tmp_path / "sweep")
        assert status(job) == "finished"
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()


# -- 12: an empty sweep ------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_empty_sweep_is_an_error(tmp_path):
    # the command-line checks (validate.py) refuse it first; the launcher refuses what gets past them
    result = attnres_run("-m", *SYNTHETIC, "seed=range(0,0)", "hydra.sweep.dir=sweep",
                         f"hydra.launcher.lock_dir={tmp_path}/locks", cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "no job" in one_error_line(result)


def test_the_launcher_refuses_an_empty_sweep_in_one_line(tmp_path, capsys):
    from omegaconf import OmegaConf

    from attnres.sweep.launcher import ParallelLauncher

    launcher = ParallelLauncher(lock_dir=str(tmp_path / "locks"))
    launcher.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")},
                                                  "overrides": {"task": ["seed=range(0,0)"]}}})
    launcher.hydra_context = object()
    with pytest.raises(SystemExit) as exit_:
        launcher.launch([], initial_job_idx=0)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnres-run: error: the sweep has no jobs: seed=range(0,0)") and "\n" not in err


# -- 8: override values holding paths ------------------------------------------------------------------
def test_run_id_is_one_flat_bounded_stable_name():
    assert run_id("") == "defaults"
    assert run_id("residual=block,seed=1") == "residual=block,seed=1"  # plain names are kept
    a = run_id("data.path=/data/a/corpus.txt,seed=0")
    b = run_id("data.path=/data/b/corpus.txt,seed=0")
    assert a != b and a == run_id("data.path=/data/a/corpus.txt,seed=0")
    assert a.startswith("data.path=corpus.txt-") and a.endswith(",seed=0")
    for name in (a, b, run_id("data.cache_dir=/tmp/x"), run_id("ckpt_path=../up/last.ckpt"),
                 run_id("x=[a/b,c/d],y=/"), run_id("k=./.hidden"), run_id("model/attn=flash")):
        assert "/" not in name and not name.startswith(".") and name not in (".", ".."), name
    long = run_id(",".join(f"key{i}=value{i}" for i in range(60)))
    longer = run_id(",".join(f"key{i}=value{i}" for i in range(61)))
    assert len(long.encode()) <= 200 and len(longer.encode()) <= 200 and long != longer
    assert long.startswith("key0=value0,key1=value1")


@pytest.mark.slow
def test_path_values_give_flat_folders_and_every_job_in_the_summary(tmp_path):
    for corpus in ("c1", "c2"):
        (tmp_path / corpus).mkdir()
        (tmp_path / corpus / "corpus.txt").write_text(f"{corpus}: the quick brown fox jumps over the lazy dog. " * 400)
    paths = [str(tmp_path / c / "corpus.txt") for c in ("c1", "c2")]
    text = ["data=text", "data.block_size=16", *TINY]
    result = attnres_run("-m", *text, f"data.path={paths[0]},{paths[1]}", "hydra.sweep.dir=sweep",
                         f"hydra.launcher.lock_dir={tmp_path}/locks", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = tmp_path / "sweep"
    folders = [d for d in sweep.iterdir() if d.is_dir()]
    assert len(folders) == 2 and all((d / ".hydra").is_dir() for d in folders), sorted(sweep.rglob("*"))
    assert all("corpus.txt-" in d.name for d in folders)
    rows = collect_rows(sweep)
    assert len(rows) == 2 and all(r["status"] == "finished" for r in rows)
    assert sorted(r["job"] for r in rows) == sorted(f"data.path={p}" for p in paths)
    with open(sweep / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    assert result.stdout.strip().splitlines()[-1] == "sweep: 2 jobs, 2 finished -> sweep/summary.md"

    single = attnres_run(*text, f"data.path={paths[0]}", "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    (run,) = [d for d in (tmp_path / "outputs" / "default").iterdir() if d.is_dir()]
    assert (run / "metrics.json").is_file() and run.name in {d.name for d in folders}  # as the sweep names it


# -- 12: the summary's counts ---------------------------------------------------------------------------
def _fake_job(folder: Path, overrides: list[str], metrics: dict | None) -> None:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\nresidual: {}\n")
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))


def test_summarize_counts_unfinished_jobs_and_finds_nested_folders(tmp_path):
    sweep = tmp_path / "sweep"
    _fake_job(sweep / "seed=0", ["seed=0"], {"status": "finished", "metrics": {"val/loss": 1.0}})
    _fake_job(sweep / "seed=1", ["seed=1"], None)  # never got to write metrics.json
    _fake_job(sweep / "data.path=" / "tmp" / "x", ["seed=2", "data.path=/tmp/x"], {"status": "failed"})  # old naming
    result = subprocess.run([sys.executable, "experiments/summarize.py", str(sweep)],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 jobs, 1 finished, 1 failed, 1 unfinished" in result.stdout.splitlines()[0], result.stdout
    header = next(line for line in (sweep / "summary.md").read_text().splitlines() if line.startswith("3 jobs"))
    assert header.startswith("3 jobs: 1 finished, 1 failed, 1 unfinished."), header
    assert "not" not in header.split(".")[0]


# -- 3: a slot lock held for a sweep that died is reclaimed at once --------------------------------------
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_a_slot_lock_of_a_dead_sweep_is_reclaimed_at_once(tmp_path, monkeypatch):
    import threading

    from attnres.sweep import slots

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a sweep process that has died
    locks = tmp_path / "locks"
    locks.mkdir()
    holders = {}
    for slot, sweep_pid in (("cpu0", dead.pid), ("cpu1", os.getpid())):  # cpu1: a live sweep's
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(locks / f"{slot}.lock")],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        (locks / f"{slot}.lock").write_text(json.dumps({
            "slot": slot, "sweep": sweep_pid, "worker": holder.pid,
            "worker_start": slots.process_start(holder.pid), "child": None}))
        holders[slot] = holder
    monkeypatch.setenv(slots.SLOTS_ENV, json.dumps([{"name": s, "device": None, "threads": 1} for s in holders]))
    monkeypatch.setenv(slots.SWEEP_ENV, "{}")  # no watchdog in this test process
    monkeypatch.setattr(slots, "claimed", None)
    claimed = []
    thread = threading.Thread(target=lambda: claimed.append(slots.claim_slot(locks, poll_s=0.1)), daemon=True)
    try:
        start = time.monotonic()
        thread.start()
        thread.join(20)
        assert claimed, "waited on the lock of a sweep that died"
        slot, fd = claimed[0]
        assert slot.name == "cpu0" and time.monotonic() - start < 15
        assert holders["cpu0"].wait(5) == -signal.SIGTERM  # the orphan was stopped
        assert holders["cpu1"].poll() is None  # a live sweep's holder is left alone
        os.close(fd)
    finally:
        for holder in holders.values():
            holder.kill()
            holder.wait()
