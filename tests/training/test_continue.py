"""A run continues only as the run it is (issue "Trust, round two", items 1, 4 and 5): `resume=true`
or `ckpt_path=` under a config that computes something else is one line naming the keys, exit 2,
and the run's folder is left as it was; `resume=true` on a finished run changes nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from attnres.config.computation import computation, differences, refuse_other_computation
from attnres.config.errors import ConfigError
from tests.helpers import metrics, one_line_error, run_cli, tiny

RUN = tiny("residual=block", "num_blocks=2", steps=4, val_every=2, progress_bar=False)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("continue")
    result = run_cli(*RUN, "hydra.run.dir=R", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _copy(finished: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(finished / "R", tmp_path / "R")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(("change", "named"), [
    ("residual=full", "residual._target_ (attnres.BlockAttentionResidual there, attnres.FullAttentionResidual here)"),
    ("num_blocks=1", "residual.num_blocks (2 there, 1 here)"),
    ("model.dropout=0.1", "model.dropout (0.0 there, 0.1 here)"),
    ("seed=1", "seed (0 there, 1 here)"),
    ("optim.optimizer.lr=0.01", "optim.optimizer.lr (0.003 there, 0.01 here)"),
], ids=["strategy", "num_blocks", "dropout", "seed", "lr"])
def test_resume_under_another_computation_is_refused_and_touches_nothing(finished, tmp_path, change, named):
    root = _copy(finished, tmp_path)
    before = {p.relative_to(root): _digest(p) for p in (root / "R").rglob("*") if p.is_file()}
    result = run_cli(*RUN, change, "hydra.run.dir=R", "resume=true", cwd=root)
    line = one_line_error(result)
    assert "was trained with another config" in line and named in line, line
    after = {p.relative_to(root): _digest(p) for p in (root / "R").rglob("*") if p.is_file()}
    assert after == before, "a refused resume changed the run's folder"


@pytest.mark.slow
def test_ckpt_path_under_another_strategy_is_refused(finished, tmp_path):
    ckpt = finished / "R" / "checkpoints" / "last.ckpt"
    result = run_cli(*RUN, "residual=full", f"ckpt_path={ckpt}", "hydra.run.dir=other", cwd=tmp_path)
    assert "residual._target_" in one_line_error(result)
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_what_does_not_change_the_numbers_may_differ(finished, tmp_path):
    root = _copy(finished, tmp_path)
    result = run_cli(*RUN, "trainer.max_steps=6", "residual.kernel=torch", "trainer.log_every_n_steps=1",
                     "hydra.run.dir=R", "resume=true", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(root / "R")["steps"] == 6


@pytest.mark.slow
def test_resume_on_a_finished_run_changes_nothing(finished, tmp_path):
    root = _copy(finished, tmp_path)
    run = root / "R"
    kept = {name: _digest(run / name) for name in ("checkpoints/last.ckpt", "metrics.json")}
    result = run_cli(*RUN, "hydra.run.dir=R", "resume=true", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds a finished run (step 4 of 4): nothing to do" in result.stdout
    assert {name: _digest(run / name) for name in kept} == kept
    assert "train/loss" in metrics(run)["metrics"]


def test_the_comparison_ignores_what_does_not_compute():
    from omegaconf import OmegaConf

    base = OmegaConf.create({"seed": 0, "model": {"n_layer": 2, "dropout": 0.0}, "residual": {"kernel": "auto"},
                             "data": {"num_workers": 0, "batch_size": 4}, "optim": {"optimizer": {"lr": 1e-3}},
                             "trainer": {"max_steps": 10, "precision": "32-true", "enable_progress_bar": True}})
    other = base.copy()
    other.residual.kernel, other.data.num_workers, other.trainer.max_steps = "torch", 2, 99
    other.trainer.enable_progress_bar, other.optim.optimizer.lr = False, 0.001  # 1e-3 written otherwise
    assert differences(computation(base), computation(other)) == []
    other.model.n_layer = 4
    assert differences(computation(base), computation(other)) == ["model.n_layer"]
    with pytest.raises(ConfigError, match=r"model\.n_layer \(2 there, 4 here\)"):
        refuse_other_computation("x.ckpt", computation(base), computation(other))
    refuse_other_computation("x.ckpt", None, computation(other))  # nothing recorded: nothing to hold it to


def test_a_checkpoint_from_before_model_parametrization_continues_under_standard_only():
    from omegaconf import OmegaConf

    before = {"seed": 0, "model": {"n_layer": 2, "n_embd": 32}}  # recorded before the keys existed
    now = OmegaConf.create({"seed": 0, "model": {"n_layer": 2, "n_embd": 32, "parametrization": "standard",
                                                 "base_width": None, "base_depth": None, "depth_alpha": 1.0}})
    assert differences(computation(OmegaConf.create(before)), computation(now)) == []
    now.model.parametrization = "mup"
    with pytest.raises(ConfigError, match=r"model\.parametrization \(standard there, mup here\)"):
        refuse_other_computation("x.ckpt", computation(OmegaConf.create(before)), computation(now))


def _tree(root: Path) -> dict[Path, str]:
    """Every file's digest, but the lock's: taking it writes the taker's pid (faults.RunLock)."""
    return {p.relative_to(root): _digest(p) for p in root.rglob("*") if p.is_file() and p.name != ".run.lock"}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["overwrite=true"]], ids=["into-a-run", "overwrite"])
