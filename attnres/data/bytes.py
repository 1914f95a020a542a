"""Byte-level language modelling: the Python standard library's source, or the user's own text.

Tokens are bytes (vocab 256); the metric is bits per byte. Both modules share one machinery
(`BytesDataModule`): list files, build the memory-mapped uint8 cache once (`corpus.py`), sample
training windows at random offsets that are a pure function of (seed, i), validate on
consecutive windows from the start of the validation split.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from attnres.config.errors import ConfigError
from attnres.data import corpus
from attnres.data.common import TRAIN_STREAM, StreamDataModule, sample_rng

log = logging.getLogger("attnres")


class _Bytes:
    """A uint8 memmap opened lazily, so that datasets pickle cheaply and each worker maps its own."""

    def __init__(self, path: Path) -> None:
        self.path, self._data = path, None

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._data

    def __getstate__(self) -> dict:
        return {"path": self.path, "_data": None}


def _window(data: np.ndarray, offset: int, block_size: int) -> tuple[Tensor, Tensor]:
    chunk = torch.from_numpy(np.array(data[offset : offset + block_size + 1], dtype=np.int64))  # (T + 1,)
    return chunk[:-1], chunk[1:]  # targets are the inputs shifted by one byte


class TrainWindows(Dataset):
    """Item i: the window of T + 1 bytes at an offset drawn from (seed, i)."""

    def __init__(self, path: Path, block_size: int, seed: int) -> None:
        self.bytes, self.block_size, self.seed = _Bytes(path), block_size, seed
        self.num_offsets = os.path.getsize(path) - block_size  # offsets 0 .. size - T - 1

    def __len__(self) -> int:
        return 2**62  # indexed by the global sample number; the sampler decides the range

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        offset = int(sample_rng(TRAIN_STREAM, self.seed, i).integers(self.num_offsets))
        return _window(self.bytes.data, offset, self.block_size)


class ValWindows(Dataset):
    """Item k: bytes [k T, (k + 1) T + 1) of the validation split (consecutive, non-overlapping inputs)."""

    def __init__(self, path: Path, block_size: int, max_windows: int) -> None:
        self.bytes, self.block_size = _Bytes(path), block_size
        self.num_windows = min(max_windows, (os.path.getsize(path) - 1) // block_size)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, k: int) -> tuple[Tensor, Tensor]:
        if not 0 <= k < self.num_windows:
            raise IndexError(k)
        return _window(self.bytes.data, k * self.block_size, self.block_size)


class BytesDataModule(StreamDataModule):
    """A byte corpus split into train and validation by file; subclasses only list the files."""

    vocab_size = 256
    metric = "bpb"
    cache_name = "bytes"
    skipped_level = logging.WARNING  # how loudly to report files that are not UTF-8

    def __init__(
        self,
        *,
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        val_fraction: float = 0.05,
        val_batches: int = 16,
        cache_dir: str | None = None,
        tokens_per_step: int | None = None,
    ) -> None:
        super().__init__(
            block_size=block_size, batch_size=batch_size, num_workers=num_workers, seed=seed, val_batches=val_batches,
            tokens_per_step=tokens_per_step,
        )
        self.token_bytes = torch.ones(256, dtype=torch.int64)  # a token is one byte
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction!r} must lie in (0, 1); set e.g. data.val_fraction=0.05")
        self.val_fraction = val_fraction
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else corpus.default_cache_dir()
        self.train_path: Path | None = None
        self.val_path: Path | None = None

    # -- subclasses -------------------------------------------------------------------------------
    def list_files(self) -> tuple[str, list[corpus.SourceFile]]:
        """(root, files sorted by relative path)."""
        raise NotImplementedError

    def describe(self) -> str:
        """How error messages name the corpus."""
        raise NotImplementedError

    # -- building ---------------------------------------------------------------------------------
    def build_cache(self) -> tuple[Path, Path]:
        root, files = self.list_files()
        return corpus.build_cache(root, files, self.val_fraction, self.cache_dir, self.cache_name, self.skipped_level)

    def prepare_data(self) -> None:
        self.build_cache()

    def setup(self, stage: str | None = None) -> None:
        if self.train_path is None:
            self._split()
        if stage == "fit":
            self.say_passes()

    def say_passes(self) -> None:
        """Say how many times the run reads the training text, when more than once (a 181 kB file is read
        17 times over by the default 1,500 steps of 16 x 128 bytes): a loss that then falls may be memory."""
        trainer = getattr(self, "trainer", None)
        steps = getattr(trainer, "max_steps", None)
        if self.train_path is None or not isinstance(steps, int) or steps < 1:
            return
        read = steps * trainer.accumulate_grad_batches * self.batch_size * self.block_size * trainer.world_size
        size = self.train_path.stat().st_size
        if read > size:
            log.warning(f"{self.describe()}: {steps:,} steps of {self.batch_size} x {self.block_size} bytes read its "
                        f"{size:,} training bytes {read / size:.1f} times over; more text (or fewer trainer.max_steps) "
                        "makes each byte seen once")

    def _split(self) -> None:
        train_path, val_path = self.build_cache()  # a no-op when prepare_data built it
        train_size, val_size = train_path.stat().st_size, val_path.stat().st_size
        need = self.block_size + 1
        if train_size + val_size == 0:
            raise ConfigError(f"{self.describe()} holds no UTF-8 text (empty or not UTF-8); point it at UTF-8 text")
        if train_size < need:
            raise ConfigError(
                f"{self.describe()}: the train split has {train_size} bytes, fewer than block_size+1={need}; "
                "lower data.block_size or data.val_fraction, or add text"
            )
        if val_size < need:
            raise ConfigError(
                f"{self.describe()}: the validation split has {val_size} bytes, fewer than block_size+1={need}; "
                f"raise data.val_fraction (now {self.val_fraction}) or lower data.block_size"
            )
        self.train_path, self.val_path = train_path, val_path

    def train_dataset(self) -> TrainWindows:
        self.setup()
        return TrainWindows(self.train_path, self.block_size, self.seed)

    def val_dataset(self) -> ValWindows:
        self.setup()
        return ValWindows(self.val_path, self.block_size, self.val_batches * self.batch_size)

    def memmaps(self) -> tuple[np.ndarray, np.ndarray]:
        """The (train, val) bytes, memory-mapped read-only."""
        self.setup()
        return _Bytes(self.train_path).data, _Bytes(self.val_path).data

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (mode=sample's prompt): its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def unigram_bits_per_byte(self) -> float:
        """Baseline: val bits per byte of an add-one smoothed byte-frequency model fit on train."""
        return corpus.unigram_bits_per_byte(*self.memmaps())


class StdlibBytesDataModule(BytesDataModule):
    """Every `*.py` file of this Python's standard library (tests included, site-packages not)."""

    cache_name = "stdlib"
    skipped_level = logging.INFO  # a handful of stdlib test files are deliberately not UTF-8

    def __init__(
        self,
        *,
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        val_fraction: float = 0.05,
        val_batches: int = 16,
        cache_dir: str | None = None,
        max_files: int | None = None,
        tokens_per_step: int | None = None,
    ) -> None:
        super().__init__(
            block_size=block_size, batch_size=batch_size, num_workers=num_workers, seed=seed,
            val_fraction=val_fraction, val_batches=val_batches, cache_dir=cache_dir, tokens_per_step=tokens_per_step,
        )
        if max_files is not None and max_files < 1:
            raise ConfigError(f"data.max_files={max_files!r} must be >= 1; set data.max_files=null for all files")
        self.max_files = max_files  # keep the first files in sorted order (tests); None = all

    def list_files(self) -> tuple[str, list[corpus.SourceFile]]:
        root = sysconfig.get_paths()["stdlib"]
        files = corpus.walk_files(root, ".py", frozenset({"site-packages", "dist-packages", "__pycache__"}))
        return root, files[: self.max_files]

    def describe(self) -> str:
        return f"the stdlib at {sysconfig.get_paths()['stdlib']!r}"


