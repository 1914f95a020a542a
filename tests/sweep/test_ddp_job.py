"""A sweep job's own process is `python -m attnres.sweep.job SPEC` and calls `training.run.train`
directly, so Lightning's DDP launcher can start the job's other ranks the same way. Before the
short way (a `python -c` child re-entering the command line) the second rank looked for a file
named `attnres-run` in the working folder and the job failed."""

from __future__ import annotations

import pytest

from tests.helpers import TINY, metrics, run_cli


@pytest.mark.slow
def test_a_sweep_job_trains_with_ddp_on_two_cpu_processes(tmp_path):
    result = run_cli("-m", *TINY, "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer=ddp",
                     "trainer.accelerator=cpu", "trainer.devices=2", "seed=0", "hydra.sweep.dir=sweep",
                     "hydra.launcher.cpu_jobs=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (job,) = [p.parent for p in (tmp_path / "sweep").glob("*/metrics.json")]
    summary = metrics(job)
    assert summary["status"] == "finished" and summary["steps"] == 3, (job / "train.log").read_text()[-3000:]
    assert summary["tokens_seen"] == 3 * 2 * 8 * 40  # steps x processes x batch x block_size
    # the validation numbers are reduced over ranks by hand: no advice to let Lightning average them
    assert "sync_dist" not in (job / "train.log").read_text()