def test_a_command_refused_after_hydra_started_leaves_the_folder_byte_for_byte(finished, tmp_path, extra):
    """Hydra writes `.hydra/` and the log before the run's own checks: a refusal there (here a damaged
    `ckpt_path`) puts them back; with `overwrite=true` the previous run is removed only after every
    check passed (it used to be removed first, and the folder with it)."""
    root = _copy(finished, tmp_path)
    garbage = root / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 64)
    before = _tree(root / "R")
    result = run_cli(*RUN, "trainer.max_steps=6", f"ckpt_path={garbage}", "hydra.run.dir=R", *extra, cwd=root)
    line = one_line_error(result)
    assert ("corrupt or not a checkpoint" if extra else "already holds a run") in line, line
    assert _tree(root / "R") == before, "a refused command changed the run's folder"


@pytest.mark.slow
def test_ckpt_path_inside_the_folder_overwrite_clears_is_refused(finished, tmp_path):
    root = _copy(finished, tmp_path)
    before = _tree(root / "R")
    result = run_cli(*RUN, "ckpt_path=R/checkpoints/last.ckpt", "hydra.run.dir=R", "overwrite=true", cwd=root)
    assert "copy it out of the folder first" in one_line_error(result)
    assert _tree(root / "R") == before


@pytest.mark.slow
@pytest.mark.parametrize(("given", "named"), [
    (["residual=full"], "residual._target_ (attnres.BlockAttentionResidual there, attnres.FullAttentionResidual here)"),
    (["num_blocks=4"], "residual.num_blocks (2 there, 4 here)"),
    (["model.n_embd=64"], "model.n_embd (32 there, 64 here)"),
], ids=["strategy", "num_blocks", "width"])
def test_eval_refuses_model_keys_it_would_ignore(finished, tmp_path, given, named):
    """mode=eval/sample score the checkpoint's own model: a command asking for another is refused
    (it used to be answered about the checkpoint's model without a word)."""
    ckpt = finished / "R" / "checkpoints" / "last.ckpt"
    for mode in ("eval", "sample"):
        result = run_cli("mode=" + mode, f"ckpt_path={ckpt}", "data=synthetic", *given, "hydra.run.dir=E", cwd=tmp_path)
        line = one_line_error(result)
        assert f"mode={mode} uses the model and residual strategy" in line and named in line, line
        assert not (tmp_path / "E").exists()


@pytest.mark.slow
def test_eval_accepts_the_checkpoints_own_model_restated(finished, tmp_path):
    ckpt = finished / "R" / "checkpoints" / "last.ckpt"
    result = run_cli("mode=eval", f"ckpt_path={ckpt}", "data=synthetic", "residual=block", "num_blocks=2",
                     "model.n_layer=2", "data.val_batches=2", "hydra.run.dir=E", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "E" / "eval.json").is_file()
