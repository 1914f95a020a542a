"""A run folder written before the runner was split (tests/data/legacy_run, made at commit 6716d6a)
still resumes, evaluates and composes after it: checkpoints name no module, and the `_target_`s of
its saved config that name old module paths are rewritten to the new ones (attnres.config.moved)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from attnres.config.moved import MOVED, update_moved_targets
from tests.helpers import run_cli

LEGACY = Path(__file__).resolve().parents[1] / "data" / "legacy_run"


def _legacy_copy(tmp_path: Path) -> Path:
    run = tmp_path / "legacy_run"
    shutil.copytree(LEGACY, run)
    return run


def _overrides(run: Path) -> list[str]:
    return [str(o) for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")]


def _attnres_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, timeout=300)


def test_its_saved_config_names_old_paths_that_all_resolve_after_the_update():
    cfg = OmegaConf.load(LEGACY / ".hydra" / "config.yaml")
    targets = [n for n in OmegaConf.to_container(cfg).get("callbacks", {}).values() if isinstance(n, dict)]
    assert any(t.get("_target_") in MOVED for t in targets), "the fixture no longer names an old path"
    changed = update_moved_targets(cfg)
    assert "callbacks.progress_bar._target_" in changed and "logger.tensorboard._target_" in changed
    assert "data._target_" in changed  # attnres.training.data left training for attnres.data
    for section in ("callbacks", "logger"):
        for node in cfg[section].values():
            get_class(node._target_)  # raises if a target still names a module that is gone
    assert cfg.data._target_ == "attnres.data.SyntheticDataModule"
    get_class(cfg.data._target_)
    assert update_moved_targets(cfg) == []  # nothing left to rewrite


@pytest.mark.slow
def test_a_checkpoint_written_before_the_move_resumes_after_it(tmp_path):
    run = _legacy_copy(tmp_path)
    assert json.loads((run / "metrics.json").read_text())["steps"] == 4
    out = _attnres_run([*_overrides(run), "trainer.max_steps=6", f"hydra.run.dir={run}", "resume=true"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["steps"] == 6
    assert metrics["resumed_from"].endswith("checkpoints/last.ckpt")


@pytest.mark.slow
def test_its_checkpoint_evaluates_with_its_saved_config(tmp_path):
    run = _legacy_copy(tmp_path)
    out = _attnres_run(["mode=eval", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "data=synthetic",
                        "data.batch_size=2", "data.val_batches=2", f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "model and residual strategy from" in out.stdout + out.stderr
