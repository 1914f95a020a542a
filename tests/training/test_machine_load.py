"""The machine's load while a run trains (attnres/training/machine_load.py), for metrics.json: sampled
at the start of the fit, every `every_s` seconds during it and at its end, with the machine's cores."""

from __future__ import annotations

import functools
import itertools
import os
import types

import pytest
import pytorch_lightning as pl
import torch

from attnres.data import SyntheticDataModule
from attnres.model import Transformer
from attnres.training import lit, machine_load
from attnres.training.machine_load import MachineLoad


@pytest.mark.usefixtures("torch_single_thread")
def test_the_load_is_sampled_at_the_start_during_and_at_the_end(monkeypatch):
    loads = itertools.count(1.0)  # each sample reads the next load: 1.0, 2.0, ...
    monkeypatch.setattr(machine_load.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    clock = itertools.count(0.0, 4.0)  # each reading of the clock is 4 s later
    monkeypatch.setattr(machine_load, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    torch.manual_seed(0)
    data = SyntheticDataModule(batch_size=2, val_batches=1, num_hops=1)
    model = Transformer(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=40)
    module = lit.LitLanguageModel(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), metric="accuracy")
    load = MachineLoad(every_s=10.0)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[load])
    trainer.fit(module, datamodule=data)
    record = load.record()
    # the clock moves 4 s at each reading (the fit's start and end, each step's end): 10 s have passed
    # at the end of steps 3 and 6
    assert record["cpu_count"] == os.cpu_count()
    assert [s for s, _ in record["samples_1min"]] == [0.0, 12.0, 24.0, 28.0]  # start, 2 during, end
    assert [v for _, v in record["samples_1min"]] == [1.0, 2.0, 3.0, 4.0]
    assert record["mean_1min"] == pytest.approx(2.5) and record["max_1min"] == 4.0


def test_no_load_average_gives_no_record(monkeypatch):
    def missing():
        raise OSError("no load average here")

    monkeypatch.setattr(machine_load.os, "getloadavg", missing)
    load = MachineLoad()
    load.sample()
    assert load.record() is None
