"""Data modules: determinism, resumability, targets, splits, the byte cache, errors, baselines."""

from __future__ import annotations

import math
import os
import sysconfig
import time
from collections import Counter
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from attnres.config.errors import ConfigError
from attnres.training.data import (
    StdlibBytesDataModule,
    SyntheticDataModule,
    TextBytesDataModule,
    corpus,
    exact_match,
)
from attnres.training.data.corpus import in_validation


# -- helpers -------------------------------------------------------------------------------------
def make_corpus(root: Path, n: int = 40, size: int = 300, first: int = 0) -> Path:
    """`n` small UTF-8 files in nested folders, each with distinctive content."""
    for k in range(first, first + n):
        f = root / f"dir{k % 3}" / f"file{k:03d}.txt"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"<{k:03d}>" + "".join(chr(97 + (k * 7 + j * j) % 26) for j in range(size)) + "é\n")
    return root


def text_module(path, cache: Path, **kw) -> TextBytesDataModule:
    kw = {"block_size": 32, "batch_size": 4, "val_batches": 2, "val_fraction": 0.3, **kw}
    return TextBytesDataModule(path=str(path), cache_dir=str(cache), **kw)


def batches(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(islice(iter(loader), n))


def same(a, b) -> bool:
    pairs = zip(a, b, strict=True) if len(a) == len(b) else []
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in pairs)


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return make_corpus(tmp_path / "corpus")


