"""A full disk as a sweep ends (issue "Trust, round two", item 9): one line, the jobs' results kept,
exit 2; the same command with resume=true writes the summary."""

from __future__ import annotations

import pytest

from tests.helpers import faultinject_env, run_cli, small_disk, tiny


@pytest.mark.slow
def test_a_full_disk_as_the_sweep_ends_keeps_the_jobs_and_resume_writes_the_summary(tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk, "20m"):
        sweep = ["-m", *tiny(steps=2, val_every=2), "seed=0,1", f"hydra.sweep.dir={disk}/sweep",
                 f"hydra.launcher.lock_dir={tmp_path}/locks"]
        fill = ["+hydra.callbacks.fill._target_=faultinject.FillDiskAtSweepEnd",
                f"+hydra.callbacks.fill.path={disk}/fill"]
        result = run_cli(*sweep, *fill, cwd=tmp_path, env=faultinject_env())
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run:")]
        assert len(lines) == 1 and "disk full writing the sweep's summary" in lines[0], result.stderr[-3000:]
        assert "resume=true" in lines[0] and "sweep: 2 jobs, 2 finished -> no summary" in result.stdout
        assert not (disk / "sweep" / "summary.md").exists()
        assert len(list((disk / "sweep").glob("*/checkpoints/last.ckpt"))) == 2
        (disk / "fill").unlink()
        again = run_cli(*sweep, "resume=true", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "0 to run" in again.stdout and (disk / "sweep" / "summary.md").is_file(), again.stdout[-2000:]


@pytest.mark.slow
def test_a_disk_that_fills_as_the_last_job_ends_gives_one_line_and_resume_writes_the_summary(tmp_path):
    """Issue "Trust, round three", item 6: the disk fills after the job's own files are written and
    before the sweep records how it ended (slot.json): one line naming resume=true, exit 2, no traceback."""
    disk = tmp_path / "disk"
    with small_disk(disk, "20m"):
        sweep = ["-m", *tiny(steps=2, val_every=2), "seed=0", f"hydra.sweep.dir={disk}/sweep",
                 f"hydra.launcher.lock_dir={tmp_path}/locks"]
        fill = ["+callbacks.fill._target_=faultinject.FillDiskAtExit", f"+callbacks.fill.path={disk}/fill"]
        result = run_cli(*sweep, *fill, cwd=tmp_path, env=faultinject_env())
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
        lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run:")]
        assert len(lines) == 1 and "resume=true" in lines[0], result.stderr[-3000:]
        (disk / "fill").unlink()
        again = run_cli(*sweep, "resume=true", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert (disk / "sweep" / "summary.md").is_file(), again.stdout[-2000:]
        assert "1 finished" in again.stdout, again.stdout[-2000:]
