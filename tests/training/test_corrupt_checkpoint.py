"""A truncated or empty checkpoint is one line (exit 2) in every mode, as training already said
(issue "Trust, round two", item 10: mode=eval and mode=sample printed a 21-line traceback)."""

from __future__ import annotations

import pytest

from tests.helpers import one_line_error, run_cli

LEGACY_CKPT = "tests/data/legacy_run/checkpoints/last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eval", "sample", "train"])
@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_checkpoint_is_one_line_in_every_mode(tmp_path, mode, damage):
    from tests.helpers import REPO

    good = (REPO / LEGACY_CKPT).read_bytes()
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(good[: len(good) // 2] if damage == "truncated" else b"")
    result = run_cli(f"mode={mode}", f"ckpt_path={bad}", "data=synthetic", "data.batch_size=2", "data.val_batches=1",
                     "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "trainer.max_steps=2",
                     "trainer.enable_progress_bar=false", "logger=none", "hydra.run.dir=out", cwd=tmp_path)
    line = one_line_error(result)
    assert f"checkpoint {bad} is corrupt or not a checkpoint" in line, line
    assert not (tmp_path / "out").exists(), "a refused command left a folder"
