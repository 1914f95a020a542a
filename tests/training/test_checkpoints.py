"""Checkpoints (attnres/training/checkpoints.py): which one a run continues from (or its refusal
to clobber a run), a checkpoint for another model or none at all refused in one line, atomic
writes; through the CLI, a resumed run equals an uninterrupted one bit for bit."""

from __future__ import annotations

import pytest
import torch

from attnres.config.errors import ConfigError
from attnres.model import Transformer
from attnres.training.checkpoints import (
    AtomicCheckpointIO,
    check_checkpoint,
    describe_checkpoint,
    resume_checkpoint,
)
from attnres.training.faults import RunRefused
from attnres.training.lit import LitLanguageModel
from tests.helpers import TINY, check_exact_resume, one_line_error, run_cli


def _module(n_embd: int = 16) -> LitLanguageModel:
    return LitLanguageModel(Transformer(vocab_size=32, n_layer=1, n_head=2, n_embd=n_embd, block_size=8),
                            optimizer=torch.optim.SGD, metric="loss")


def test_which_checkpoint_a_run_continues_from(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert resume_checkpoint(run, resume=False, ckpt_path=None, overwrite=False) is None  # a fresh folder
    assert resume_checkpoint(run, resume=True, ckpt_path=None, overwrite=False) is None  # nothing yet: from scratch
    (run / "checkpoints").mkdir()
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(b"x")
    assert resume_checkpoint(run, resume=True, ckpt_path=None, overwrite=False) == str(last)
    with pytest.raises(RunRefused, match="already holds a run .*resume=true .*overwrite=true"):
        resume_checkpoint(run, resume=False, ckpt_path=None, overwrite=False)
    with pytest.raises(ConfigError, match="contradict"):
        resume_checkpoint(run, resume=True, ckpt_path=None, overwrite=True)
    with pytest.raises(ConfigError, match="is not a file"):
        resume_checkpoint(run, resume=False, ckpt_path=str(tmp_path / "nope.ckpt"), overwrite=False)
    assert resume_checkpoint(run, resume=False, ckpt_path=str(last), overwrite=False) == str(last)
    assert resume_checkpoint(run, resume=False, ckpt_path=None, overwrite=True) is None
    assert last.exists()  # overwrite clears the old run in `train`, once every check has passed
    other = tmp_path / "other.ckpt"
    other.write_bytes(b"x")
    with pytest.raises(RunRefused, match="already holds a run; ckpt_path=.* would train over it"):
        resume_checkpoint(run, resume=False, ckpt_path=str(other), overwrite=False)
    with pytest.raises(ConfigError, match="copy it out of the folder first"):
        resume_checkpoint(run, resume=False, ckpt_path=str(last), overwrite=True)
    last.unlink()
    (run / "metrics.json").write_text('{"status": "finished"}')
    with pytest.raises(ConfigError, match="finished run .* has no checkpoints/last.ckpt"):
        resume_checkpoint(run, resume=True, ckpt_path=None, overwrite=False)


def test_resume_on_a_new_folder_starts_quietly_and_on_a_stopped_start_says_so(tmp_path, caplog):
    """A sweep run with resume=true starts its new jobs without a warning each; a run stopped
    before its first checkpoint (its events file written) is warned about."""
    import logging

    new, stopped, logged = tmp_path / "new", tmp_path / "stopped", tmp_path / "logged"
    for folder in (new, stopped, logged):
        folder.mkdir()
    (new / "attnres.log").write_text("[2026-12-03 19:49:21,115][attnres.sweep.job][INFO] - job 0 on slot cpu0\n")
    (stopped / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    (logged / "attnres.log").write_text(f"[2026-12-03 19:49:24,564][attnres][INFO] - run folder: {logged}\n")
    with caplog.at_level(logging.INFO, logger="attnres"):
        for folder in (new, stopped, logged):
            assert resume_checkpoint(folder, resume=True, ckpt_path=None, overwrite=False) is None
    said = [(r.levelname, "no checkpoint yet" in r.getMessage()) for r in caplog.records]
    assert said == [("INFO", False), ("WARNING", True), ("WARNING", True)], caplog.records


def test_a_checkpoint_of_another_model_or_none_is_refused_in_one_line(tmp_path):
    module = _module()
    good, garbage, other = tmp_path / "good.ckpt", tmp_path / "garbage.ckpt", tmp_path / "other.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": module.state_dict(), "global_step": 7}, good)
    assert [p.name for p in tmp_path.glob("*.ckpt")] == ["good.ckpt"] and not list(tmp_path.glob("*.tmp"))
    check_checkpoint(str(good), module)
    assert describe_checkpoint(good) == f"{good} (step 7)"
    assert describe_checkpoint(tmp_path / "none.ckpt") == "no checkpoint yet"
    garbage.write_bytes(b"not a checkpoint")
    AtomicCheckpointIO().save_checkpoint({"state_dict": _module(n_embd=32).state_dict()}, other)
    for path, words in ((garbage, "is corrupt or not a checkpoint"), (other, "does not match this model")):
        with pytest.raises(ConfigError, match=words) as err:
            check_checkpoint(str(path), module)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(TypeError):
        AtomicCheckpointIO().save_checkpoint({}, good, storage_options={})


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
    common = [*TINY, "residual=block", "num_blocks=2", "trainer.val_check_interval=4", "optim.total_steps=8",
              "optim.schedule.warmup_steps=2"]
    check_exact_resume(tmp_path, common)


@pytest.mark.slow
def test_bad_checkpoints(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    line = one_line_error(run_cli(*TINY, f"ckpt_path={garbage}", cwd=tmp_path))
    assert str(garbage) in line and "corrupt" in line
    trained = run_cli(*TINY, "trainer.max_steps=1", "hydra.run.dir=small", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = tmp_path / "small/checkpoints/last.ckpt"
    line = one_line_error(run_cli(*TINY, "model.n_embd=64", f"ckpt_path={ckpt}", cwd=tmp_path))
    # the run's saved config says which key differs before the weights would (check_checkpoint's
    # "does not match this model", for a checkpoint without its run's config, is tested above)
    assert str(ckpt) in line and "was trained with another config: model.n_embd (32 there, 64 here)" in line
    again = run_cli(*TINY, "trainer.max_steps=1", "hydra.run.dir=small", cwd=tmp_path)
    assert "already holds a run" in one_line_error(again)
