"""`stop_at_step` (issue 49 item 6, a cheaper fair search): a run paused at a step and resumed to
its end is the run that never paused: the same final val/loss and parameters; a resume that asks
for no more steps says "nothing to do"; a pause at or past `trainer.max_steps` is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tests.helpers import metrics, one_line_error, run_cli, tiny

# a schedule with warmup and decay, so a pause that restarted the schedule would show in the numbers
RUN = tiny("residual=block", "num_blocks=2", "residual.kernel=torch", "optim.schedule.warmup_steps=2", steps=8,
           val_every=2, progress_bar=False)


def _params(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("straight")
    result = run_cli(*RUN, "hydra.run.dir=S", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "S"


@pytest.mark.slow
@pytest.mark.parametrize("pause", [3, 4], ids=["between-validations", "at-a-validation"])
def test_a_run_paused_and_resumed_is_the_run_that_never_paused(straight, tmp_path, pause):
    paused = run_cli(*RUN, f"stop_at_step={pause}", "hydra.run.dir=P", cwd=tmp_path)
    assert paused.returncode == 0, paused.stderr[-3000:]
    record = metrics(tmp_path / "P")
    assert (record["status"], record["stopped_by"], record["steps"]) == ("finished", "stop_at_step", pause)
    assert "val/loss" in record["metrics"]  # validated at the pause, even between validation steps
    resumed = run_cli(*RUN, "hydra.run.dir=P", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    end = metrics(tmp_path / "P")
    assert (end["stopped_by"], end["steps"]) == ("trainer.max_steps", 8)
    assert end["metrics"]["val/loss"] == pytest.approx(metrics(straight)["metrics"]["val/loss"], rel=1e-6, abs=1e-7)
    want, got = _params(straight), _params(tmp_path / "P")
    assert want.keys() == got.keys()
    for name, value in want.items():  # float32, one process each: the same arithmetic in the same order
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_a_resume_that_asks_for_no_more_steps_changes_nothing(tmp_path):
    assert run_cli(*RUN, "stop_at_step=4", "hydra.run.dir=P", cwd=tmp_path).returncode == 0
    kept = {n: hashlib.sha256((tmp_path / "P" / n).read_bytes()).hexdigest()
            for n in ("checkpoints/last.ckpt", "metrics.json")}
    for stop in (4, 2):
        again = run_cli(*RUN, f"stop_at_step={stop}", "hydra.run.dir=P", "resume=true", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "paused at step 4 of 8: nothing to do" in again.stdout
    assert kept == {n: hashlib.sha256((tmp_path / "P" / n).read_bytes()).hexdigest() for n in kept}
    # a later pause continues it to that step, in the same folder (stop_at_step names no folder)
    later = run_cli(*RUN, "stop_at_step=6", "hydra.run.dir=P", "resume=true", cwd=tmp_path)
    assert later.returncode == 0, later.stderr[-3000:]
    assert metrics(tmp_path / "P")["steps"] == 6


@pytest.mark.slow
@pytest.mark.parametrize(("value", "named"), [
    ("8", "stop_at_step=8 is not below trainer.max_steps=8"),
    ("0", "stop_at_step=0 is out of range"),
    ("half", "stop_at_step=half is not an integer"),
])
def test_a_pause_outside_the_run_is_refused_in_one_line(tmp_path, value, named):
    line = one_line_error(run_cli(*RUN, f"stop_at_step={value}", "hydra.run.dir=P", cwd=tmp_path))
    assert named in line, line
    assert not (tmp_path / "P" / "metrics.json").exists()


def test_the_pause_names_no_folder_and_no_computation():
    from omegaconf import OmegaConf

    from attnres.config.computation import computation
    from tests.helpers import CONF

    root = OmegaConf.load(CONF / "config.yaml")
    assert "stop_at_step" in root.hydra.job.config.override_dirname.exclude_keys
    assert root.stop_at_step is None
    assert not any(k.startswith("stop_at_step") for k in computation(OmegaConf.create({**root, "stop_at_step": 5})))

