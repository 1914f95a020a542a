"""The sweep's Hydra callback (attnres/sweep/callback.py), in-process: it locks the sweep folder
when the sweep starts (another process is refused, naming this one), writes the summary with its
verdicts when it ends, and refuses a sweep that ran no job in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from attnres.sweep.callback import SweepSummary
from tests.helpers import cli_env
from tests.results.test_verdict import _job


def _config(sweep) -> OmegaConf:
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": ["seed=0,1,2"]}}})


def test_the_callback_locks_the_folder_then_writes_the_summary(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    callback = SweepSummary()
    callback.on_multirun_start(_config(sweep))
    code = ("import sys; from pathlib import Path; from attnres.sweep.slots import lock_sweep_dir; "
            "lock_sweep_dir(Path(sys.argv[1]))")
    other = subprocess.run([sys.executable, "-c", code, str(sweep)], capture_output=True, text=True, timeout=120,
                           env=cli_env())
    assert other.returncode != 0 and f"another sweep (pid {os.getpid()}) is running into {sweep}" in other.stderr
    for seed, bpb in enumerate((2.0, 2.1, 2.2)):
        _job(sweep / f"standard-{seed}", "standard", seed, bpb, num_blocks=2)
        _job(sweep / f"block-{seed}", "block", seed, bpb - 0.05 - 0.01 * seed)
    callback.on_multirun_end(_config(sweep))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"sweep: 6 jobs, 6 finished -> {sweep / 'summary.md'}", out[-3:]
    verdict = next(line for line in out if line.startswith("verdict: "))
    assert verdict.startswith("verdict: block N=4 vs standard: better by at least the margin, -0.0600 val/bpb"), verdict
    assert verdict.removeprefix("verdict: ") in (sweep / "summary.md").read_text()
    assert len((sweep / "summary.csv").read_text().splitlines()) == 7
    assert (sweep / "summary.png").stat().st_size > 10_000  # summary_figure.py: the differences drawn


def test_a_sweep_that_ran_no_job_is_refused_in_one_line(tmp_path, capsys):
    sweep = tmp_path / "empty"
    sweep.mkdir()
    with pytest.raises(SystemExit) as stop:
        SweepSummary().on_multirun_end(_config(sweep))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnres-run: error: the sweep has no jobs") and "\n" not in err
