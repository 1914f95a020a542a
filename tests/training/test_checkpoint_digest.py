"""Checkpoints carry the SHA-256 of their bytes, written with them and held against them on every
load (resume, ckpt_path, eval, sample): 64 flipped bytes are one line naming the file, exit 2
(issue "Trust, round two", item 3). A kill while a checkpoint replaces the last one never leaves
a record that disagrees with the file in place."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attnres.config.errors import ConfigError
from attnres.training.checkpoints import AtomicCheckpointIO, digest_path, file_digest, load_checkpoint
from tests.helpers import one_line_error, run_cli, small_disk, tiny


def _flip(path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_a_saved_checkpoint_records_its_digest_and_a_flipped_byte_is_refused(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(4096.0)}}, path)
    record = json.loads(digest_path(path).read_text())
    assert record == {"sha256": [file_digest(path)]}
    assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.arange(4096.0))
    _flip(path, 1)
    with pytest.raises(ConfigError, match=r"last\.ckpt is damaged: its bytes differ from the SHA-256"):
        load_checkpoint(path)
    io.remove_checkpoint(path)
    assert not path.exists() and not digest_path(path).exists()


def test_while_a_checkpoint_is_replaced_the_record_matches_either_version(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    old = file_digest(path)
    seen = []
    real_replace = os.replace

    def replace(src, dst):  # the moment a kill would leave either file in place
        seen.append(json.loads(digest_path(path).read_text())["sha256"])
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    io.save_checkpoint({"step": 2}, path)
    new = file_digest(path)
    assert any(old in s and new in s for s in seen), seen  # both listed while the new file takes its place
    assert json.loads(digest_path(path).read_text())["sha256"] == [new]


def test_a_checkpoint_without_a_record_loads(tmp_path):
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, path)
    assert load_checkpoint(path) == {"state_dict": {}}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["resume", "eval"])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, how):
    run = tiny("residual=block", "num_blocks=2", steps=4, val_every=2, progress_bar=False)
    first = run_cli(*run, "hydra.run.dir=R", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "R" / "checkpoints" / "last.ckpt"
    _flip(last)
    if how == "resume":
        result = run_cli(*run, "trainer.max_steps=6", "hydra.run.dir=R", "resume=true", cwd=tmp_path)
    else:
        result = run_cli("mode=eval", f"ckpt_path={last}", "data=synthetic", "data.batch_size=8", "data.val_batches=1",
                         "hydra.run.dir=E", cwd=tmp_path)
    line = one_line_error(result)
    assert "last.ckpt is damaged" in line and "last.ckpt.sha256" in line, line


def test_a_full_disk_in_the_middle_of_a_checkpoint_is_an_oserror_naming_it(tmp_path):
    """torch words a failed write of the file under it as a RuntimeError ("unexpected pos"); the
    runner's one-line disk-full answer needs the OSError, and the previous checkpoint stays."""
    import errno

    disk = tmp_path / "disk"
    with small_disk(disk, "256k"):
        io = AtomicCheckpointIO()
        path = disk / "last.ckpt"
        io.save_checkpoint({"w": torch.zeros(1000)}, path)
        with pytest.raises(OSError) as raised:
            io.save_checkpoint({"w": torch.zeros(200_000)}, path)  # 800 KB: does not fit
        assert raised.value.errno == errno.ENOSPC and str(path) in str(raised.value)
        assert torch.equal(load_checkpoint(path)["w"], torch.zeros(1000))  # the previous one, its record agreeing
        assert not list(disk.glob(".*.tmp"))
