"""The sweep launcher (attnres/sweep/launcher.py, with the planning of attnres/sweep/plan.py):
through the real CLI, identical jobs run once, a failing or killed job leaves the others alone,
resume skips what finished and runs again what did not; in-process, an empty sweep is refused in
one line."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TINY_SWEEP as TINY
from tests.helpers import job_dirs, metrics, run_cli


@pytest.mark.slow
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
    first = run_cli(*args, cwd=tmp_path, timeout=900)
    assert first.returncode == 0, first.stderr[-4000:]
    assert first.stdout.splitlines()[-1] == "sweep: 4 jobs, 3 finished, 1 duplicate -> sweep/summary.md"
    assert "duplicate of" in (tmp_path / "sweep" / "summary.md").read_text()
    bad = ["-m", *TINY, "residual._target_=killer.Killer,killer.Raiser", "seed=5", "hydra.sweep.dir=sweep", lock_dir]
    failing = run_cli(*bad, cwd=tmp_path, timeout=900)
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
    assert not notes  # jobs.json is rewritten by each sweep

    # the summary is the last sweep's jobs (its count line agrees with it), with a note of the
    # earlier sweep's runs in the folder (experiments/summarize.py lists them all)
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "2 jobs: 2 failed." in summary and "3 run(s) of earlier sweeps" in summary, summary

    finished_before = (block2 / "metrics.json").stat().st_mtime_ns
    again = run_cli(*args, "resume=true", cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    notes = json.loads((tmp_path / "sweep" / "jobs.json").read_text())
    assert sum(n.get("skipped", False) for n in notes.values()) == 3  # standard and block N=2, 4 were finished
    assert sum(n["status"] == "duplicate" for n in notes.values()) == 1
    assert (block2 / "metrics.json").stat().st_mtime_ns == finished_before, "a finished job ran again"

    failed_before = (raised / "metrics.json").stat().st_mtime_ns
    retried = run_cli(*bad, "resume=true", cwd=tmp_path, timeout=900)
    assert retried.returncode == 1, retried.stderr[-4000:]
    assert (raised / "metrics.json").stat().st_mtime_ns != failed_before, "an unfinished job did not run again"
    assert metrics(raised)["status"] == "failed" and "boom" in (tmp_path / "sweep" / "summary.md").read_text()


def test_the_launcher_refuses_an_empty_sweep_in_one_line(tmp_path, capsys):
    from omegaconf import OmegaConf

    from attnres.sweep.launcher import ParallelLauncher

    launcher = ParallelLauncher(lock_dir=str(tmp_path / "locks"))
    launcher.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")},
                                                  "overrides": {"task": ["seed=range(0,0)"]}}})
    launcher.hydra_context = object()
    with pytest.raises(SystemExit) as exit_:
        launcher.launch([], initial_job_idx=0)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnres-run: error: the sweep has no jobs: seed=range(0,0)") and "\n" not in err


def test_the_hydra_plugin_shim_is_this_packages_launchers():
    """attnres/sweep/hydra_plugin.py, which the wheel (and an editable install) copies to
    hydra_plugins/attnres_launcher/: its launchers are attnres's, and the installed copy, the one
    Hydra loads, is this file (an editable install copies it: reinstall after editing it)."""
    from pathlib import Path

    from attnres.sweep import hydra_plugin, launcher

    assert issubclass(hydra_plugin.ParallelLauncher, launcher.ParallelLauncher)
    assert hydra_plugin.ParallelLauncher.__doc__ == launcher.ParallelLauncher.__doc__
    slurm = pytest.importorskip("attnres.sweep.slurm", reason="needs the slurm extra (hydra-submitit-launcher)")
    assert issubclass(hydra_plugin.SlurmLauncher, slurm.SlurmLauncher)
    shim = pytest.importorskip("hydra_plugins.attnres_launcher", reason="attnres is not installed")
    assert Path(shim.__file__).read_text() == Path(hydra_plugin.__file__).read_text(), (
        f"{shim.__file__} is not attnres/sweep/hydra_plugin.py: reinstall attnres (pip install -e .)")
