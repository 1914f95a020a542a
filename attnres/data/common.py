"""What every data module shares: the sample stream, the loaders, the probe batch.

A training sample is a pure function of `(seed, i)`, where `i` counts samples over the whole
run. The train loader walks `i = start, start + 1, ...` with `start` taken from the trainer's
`global_step`, so a run resumed from a checkpoint sees exactly the batches an uninterrupted run
would, whatever the epoch or the number of workers. Validation is a fixed, bounded list.

The contract every data module keeps: it is built from keyword arguments (Hydra `_target_`),
knows `vocab_size` and `metric` right after `__init__`, yields `(inputs, targets)` int64 batches
(B, T) with -100 where nothing is scored, draws training sample i from (seed, i) alone
(resumable by step), and validates on a fixed, bounded set. Text modules also know `token_bytes`,
the UTF-8 bytes of each token, so that `val/bpb` is bits per byte of text whatever the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from attnres.config.errors import ConfigError

# One "epoch" is this many samples: long enough that `max_steps` always ends training first.
EPOCH_SAMPLES = 2**31

# Stream tags keep the train and validation random streams apart (SeedSequence entropy).
TRAIN_STREAM, VAL_STREAM = 0, 1


def sample_rng(stream: int, seed: int, i: int) -> np.random.Generator:
    """The generator for sample `i` of a stream: depends on (stream, seed, i) and nothing else."""
    return np.random.default_rng(np.random.SeedSequence([stream, seed, i]))


class StreamSampler(DistributedSampler):
    """Indices `start + rank, start + rank + world_size, ...`, `num_samples` of them.

    A `DistributedSampler` only so that Lightning leaves it alone under DDP (it would otherwise
    wrap it and materialise the whole index list); the ranks split the one global stream.
    """

    def __init__(self, start: int, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.start, self.num_samples = start, num_samples
        self.rank, self.num_replicas = rank, world_size
        self.epoch, self.seed, self.shuffle, self.drop_last = 0, 0, False, False  # read by Lightning / torch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start + self.rank, self.start + self.num_samples * self.num_replicas, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class StepResumableLoader(DataLoader):
    """The train loader. Resumable without state of its own: `train_dataloader()` derives its
    start from the trainer's restored `global_step`. The (empty) `state_dict` tells Lightning so,
    instead of its warning that a mid-epoch checkpoint cannot be resumed exactly."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def check_common(block_size: int, batch_size: int, num_workers: int, seed: int, val_batches: int) -> None:
    """Raise ConfigError for the knobs every data module has."""
    for name, value, low in (
        ("block_size", block_size, 1),
        ("batch_size", batch_size, 1),
        ("num_workers", num_workers, 0),
        ("seed", seed, 0),
        ("val_batches", val_batches, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"data.{name}={value!r} is invalid; set data.{name} to an integer >= {low}")


class StreamDataModule(pl.LightningDataModule):
    """Base class: subclasses provide `train_dataset()` and `val_dataset()` after `setup()`.

    `train_dataset()[i]` must be a pure function of (seed, i); `val_dataset()` is fixed and holds
    at most `val_batches * batch_size` examples. Items are `(inputs, targets)`, int64, each (T,).
    """

    vocab_size: int
    metric: str
    #: UTF-8 bytes of each token id (V,), int64, for bits per byte; None when unknown
    token_bytes: Tensor | None = None

    def __init__(self, *, block_size: int, batch_size: int, num_workers: int, seed: int, val_batches: int,
                 tokens_per_step: int | None = None) -> None:
        super().__init__()
        check_common(block_size, batch_size, num_workers, seed, val_batches)
        if tokens_per_step is not None and (not isinstance(tokens_per_step, int) or isinstance(tokens_per_step, bool)
                                            or tokens_per_step < 1):
            raise ConfigError(f"data.tokens_per_step={tokens_per_step!r} must be a positive integer (tokens per "
                              "optimiser step, all devices) or null for one micro-batch per device")
        self.block_size, self.batch_size, self.num_workers = block_size, batch_size, num_workers
        self.seed, self.val_batches, self.tokens_per_step = seed, val_batches, tokens_per_step
        self.accumulation(world_size=1)  # now, before a run starts; the device count is checked at fit

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimiser step that make `tokens_per_step` (1 when it is not set)."""
        if self.tokens_per_step is None:
            return 1
        micro = self.batch_size * self.block_size * world_size
        if self.tokens_per_step % micro:
            raise ConfigError(
                f"data.tokens_per_step={self.tokens_per_step} is not a multiple of batch_size x block_size x devices "
                f"= {self.batch_size} x {self.block_size} x {world_size} = {micro}; set it to a multiple "
                f"(e.g. {max(1, round(self.tokens_per_step / micro)) * micro}) or change data.batch_size")
        return self.tokens_per_step // micro

    # -- subclasses -------------------------------------------------------------------------------
    def train_dataset(self) -> Dataset:
        raise NotImplementedError

    def val_dataset(self) -> Dataset:
        raise NotImplementedError

    # -- loaders ----------------------------------------------------------------------------------
    def start_sample(self) -> int:
        """The global index of the first sample this run still has to see (0 when not resuming)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        world_size = getattr(trainer, "world_size", 1)
        return trainer.global_step * trainer.accumulate_grad_batches * self.batch_size * world_size

    def _loader(self, dataset: Dataset, sampler: Any, loader_class: type[DataLoader] = DataLoader) -> DataLoader:
        workers = self.num_workers > 0
        return loader_class(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            # workers started inside joblib/loky job processes need fork (and it shares the memmaps)
            multiprocessing_context="fork" if workers else None,
            persistent_workers=workers,
        )

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        rank, world_size = getattr(trainer, "global_rank", 0), getattr(trainer, "world_size", 1)
        per_rank = EPOCH_SAMPLES // world_size // self.batch_size * self.batch_size
        sampler = StreamSampler(self.start_sample(), per_rank, rank, world_size)
        return self._loader(self.train_dataset(), sampler, StepResumableLoader)

    def val_dataloader(self) -> DataLoader:
        dataset = self.val_dataset()
        return self._loader(dataset, range(len(dataset)))

    def probe_batch(self, n: int = 8) -> tuple[Tensor, Tensor]:
        """A fixed batch: the first `n` validation examples, `(inputs, targets)` each (n, T)."""
        dataset = self.val_dataset()
        if not 1 <= n <= len(dataset):
            raise ConfigError(f"probe_batch(n={n}) needs 1..{len(dataset)} validation examples; lower n")
        inputs, targets = zip(*(dataset[k] for k in range(n)), strict=True)
        return torch.stack(inputs), torch.stack(targets)
