"""Sweeps under faults (issue 10): a killed sweep process, a sweep re-run over finished jobs,
two sweeps into one folder, override values holding paths, jobs that fail, an empty sweep."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from attnres.results.summary import collect_rows
from tests.helpers import CLI, TINY_SWEEP, cli_env, run_cli, tiny

TINY = tiny(steps=3, val_every=3, data=None)  # the data group named by each test
SYNTHETIC = TINY_SWEEP

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
    proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=cli_env({"SLEEPER_HOLD": str(hold)}),
                            stdout=open(tmp_path / "held.out", "w"),
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
        resumed = run_cli(*args, "resume=true", cwd=tmp_path, timeout=180)
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
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 1, first.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1] == "sweep: 2 jobs, 1 finished, 1 failed -> sweep/summary.md"
    jobs = job_folders(tmp_path / "sweep")
    assert sorted(status(d) for d in jobs) == ["failed", "finished"]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for d in jobs for p in d.rglob("*") if p.is_file()}

    again = run_cli(*args, cwd=tmp_path)
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
        second = run_cli(*args, cwd=tmp_path, timeout=120)
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
    # the command-line checks (attnres/config) refuse it first; the launcher refuses what gets past them
    result = run_cli("-m", *SYNTHETIC, "seed=range(0,0)", "hydra.sweep.dir=sweep",
                         f"hydra.launcher.lock_dir={tmp_path}/locks", cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "no job" in one_error_line(result)


# -- 8: override values holding paths ------------------------------------------------------------------


@pytest.mark.slow
def test_path_values_give_flat_folders_and_every_job_in_the_summary(tmp_path):
    for corpus in ("c1", "c2"):
        (tmp_path / corpus).mkdir()
        (tmp_path / corpus / "corpus.txt").write_text(f"{corpus}: the quick brown fox jumps over the lazy dog. " * 400)
    paths = [str(tmp_path / c / "corpus.txt") for c in ("c1", "c2")]
    text = ["data=text", "data.block_size=16", *TINY]
    result = run_cli("-m", *text, f"data.path={paths[0]},{paths[1]}", "hydra.sweep.dir=sweep",
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

    single = run_cli(*text, f"data.path={paths[0]}", "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    (run,) = [d for d in (tmp_path / "outputs" / "default").iterdir() if d.is_dir()]
    assert (run / "metrics.json").is_file()
    # as the sweep names it: the same flat path value and the same hash of the whole; a sweep's folders lead
    # with the key it varies (data.path), a run alone keeps Hydra's order
    flat = next(item for item in run.name.split(",") if item.startswith("data.path="))
    assert any(flat in d.name and d.name[-8:] == run.name[-8:] for d in folders), (run.name, folders)


# -- 12: the summary's counts ---------------------------------------------------------------------------


# -- 3: a slot lock held for a sweep that died is reclaimed at once --------------------------------------


