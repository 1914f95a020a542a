"""What a run prints is the run's own: Lightning's advice to run every process under `srun`, given
wherever SLURM is installed, is wrong for attnres (its SLURM launcher places its own jobs) and is
not shown (issue "Trust, round two", item 11)."""

from __future__ import annotations

import os
import stat

import pytest

from tests.helpers import TINY, run_cli


@pytest.mark.slow
def test_no_srun_advice_where_slurm_is_installed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"  # what Lightning looks for on PATH
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        env[key] = ""  # not inside a SLURM job
    result = run_cli(*TINY, "trainer.max_steps=2", "trainer.val_check_interval=2", "hydra.run.dir=r", cwd=tmp_path,
                     env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "The `srun` command is available" not in result.stdout + result.stderr


@pytest.mark.slow
def test_how_a_run_ended_is_said_once(tmp_path):
    """The closing line of a run that stopped on purpose goes to stderr once (and to attnres.log),
    not also through the terminal's log handler (SIGTERM's message was printed twice)."""
    from tests.helpers import faultinject_env

    result = run_cli(*TINY, "trainer.max_steps=5", "hydra.run.dir=run", "+callbacks.fault._target_=faultinject.NaNAt",
                     "+callbacks.fault.step=2", cwd=tmp_path, env=faultinject_env())
    assert result.returncode == 1, result.stderr[-3000:]
    said = (result.stdout + result.stderr).count("non-finite loss at step 2;")
    assert said == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "non-finite loss at step 2" in (tmp_path / "run/attnres.log").read_text()


@pytest.mark.slow
def test_a_second_ctrl_c_still_says_how_the_run_ended(tmp_path):
    """The second signal stops at once, yet the run leaves its closing line and metrics.json, naming
    the last checkpoint (it used to die of the signal with neither)."""
    import json

    from tests.helpers import faultinject_env

    fault = ["+callbacks.fault._target_=faultinject.KillAt", "+callbacks.fault.step=5", "+callbacks.fault.sig=INT",
             "+callbacks.fault.times=2"]
    result = run_cli(*TINY, "trainer.max_steps=50", "trainer.val_check_interval=2", "hydra.run.dir=run", *fault,
                     cwd=tmp_path, env=faultinject_env())
    assert result.returncode == 130, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run:")]
    assert len(lines) == 1 and "stopped at once by a second SIGINT at step 5" in lines[0], result.stderr[-3000:]
    assert "kept: " in lines[0] and "(step 4)" in lines[0], lines[0]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["step"] == 5, metrics
