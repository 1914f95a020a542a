"""A sweep job's own process (attnres/sweep/job.py `run_child_job`), in-process: a job that fails
is recorded in its metrics.json (status and error) and returns 1, never raising; a job whose folder
holds another run is refused and leaves that run's metrics alone. The whole path through real sweeps:
test_launcher.py and test_sweep_faults.py."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from attnres.sweep.job import run_child_job
from tests.helpers import CONF, TINY_SWEEP


def _spec(tmp_path, run_dir, *overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY_SWEEP, "keep_freed_memory=false", *overrides])
    GlobalHydra.instance().clear()
    spec = tmp_path / f"{run_dir.name}.json"
    spec.write_text(json.dumps({"run_dir": str(run_dir), "config": OmegaConf.to_container(cfg),
                                "info": {"slot": "cpu0", "overrides": list(overrides), "threads": 1}}))
    return spec


def test_a_failing_job_is_recorded_not_raised(tmp_path, monkeypatch, capsys):
    (tmp_path / "strategies.py").write_text(
        "from attnres import StandardResidual\n"
        "class Raiser(StandardResidual):\n"
        "    def __init__(self, *args, **kwargs):\n        raise RuntimeError('boom: this strategy always fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "failing"
    run_dir.mkdir()
    assert run_child_job(_spec(tmp_path, run_dir, "residual._target_=strategies.Raiser")) == 1
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "RuntimeError: boom: this strategy always fails"
    assert summary["slot"] == "cpu0" and summary["overrides"] == ["residual._target_=strategies.Raiser"]


def test_a_job_whose_folder_holds_another_run_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text('{"status": "finished", "steps": 7}')
    assert run_child_job(_spec(tmp_path, run_dir)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert json.loads((run_dir / "metrics.json").read_text()) == {"status": "finished", "steps": 7}
