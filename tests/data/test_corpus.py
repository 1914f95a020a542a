"""Byte corpora (attnres/data/corpus.py): the split by path hash, the cache built
atomically and reused, an interrupted or killed build leaving nothing stale, and corpus errors."""

from __future__ import annotations

import os
import time

import pytest

from attnres.config.errors import ConfigError
from attnres.data import corpus
from attnres.data.corpus import in_validation
from tests.data.conftest import make_corpus, text_module


def test_split_by_path_hash_is_stable_and_complete(corpus_dir, tmp_path):
    def split_of(dm) -> dict[str, str]:
        train, val = (bytes(m) for m in dm.memmaps())
        out = {}
        for f in sorted(corpus_dir.rglob("*.txt")):
            text = f.read_bytes()
            out[f.relative_to(corpus_dir).as_posix()] = "val" if text in val else "train" if text in train else "?"
        return out

    before = split_of(text_module(corpus_dir, tmp_path / "cache"))
    assert set(before.values()) == {"train", "val"}
    assert all((s == "val") == in_validation(rel, 0.3) for rel, s in before.items())
    make_corpus(tmp_path / "more", n=20, first=100)  # add other files under new names
    for f in (tmp_path / "more").rglob("*.txt"):
        f.rename(corpus_dir / f"extra_{f.parent.name}_{f.name}")
    after = split_of(text_module(corpus_dir, tmp_path / "cache"))
    assert all(after[rel] == s for rel, s in before.items())


def test_cache_is_atomic_and_reused(corpus_dir, tmp_path):
    cache = tmp_path / "cache"
    dm = text_module(corpus_dir, cache)
    dm.prepare_data()
    files = sorted(cache.iterdir())
    assert [p.suffix for p in files] == [".u8", ".u8"]  # no temporary file left behind
    assert all(p.stat().st_mode & 0o644 == 0o644 for p in files)  # readable by other jobs
    mtimes = [p.stat().st_mtime_ns for p in files]
    again = text_module(corpus_dir, cache)
    again.prepare_data()
    again.setup("fit")
    assert sorted(cache.iterdir()) == files and [p.stat().st_mtime_ns for p in files] == mtimes
    (corpus_dir / "dir0" / "file000.txt").write_text("changed " * 100)  # a changed corpus rebuilds
    text_module(corpus_dir, cache).prepare_data()
    assert len(list(cache.iterdir())) == 4 and not list(cache.glob("*.tmp"))


def test_interrupted_build_leaves_nothing(corpus_dir, tmp_path, monkeypatch):
    calls = []

    def copy_then_die(src, dst, *args):
        calls.append(src)
        if len(calls) == 5:
            raise KeyboardInterrupt  # as if the job were stopped mid-build
        dst.write(b"partial")
        return True

    monkeypatch.setattr(corpus, "_copy_utf8", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        text_module(corpus_dir, tmp_path / "cache").prepare_data()
    assert list((tmp_path / "cache").iterdir()) == []


def test_killed_build_temps_are_swept_and_live_ones_kept(corpus_dir, tmp_path):
    """SIGKILL skips cleanup: the next build removes temporary files nobody has written to for
    an hour, and leaves a fresh one (another process may be building right now)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    stale, live = cache / ".text-old.abc.tmp", cache / ".text-new.def.tmp"
    for f in (stale, live):
        f.write_bytes(b"partial")
    hours_ago = time.time() - corpus.STALE_TEMP_S - 60
    os.utime(stale, (hours_ago, hours_ago))
    text_module(corpus_dir, cache).prepare_data()
    assert not stale.exists() and live.exists()
    assert len(list(cache.glob("*.u8"))) == 2


def test_corpus_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="no UTF-8 text"):
        text_module(tmp_path / "empty.txt", tmp_path / "cache").setup()
    (tmp_path / "short.txt").write_text("x" * 100)
    with pytest.raises(ConfigError, match="validation split has 30 bytes.*raise data.val_fraction"):
        text_module(tmp_path / "short.txt", tmp_path / "cache").setup()
    with pytest.raises(ConfigError, match="val_fraction"):
        text_module(tmp_path / "short.txt", tmp_path / "cache", val_fraction=1.5)
