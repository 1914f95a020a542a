"""What a run shows while it trains (attnres/training/progress.py) and how long it may train
(`trainer.max_time`): the plain lines where a bar cannot draw (a pseudo-terminal of 0 columns,
as `script`, some `docker run -t` and CI runners give), one rate (the training rate), an
estimate of the run's length, and a time limit that a resumed run keeps. Issue "The first hour,
round two", items 1 and 2."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading
from pathlib import Path

import pytest

from attnres.training.progress import bar_can_draw, duration
from tests.helpers import CLI, cli_env, metrics, one_line_error, run_cli, tiny


def _pty(columns: int) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) whose window is `columns` wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, slave


@pytest.mark.parametrize("columns, draws", [(0, False), (100, True)])
def test_a_bar_draws_only_on_a_terminal_with_a_width(columns, draws):
    master, slave = _pty(columns)
    try:
        with os.fdopen(os.dup(slave), "w") as stream:
            assert stream.isatty()  # isatty() alone said "draw" for both
            assert bar_can_draw(stream) is draws
    finally:
        os.close(master)
        os.close(slave)


def test_a_pipe_gets_no_bar(tmp_path):
    with open(tmp_path / "log", "w") as stream:
        assert not bar_can_draw(stream)


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (42.4, 1120, 3900)] == ["42 s", "18m 40s", "1h 05m"]


def _run_on_pty(args: list[str], cwd: Path, columns: int) -> tuple[int, str]:
    master, slave = _pty(columns)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the slave side closed: the run ended
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.Popen([*CLI, *args], cwd=cwd, env=cli_env(), stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave)
    os.close(slave)
    code = proc.wait(timeout=600)
    reader.join(timeout=30)
    os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_a_terminal_without_a_width_gets_the_plain_lines_with_one_rate_and_an_estimate(tmp_path):
    """Under `script` the bar drew nothing for 18 minutes and the plain lines were off."""
    code, out = _run_on_pty(tiny(steps=30, val_every=10, progress_bar=True), tmp_path, columns=0)
    assert code == 0, out[-3000:]
    assert "step 1/30  " in out and "validation at step 10/30  " in out, out[-3000:]
    assert "\r" not in out.replace("\r\n", "\n"), "a bar's carriage returns on a terminal without a width"
    estimate = next(line for line in out.splitlines() if "estimate: 30 steps at " in line)
    assert " tokens/s (its first 10 steps): about " in estimate and " left" in estimate
    rates = [line.split("tokens/s ")[1].split()[0] for line in out.splitlines() if "  tokens/s " in line]
    assert rates and all(r.replace(",", "").isdigit() for r in rates), rates  # plain digits, the training rate
    assert "perf/tokens_per_sec" not in out  # one step's rate, which read 2,335 beside a validation
    summary = metrics(next(tmp_path.glob("outputs/default/*")))
    assert f"{summary['tokens_per_sec']:,.0f} tokens/s" in out  # the end block's rate, the last line's


@pytest.mark.slow
def test_max_time_ends_a_run_says_so_and_a_resume_keeps_the_limit(tmp_path):
    args = tiny(steps=100000, val_every=50, progress_bar=False)
    first = run_cli(*args, "trainer.max_time=00:00:00:02", "hydra.run.dir=R", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = metrics(tmp_path / "R")
    assert summary["status"] == "finished" and summary["stopped_by"] == "trainer.max_time"
    assert 0 < summary["steps"] < 100000 and summary["validation_step"] == summary["steps"]
    assert f"(trainer.max_time=00:00:00:02 ended it at step {summary['steps']})" in first.stdout, first.stdout[-2000:]
    again = run_cli(*args, "trainer.max_time=00:00:00:02", "resume=true", "hydra.run.dir=R", cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout[-2000:]
    assert metrics(tmp_path / "R")["steps"] == summary["steps"]
    longer = run_cli(*args, "trainer.max_time=00:00:00:04", "resume=true", "hydra.run.dir=R", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    resumed = metrics(tmp_path / "R")
    assert resumed["stopped_by"] == "trainer.max_time" and resumed["steps"] > summary["steps"]
    assert resumed["resumed_from"], resumed


def test_a_max_time_that_is_not_a_time_is_refused_in_one_line(tmp_path):
    from attnres.config.errors import ConfigError
    from attnres.training.run import time_limit_s

    assert time_limit_s("00:01:30:00") == 5400 and time_limit_s(None) is None
    for bad in ("30m", "00:00:00:00", "00:25:00:00", 1800):
        with pytest.raises(ConfigError, match="DD:HH:MM:SS"):
            time_limit_s(bad)


@pytest.mark.slow
def test_a_bad_max_time_is_refused_before_any_work(tmp_path):
    line = one_line_error(run_cli(*tiny(steps=2), "trainer.max_time=30m", "hydra.run.dir=R", cwd=tmp_path))
    assert "trainer.max_time=30m is not a time; write DD:HH:MM:SS" in line
    assert not (tmp_path / "R" / "metrics.json").exists()
