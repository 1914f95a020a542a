"""Sweeps through the real CLI: device slots, dedup, failure isolation, resume, summaries, DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

from attnres.training.summary import short_names
from attnres.training.sweep import Slot, plan_slots

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
    return {name: sweep / full for full, name in short_names(
        sorted(d.name for d in sweep.iterdir() if (d / ".hydra").is_dir())).items()}


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
    # standard ignores num_blocks: 2 jobs are one run; block with num_blocks=3 cannot be built (fails);
    # a strategy that kills its own process stands for a job killed by the OS
    (tmp_path / "killer.py").write_text(
        "import os, signal\nfrom attnres import StandardResidual\n"
        "class Killer(StandardResidual):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    args = ["-m", *TINY, "residual=standard,block", "num_blocks=2,3", "hydra.sweep.dir=sweep",
            f"hydra.launcher.lock_dir={tmp_path}/locks"]
    first = attnres_run(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    kill = attnres_run("-m", *TINY, "residual._target_=killer.Killer", "seed=5", "hydra.sweep.dir=sweep",
                       f"hydra.launcher.lock_dir={tmp_path}/locks", cwd=tmp_path)
    assert kill.returncode == 0, kill.stderr[-4000:]

    jobs = job_dirs(tmp_path / "sweep")
    ran = {name for name, d in jobs.items() if (d / "metrics.json").exists()}
    notes = json.loads((tmp_path / "sweep" / "jobs.json").read_text())
    assert len(ran) == 4  # standard once, block 2, block 3 (failed), the killed one
    block2 = next(d for n, d in jobs.items() if "num_blocks=2" in n and "residual=block" in n)
    block3 = next(d for n, d in jobs.items() if "num_blocks=3" in n and "residual=block" in n)
    killed = next(d for n, d in jobs.items() if "Killer" in n)
    assert metrics(block2)["status"] == "finished"
    assert metrics(block3)["status"] == "failed" and "valid values: 1, 2, 4" in metrics(block3)["error"]
    assert metrics(killed)["status"] == "failed" and "SIGKILL" in metrics(killed)["error"]
    standard = [d for n, d in jobs.items() if "residual=standard" in n]
    assert sum((d / "metrics.json").exists() for d in standard) == 1, "identical jobs both ran"
    # jobs.json is rewritten by each sweep; the summary below is rebuilt from all folders
    assert not notes or all(n["status"] in ("duplicate", "finished") for n in notes.values())

    first_summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "failed" in first_summary and "finished" in first_summary

    finished_before = (block2 / "metrics.json").stat().st_mtime_ns
    again = attnres_run(*args, "resume=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    notes = json.loads((tmp_path / "sweep" / "jobs.json").read_text())
    assert sum(n.get("skipped", False) for n in notes.values()) == 2  # standard and block N=2 were finished
    assert sum(n["status"] == "duplicate" for n in notes.values()) == 1
    assert (block2 / "metrics.json").stat().st_mtime_ns == finished_before, "a finished job ran again"
    assert metrics(block3)["status"] == "failed"  # the unfinished one ran again (and fails again)
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "duplicate of" in summary and "valid values" in summary


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
