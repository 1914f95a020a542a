"""The contract every data module keeps (attnres/data/common.py), on the byte-level and the
synthetic modules: attributes right after init, batches by seed, resume at the global sample, one
stream whatever the workers or ranks, a fixed and bounded validation set."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.data.conftest import batches, fit_recording, same, synthetic_module, text_module


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


def _fit(max_steps: int, root: Path, ckpt: str | None = None) -> list[list[int]]:
    return fit_recording(synthetic_module, max_steps, root, ckpt)


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
