"""Sweeps that share the slot folder all finish (issue "Trust, round two", item 7): a worker holds
its slot for one job, not for its life, so a worker with no job left never blocks another sweep's
waiting worker. Three sweeps of three jobs each, at once, on two slots."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import CLI, TINY, cli_env, metrics


@pytest.mark.slow
def test_three_sweeps_at_once_on_two_slots_all_finish(tmp_path):
    locks = tmp_path / "locks"
    common = [*TINY, "trainer.max_steps=2", "trainer.val_check_interval=2", "seed=0,1,2",
              "hydra.launcher.cpu_jobs=2", f"hydra.launcher.lock_dir={locks}"]
    strategies = {"A": ["residual=standard"], "B": ["residual=block", "num_blocks=2"], "C": ["residual=full"]}
    procs = {name: subprocess.Popen([*CLI, "-m", *common, *extra, f"hydra.sweep.dir={name}"], cwd=tmp_path,
                                    env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, extra in strategies.items()}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=540)
            assert proc.returncode == 0, (name, err[-3000:])
            assert "3 jobs, 3 finished" in out, (name, out[-2000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name in strategies:
        runs = [p.parent for p in (tmp_path / name).glob("*/metrics.json")]
        assert len(runs) == 3 and all(metrics(r)["status"] == "finished" for r in runs)