class TextBytesDataModule(BytesDataModule):
    """The user's UTF-8 text: `path` is a file, a folder (read recursively) or a glob (`**` recurses).

    Files that are not UTF-8 are skipped with a warning, hidden files and folders are ignored.
    """

    cache_name = "text"

    def __init__(
        self,
        *,
        path: str | None = None,
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        val_fraction: float = 0.05,
        val_batches: int = 16,
        cache_dir: str | None = None,
        tokens_per_step: int | None = None,
    ) -> None:
        super().__init__(
            block_size=block_size, batch_size=batch_size, num_workers=num_workers, seed=seed,
            val_fraction=val_fraction, val_batches=val_batches, cache_dir=cache_dir, tokens_per_step=tokens_per_step,
        )
        if not path:
            raise ConfigError("data.path is not set; set data.path=<file, folder or glob> to your UTF-8 text")
        self.path = os.path.expanduser(os.path.expandvars(str(path)))
        self.list_files()  # fail now, before the model is built, if nothing matches

    def list_files(self) -> tuple[str, list[corpus.SourceFile]]:
        if os.path.isfile(self.path):
            root = os.path.dirname(os.path.abspath(self.path))
            files = [corpus.stat_file(root, self.path)]
        elif os.path.isdir(self.path):
            root, files = self.path, corpus.walk_files(self.path)
        else:
            root, files = corpus.glob_files(self.path)
        if not files:
            raise ConfigError(
                f"data.path={self.path!r} matches no file; set data.path=<file, folder or glob> to your UTF-8 text"
            )
        return root, files

    def describe(self) -> str:
        return f"data.path={self.path!r}"
