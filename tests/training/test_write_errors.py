"""Writes the disk or the folder refuses (issue "Trust, round two", item 9): each is one line naming
the file and what was kept, exit 2, never a traceback or a screen of logging errors."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.helpers import CLI, cli_env, faultinject_env, run_cli, small_disk, tiny

RUN = tiny("residual=block", "num_blocks=2", steps=40, val_every=5, progress_bar=False)


def _user_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("attnres-run:")]


@pytest.mark.slow
@pytest.mark.parametrize(("error", "said"), [("EACCES", "Permission denied"), ("EROFS", "Read-only file system")])
def test_a_folder_made_unwritable_mid_run_is_one_line(tmp_path, error, said):
    fault = ["+callbacks.fault._target_=faultinject.DiskFullAt", "+callbacks.fault.step=7",
             f"+callbacks.fault.error={error}"]
    result = run_cli(*RUN, "hydra.run.dir=run", *fault, cwd=tmp_path, env=faultinject_env())
    assert result.returncode == 2, result.stderr[-3000:]
    lines = _user_lines(result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"cannot write {tmp_path / 'run'}" in lines[0] and said in lines[0], lines[0]
    assert "kept:" in lines[0] and "step 5" in lines[0] and "writable again" in lines[0], lines[0]


@pytest.mark.slow
def test_a_full_disk_before_the_start_is_one_line_and_writes_nothing(tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk, "256k"):
        with open(disk / "fill", "wb") as f, pytest.raises(OSError):
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        result = run_cli(*RUN, f"hydra.run.dir={disk}/run", cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-3000:]
        lines = _user_lines(result.stderr)
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "No space left on device" in lines[0] and "free some space" in lines[0], lines[0]
        assert sorted(p.name for p in disk.iterdir()) == ["fill"]


@pytest.mark.slow
def test_a_disk_filled_mid_run_is_one_warning_and_one_error(tmp_path):
    """The log file cannot be written either: one warning, not a traceback per log message."""
    disk = tmp_path / "disk"
    with small_disk(disk, "20m"):
        proc = subprocess.Popen([*CLI, *RUN, "trainer.max_steps=100000", f"hydra.run.dir={disk}/run"], cwd=tmp_path,
                                env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        last = disk / "run/checkpoints/last.ckpt"
        while not last.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        with open(disk / "fill", "wb") as f, pytest.raises(OSError):  # another program fills the disk
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr and "Logging error" not in stderr, stderr[-3000:]
        lines = _user_lines(stderr)
        assert len(lines) <= 2 and lines[-1].startswith("attnres-run: error: disk full writing"), stderr[-3000:]
        assert all(line.startswith("attnres-run: warning: cannot write the log file") for line in lines[:-1]), lines
