"""Byte-level language modelling (attnres/data/bytes.py): targets are the inputs shifted by
one, single files split by position, globs and non-UTF-8 files, the unigram baseline, path errors,
and the stdlib corpus."""

from __future__ import annotations

import math
import sysconfig
import time
from collections import Counter

import numpy as np
import pytest
import torch

from attnres.config.errors import ConfigError
from attnres.data import (
    StdlibBytesDataModule,
    TextBytesDataModule,
)
from tests.data.conftest import batches, text_module


# -- byte-level LM -------------------------------------------------------------------------------
def test_lm_targets_are_inputs_shifted_by_one(text_dm):
    train, val = text_dm.memmaps()
    assert isinstance(train, np.memmap) and isinstance(val, np.memmap)
    assert isinstance(text_dm.train_dataset().bytes.data, np.memmap)
    for inputs, targets in batches(text_dm.train_dataloader(), 2) + list(text_dm.val_dataloader()):
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        assert (targets >= 0).all() and (targets < 256).all()
    # validation: consecutive windows from the start of the split
    inputs = torch.cat([x for x, _ in text_dm.val_dataloader()]).flatten()
    assert inputs.tolist() == val[: len(inputs)].tolist()


def test_single_file_splits_by_position(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(f"line {k} of the only file\n" for k in range(200)))
    dm = text_module(f, tmp_path / "cache", val_fraction=0.1)
    train, val = dm.memmaps()
    assert bytes(train) + bytes(val) == f.read_bytes()
    assert len(val) == round(f.stat().st_size * 0.1)


def test_glob_and_non_utf8_files(corpus_dir, tmp_path, caplog):
    (corpus_dir / "dir0" / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (corpus_dir / "dir0" / "blob.bin").write_bytes(bytes(range(256)) * 4)
    dm = text_module(str(corpus_dir / "**" / "*.txt"), tmp_path / "cache")
    with caplog.at_level("WARNING"):
        train, val = dm.memmaps()
    assert "latin1.txt" in caplog.text
    everything = bytes(train) + bytes(val)
    assert b"caf\xe9" not in everything and bytes(range(256)) not in everything
    assert (corpus_dir / "dir1" / "file001.txt").read_bytes() in everything


def test_unigram_baseline_matches_an_independent_computation(corpus_dir, tmp_path):
    dm = text_module(corpus_dir, tmp_path / "cache")
    train, val = (bytes(m) for m in dm.memmaps())
    counts = Counter(train)
    expected = -sum(math.log2((counts[b] + 1) / (len(train) + 256)) for b in val) / len(val)
    assert dm.unigram_bits_per_byte() == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("path", "needle"),
    [(None, "data.path is not set"), ("", "data.path is not set"), ("/no/such/dir", "'/no/such/dir' matches no file"),
     ("/no/such/*.txt", "'/no/such/*.txt' matches no file")],
    ids=["none", "empty", "missing", "glob-matches-nothing"],
)
def test_text_path_errors(path, needle, tmp_path):
    with pytest.raises(ConfigError, match="set data.path") as err:
        TextBytesDataModule(path=path, cache_dir=str(tmp_path))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_stdlib_corpus(tmp_path):
    dm = StdlibBytesDataModule(block_size=64, batch_size=4, val_batches=2, cache_dir=str(tmp_path))
    t0 = time.perf_counter()
    dm.prepare_data()
    assert time.perf_counter() - t0 < 20
    root, files = dm.list_files()
    assert root == sysconfig.get_paths()["stdlib"] and len(files) > 100
    assert not any("site-packages" in f.rel for f in files) and all(f.rel.endswith(".py") for f in files)
    assert [f.rel for f in files] == sorted(f.rel for f in files)
    train, val = dm.memmaps()
    assert len(train) > 10 * len(val) > 0
    assert 4.0 < dm.unigram_bits_per_byte() < 6.0  # a byte-frequency model of Python source
    assert StdlibBytesDataModule(max_files=50, block_size=64, batch_size=4).list_files()[1] == files[:50]


# -- synthetic pointer chasing -------------------------------------------------------------------




def test_a_run_that_reads_its_text_more_than_once_says_so(tmp_path, caplog):
    """Issue "The first hour, round two", item 8: data=text on a 181 kB file was read 17 times over
    by the default 1,500 steps without a word."""
    from types import SimpleNamespace

    path = tmp_path / "small.txt"
    path.write_text("a small corpus line\n" * 500, encoding="utf-8")  # 10,000 bytes
    dm = text_module(path, tmp_path / "cache", val_fraction=0.5)  # one file: split within it
    dm.trainer = SimpleNamespace(max_steps=1500, accumulate_grad_batches=1, world_size=1)
    with caplog.at_level("WARNING", logger="attnres"):
        dm.setup("fit")
    size = dm.train_path.stat().st_size
    said = [r.getMessage() for r in caplog.records if "times over" in r.getMessage()]
    assert said == [f"data.path={str(path)!r}: 1,500 steps of 4 x 32 bytes read its {size:,} training bytes "
                    f"{1500 * 4 * 32 / size:.1f} times over; more text (or fewer trainer.max_steps) makes each byte "
                    "seen once"], said
    caplog.clear()
    dm.trainer = SimpleNamespace(max_steps=2, accumulate_grad_batches=1, world_size=1)
    with caplog.at_level("WARNING", logger="attnres"):
        dm.setup("fit")
    assert not [r for r in caplog.records if "times over" in r.getMessage()]
