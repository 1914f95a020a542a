"""What the data modules' tests share: a small corpus of nested files, the byte-level module on it,
the synthetic module, batch comparisons, and a Lightning fit that records the batches it sees."""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from attnres.data import SyntheticDataModule, TextBytesDataModule


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


class BatchRecorder(pl.LightningModule):
    """Sees batches, records the first input tokens of each, learns nothing of interest."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, :4].flatten().tolist())
        return (self.weight * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_recording(datamodule: Callable[[], pl.LightningDataModule], max_steps: int, out: Path,
                  ckpt: str | None = None) -> list[list[int]]:
    """The batches a Lightning fit of `max_steps` (2 batches a step) sees, checkpointing into `out`,
    from `ckpt` when given: what a resume must see again."""
    model = BatchRecorder()
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, default_root_dir=out, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out, save_last=True)])
    trainer.fit(model, datamodule=datamodule(), ckpt_path=ckpt)
    return model.seen