@pytest.fixture
def text_dm(corpus_dir: Path, tmp_path: Path) -> TextBytesDataModule:
    dm = text_module(corpus_dir, tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    return dm


def synthetic_module(**kw) -> SyntheticDataModule:
    return SyntheticDataModule(**{"batch_size": 8, "val_batches": 2, **kw})


# -- the shared contract -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "synthetic"])
def test_attributes_right_after_init(kind, corpus_dir, tmp_path):
    dm = text_module(corpus_dir, tmp_path / "cache") if kind == "text" else synthetic_module()
    assert (dm.vocab_size, dm.metric) == ((256, "bpb") if kind == "text" else (19, "accuracy"))
    assert not (tmp_path / "cache").exists()  # nothing built before prepare_data / setup


@pytest.mark.parametrize("kind", ["text", "synthetic"])
def test_batches_shape_dtype_and_seed(kind, corpus_dir, tmp_path):
    def make(seed):
        if kind == "text":
            return text_module(corpus_dir, tmp_path / "cache", seed=seed)
        return synthetic_module(seed=seed)

    first = batches(make(0).train_dataloader(), 3)
    inputs, targets = first[0]
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (first[0][0].shape[0], make(0).block_size)
    assert same(first, batches(make(0).train_dataloader(), 3))
    assert not same(first, batches(make(1).train_dataloader(), 3))


@pytest.mark.parametrize("kind", ["text", "synthetic"])
def test_resume_starts_at_the_global_sample(kind, corpus_dir, tmp_path):
    dm = text_module(corpus_dir, tmp_path / "cache") if kind == "text" else synthetic_module()
    uninterrupted = batches(dm.train_dataloader(), 8)
    dm.trainer = SimpleNamespace(global_step=3, accumulate_grad_batches=2)  # 6 batches consumed
    assert dm.start_sample() == 6 * dm.batch_size
    assert same(batches(dm.train_dataloader(), 2), uninterrupted[6:8])


def test_stream_does_not_depend_on_worker_count(text_dm):
    serial = batches(text_dm.train_dataloader(), 4)
    text_dm.num_workers = 2
    loader = text_dm.train_dataloader()
    assert loader.multiprocessing_context is not None and loader.persistent_workers
    assert same(batches(loader, 4), serial)


def test_ranks_split_one_stream(text_dm):
    serial = list(text_dm.train_dataset()[i][0] for i in range(8))
    for rank in range(2):
        text_dm.trainer = SimpleNamespace(global_step=1, accumulate_grad_batches=1, world_size=2, global_rank=rank)
        (inputs, _), = batches(text_dm.train_dataloader(), 1)
        start = 1 * text_dm.batch_size * 2  # one step of two ranks already seen
        expected = torch.stack([text_dm.train_dataset()[start + rank + 2 * j][0] for j in range(text_dm.batch_size)])
        assert torch.equal(inputs, expected)
    assert len(serial) == 8


class _Recorder(pl.LightningModule):
    """Sees batches, records the first input token of each, learns nothing of interest."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, :4].flatten().tolist())
        return (self.weight * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(max_steps: int, root: Path, ckpt: str | None = None) -> list[list[int]]:
    model = _Recorder()
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True)])
    trainer.fit(model, datamodule=synthetic_module(), ckpt_path=ckpt)
    return model.seen


@pytest.mark.filterwarnings("ignore:.*no `validation_step`", "ignore:.*LeafSpec", "ignore:Checkpoint directory")
def test_lightning_resume_sees_the_uninterrupted_batches(tmp_path):
    full = _fit(5, tmp_path / "full")
    _fit(3, tmp_path / "part")
    resumed = _fit(5, tmp_path / "part", ckpt=str(tmp_path / "part" / "last.ckpt"))
    assert len(full) == 10 and resumed == full[6:]


@pytest.mark.parametrize("kind", ["text", "synthetic"])
def test_val_loader_is_fixed_and_bounded(kind, corpus_dir, tmp_path):
    dm = text_module(corpus_dir, tmp_path / "cache") if kind == "text" else synthetic_module()
    dm.setup("fit")
    first = list(dm.val_dataloader())
    assert len(first) == dm.val_batches and same(first, list(dm.val_dataloader()))
    dm.seed = 5  # validation does not move with the training seed
    assert same(first, list(dm.val_dataloader()))
    probe = dm.probe_batch(3)
    assert torch.equal(probe[0], first[0][0][:3]) and torch.equal(probe[1], first[0][1][:3])


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


def test_corpus_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="no UTF-8 text"):
        text_module(tmp_path / "empty.txt", tmp_path / "cache").setup()
    (tmp_path / "short.txt").write_text("x" * 100)
    with pytest.raises(ConfigError, match="validation split has 30 bytes.*raise data.val_fraction"):
        text_module(tmp_path / "short.txt", tmp_path / "cache").setup()
    with pytest.raises(ConfigError, match="val_fraction"):
        text_module(tmp_path / "short.txt", tmp_path / "cache", val_fraction=1.5)


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
def follow_chains(inputs: list[int], dm: SyntheticDataModule) -> list[int]:
    """Recompute every answer from the input tokens alone (keys are s, values S + s)."""
    S, P, H = dm.num_symbols, dm.num_pairs, dm.num_hops
    f = dict(zip(inputs[1 : 2 * P : 2], inputs[0 : 2 * P : 2], strict=True))  # listed as "f(k) k"
    assert len(f) == P and all(k < S <= v < 2 * S for k, v in f.items())
    answers = []
    for q in range(dm.num_queries):
        at = 2 * P + q * (1 + H)
        assert inputs[at] == 2 * S + 1 and inputs[at + 2 : at + 1 + H] == [2 * S + 2] * (H - 1)  # QUERY x_0 ANS..
        x = inputs[at + 1]
        for _ in range(H):
            answers.append(f[x])
            x = f[x] - S
    return answers


@pytest.mark.parametrize(
    ("num_symbols", "num_pairs", "num_queries", "num_hops"),
    [(8, None, 4, 2), (16, 16, 1, 3), (12, 6, 6, 1), (5, 5, 2, 7)],
    ids=["S8-P8-Q4-H2", "S16-P16-Q1-H3", "S12-P6-Q6-H1", "S5-P5-Q2-H7-wraps"],
)
def test_synthetic_answers_follow_from_inputs(num_symbols, num_pairs, num_queries, num_hops):
    P = num_pairs or num_symbols
    dm = synthetic_module(num_symbols=num_symbols, num_pairs=num_pairs, num_queries=num_queries, num_hops=num_hops,
                          block_size=2 * P + num_queries * (1 + num_hops) + 3)
    assert dm.vocab_size == 2 * num_symbols + 3
    inputs, targets = next(iter(dm.train_dataloader()))
    for x, y in zip(inputs.tolist(), targets.tolist(), strict=True):
        assert [t for t in y if t != -100] == follow_chains(x, dm)
        scored = [k for k, t in enumerate(y) if t != -100]
        assert not set(scored) & set(range(2 * P))  # nothing scored inside the pairs
        assert x[-3:] == [2 * num_symbols] * 3  # PAD to block_size
        assert max(x) < dm.vocab_size


def test_synthetic_answers_are_not_in_the_inputs_after_the_pairs():
    dm = synthetic_module()
    inputs, targets = dm.val_dataset()[0]
    after = inputs[2 * dm.num_pairs :]
    assert not ((after >= dm.num_symbols) & (after < 2 * dm.num_symbols)).any()  # no value token: no teacher forcing
    assert (targets != -100).sum() == dm.num_queries * dm.num_hops


def test_synthetic_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"set data.block_size>=40"):
        SyntheticDataModule(block_size=39, batch_size=4)
    with pytest.raises(ConfigError, match="num_pairs"):
        SyntheticDataModule(block_size=64, batch_size=4, num_symbols=8, num_pairs=9)
    with pytest.raises(ConfigError, match="num_queries"):
        SyntheticDataModule(block_size=64, batch_size=4, num_symbols=4, num_queries=5)
    assert SyntheticDataModule().block_size == 40 and SyntheticDataModule().num_queries == 8


def test_exact_match_counts_whole_answers():
    # row 0: answers [1:3) right and [4:5) wrong; row 1: [0:2) right; row 2: nothing scored
    targets = torch.tensor([[-100, 2, 1, -100, 0], [1, 1, -100, -100, -100], [-100] * 5])
    predicted = torch.tensor([[0, 2, 1, 0, 2], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    logits = torch.nn.functional.one_hot(predicted, 3).float()
    assert exact_match(logits, targets).item() == pytest.approx(2 / 3)
    assert exact_match(logits[:1, 1:3], targets[:1, 1:3]).item() == 1.0
    assert exact_match(logits[2:], targets[2:]).isnan()
    assert SyntheticDataModule.exact_match is exact_match


def test_exact_match_on_a_perfect_and_a_blind_model():
    dm = synthetic_module(num_hops=3, block_size=48)
    inputs, targets = next(iter(dm.val_dataloader()))
    perfect = torch.nn.functional.one_hot(targets.clamp(min=0), dm.vocab_size).float()
    assert exact_match(perfect, targets).item() == 1.0
    blind = torch.zeros(*targets.shape, dm.vocab_size)
    blind[..., dm.num_symbols] = 1.0  # always the same value token
    assert exact_match(blind, targets).item() < 0.05
