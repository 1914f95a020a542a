"""Sweeps through the real CLI: device slots, dedup, failure isolation, resume, summaries, DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from attnres.results.summary import find_job_dirs, job_labels, job_overrides
from attnres.sweep.slots import Slot, plan_slots

pytestmark = pytest.mark.slow

TINY = [
    "data=synthetic", "data.batch_size=8", "data.val_batches=1", "model.n_layer=2", "model.n_embd=32",
    "model.n_head=2", "trainer.accelerator=cpu", "trainer.max_steps=3", "trainer.val_check_interval=3", "logger=none",
]


def attnres_run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "attnres", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=900)


def job_dirs(sweep: Path) -> dict[str, Path]:
    """The sweep's run folders by the overrides that differ between them (as the summary labels them)."""
    dirs = find_job_dirs(sweep)
    labels = job_labels({d.name: job_overrides(d) or {} for d in dirs})
    return {labels[d.name]: d for d in dirs}


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_two_simulated_gpus_never_share_a_slot(tmp_path):
    result = attnres_run("-m", *TINY, "seed=0,1,2,3", "hydra.sweep.dir=sweep",
                         f"hydra.launcher.lock_dir={tmp_path}/locks", cwd=tmp_path, env={"ATTNRES_FAKE_GPUS": "2"})
    assert result.returncode == 0, result.stderr[-4000:]
    jobs = job_dirs(tmp_path / "sweep")
    assert len(jobs) == 4
    held = [json.loads((d / "slot.json").read_text()) for d in jobs.values()]
    assert {h["slot"] for h in held} == {"gpu0.0", "gpu1.0"}
    for a, b in combinations(held, 2):  # two jobs on one slot never overlap in time
        if a["slot"] == b["slot"]:
            assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)
    assert any(sum(h["slot"] == s for h in held) >= 2 for s in ("gpu0.0", "gpu1.0")), "no slot was reused"
    assert any(a["slot"] != b["slot"] and a["start"] < b["end"] and b["start"] < a["end"]
               for a, b in combinations(held, 2)), "the two slots never ran at once"
    for d in jobs.values():
        assert metrics(d)["status"] == "finished" and metrics(d)["slot"] in ("gpu0.0", "gpu1.0")
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "4 finished" in summary and "gpu0.0" in summary
    assert (tmp_path / "sweep" / "summary.png").stat().st_size > 1000
    assert len((tmp_path / "sweep" / "summary.csv").read_text().splitlines()) == 5


def test_dedup_failure_isolation_and_resume(tmp_path):
    # standard ignores num_blocks: 2 jobs are one run; a strategy that raises stands for a job that
    # fails, one that kills its own process for a job killed by the OS (the command-line checks
    # build only attnres's own strategies, so both get as far as the job)
    (tmp_path / "killer.py").write_text(
        "import os, signal\nfrom attnres import StandardResidual\n"
        "class Killer(StandardResidual):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "class Raiser(StandardResidual):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise RuntimeError('boom: this strategy always fails')\n"
    )
    lock_dir = f"hydra.launcher.lock_dir={tmp_path}/locks"
    args = ["-m", *TINY, "residual=standard,block", "num_blocks=2,4", "hydra.sweep.dir=sweep", lock_dir]
    first = attnres_run(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    assert first.stdout.splitlines()[-1] == "sweep: 4 jobs, 3 finished, 1 duplicate -> sweep/summary.md"
    assert "duplicate of" in (tmp_path / "sweep" / "summary.md").read_text()
    bad = ["-m", *TINY, "residual._target_=killer.Killer,killer.Raiser", "seed=5", "hydra.sweep.dir=sweep", lock_dir]
    failing = attnres_run(*bad, cwd=tmp_path)
    assert failing.returncode == 1, failing.stderr[-4000:]  # its jobs failed: the sweep says so
    assert failing.stdout.splitlines()[-1] == "sweep: 2 jobs, 2 failed -> sweep/summary.md"

    jobs = job_dirs(tmp_path / "sweep")
    ran = {name for name, d in jobs.items() if (d / "metrics.json").exists()}
    notes = json.loads((tmp_path / "sweep" / "jobs.json").read_text())
    assert len(ran) == 5  # standard once, block 2, block 4, the killed one, the failed one
    block2 = next(d for n, d in jobs.items() if "num_blocks=2" in n and "residual=block" in n)
    killed = next(d for n, d in jobs.items() if "Killer" in n)
    raised = next(d for n, d in jobs.items() if "Raiser" in n)
    assert metrics(block2)["status"] == "finished"
    assert metrics(raised)["status"] == "failed" and "boom" in metrics(raised)["error"]
    assert metrics(killed)["status"] == "failed" and "SIGKILL" in metrics(killed)["error"]
    standard = [d for n, d in jobs.items() if "residual=standard" in n]
    assert sum((d / "metrics.json").exists() for d in standard) == 1, "identical jobs both ran"
    assert not notes  # jobs.json is rewritten by each sweep; the summary is rebuilt from all folders

    # the summary covers every run folder; jobs.json (the duplicates) is the last sweep's
    assert "5 jobs: 3 finished, 2 failed." in (tmp_path / "sweep" / "summary.md").read_text()

    finished_before = (block2 / "metrics.json").stat().st_mtime_ns
    again = attnres_run(*args, "resume=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    notes = json.loads((tmp_path / "sweep" / "jobs.json").read_text())
    assert sum(n.get("skipped", False) for n in notes.values()) == 3  # standard and block N=2, 4 were finished
    assert sum(n["status"] == "duplicate" for n in notes.values()) == 1
    assert (block2 / "metrics.json").stat().st_mtime_ns == finished_before, "a finished job ran again"

    failed_before = (raised / "metrics.json").stat().st_mtime_ns
    retried = attnres_run(*bad, "resume=true", cwd=tmp_path)
    assert retried.returncode == 1, retried.stderr[-4000:]
    assert (raised / "metrics.json").stat().st_mtime_ns != failed_before, "an unfinished job did not run again"
    assert metrics(raised)["status"] == "failed" and "boom" in (tmp_path / "sweep" / "summary.md").read_text()


def test_ddp_two_processes_on_cpu(tmp_path):
    result = attnres_run(*TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                         "trainer.enable_progress_bar=false", "hydra.run.dir=ddp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = metrics(tmp_path / "ddp")
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 8 * 40  # steps x processes x batch x block_size


def test_slot_plan():
    assert [s.name for s in plan_slots(["0", "1"], 2, None)] == ["gpu0.0", "gpu0.1", "gpu1.0", "gpu1.1"]
    assert all(isinstance(s, Slot) and s.device in ("0", "1") for s in plan_slots(["0", "1"], 2, None))
    cpu = plan_slots([], 1, 3)
    assert [s.name for s in cpu] == ["cpu0", "cpu1", "cpu2"] and all(s.device is None for s in cpu)
    with pytest.raises(ValueError, match="jobs_per_gpu"):
        plan_slots(["0"], 0, None)
