"""Throughput in metrics.json (attnres/training/lit.py counts, report.throughput words): tokens/s
after each process's first THROUGHPUT_WARMUP steps, none for a run too short to measure, and
tokens/s over every step as before. The step times come from a clock the test drives (slow first
steps, as a kernel build or compilation makes them), so the expected figures are exact."""

from __future__ import annotations

import functools
import types

import pytest
import pytorch_lightning as pl
import torch

from attnres.data import SyntheticDataModule
from attnres.model import Transformer
from attnres.training import lit
from attnres.training.report import throughput

BATCH, LENGTH = 4, 40  # the synthetic module's sequence: 40 tokens
SLOW, FAST = 100.0, 1.0  # seconds a warm-up step and a later step take on the test's clock


class StepClock:
    """lit's `time`: perf_counter is read at each batch's start and end; batch k takes SLOW
    seconds for k < slow_steps, FAST after."""

    def __init__(self, slow_steps: int) -> None:
        self.slow_steps, self.calls, self.now = slow_steps, 0, 1000.0

    def perf_counter(self) -> float:
        batch, end = divmod(self.calls, 2)
        self.calls += 1
        if end:
            self.now += SLOW if batch < self.slow_steps else FAST
        return self.now


def fit(steps: int, slow_steps: int, monkeypatch: pytest.MonkeyPatch) -> lit.LitLanguageModel:
    monkeypatch.setattr(lit, "time", types.SimpleNamespace(perf_counter=StepClock(slow_steps).perf_counter))
    torch.manual_seed(0)
    data = SyntheticDataModule(batch_size=BATCH, val_batches=1, num_hops=1)
    model = Transformer(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=LENGTH)
    module = lit.LitLanguageModel(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), metric="accuracy")
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == steps
    return module


@pytest.mark.usefixtures("torch_single_thread")
def test_tokens_per_sec_leaves_out_the_warm_up_steps(monkeypatch):
    steps, slow = lit.THROUGHPUT_WARMUP + lit.THROUGHPUT_MIN_STEPS + 5, 3
    out = throughput(fit(steps, slow, monkeypatch))
    tokens = BATCH * LENGTH
    assert out["tokens_per_sec_after_warmup"] == pytest.approx(tokens / FAST)  # every measured step took FAST s
    assert out["tokens_per_sec"] == pytest.approx(steps * tokens / (slow * SLOW + (steps - slow) * FAST))
    assert out["throughput_steps"] == steps - lit.THROUGHPUT_WARMUP
    assert out["throughput_warmup_steps"] == lit.THROUGHPUT_WARMUP
    assert out["mfu"] is None and out["mfu_after_warmup"] is None  # CPU


@pytest.mark.usefixtures("torch_single_thread")
def test_a_run_too_short_to_measure_after_warm_up_has_no_tokens_per_sec_after_warmup(monkeypatch):
    steps = lit.THROUGHPUT_WARMUP + lit.THROUGHPUT_MIN_STEPS - 1
    out = throughput(fit(steps, 3, monkeypatch))
    assert out["tokens_per_sec_after_warmup"] is None and out["mfu_after_warmup"] is None
    assert out["throughput_steps"] == lit.THROUGHPUT_MIN_STEPS - 1
    assert out["tokens_per_sec"] == pytest.approx(steps * BATCH * LENGTH / (3 * SLOW + (steps - 3) * FAST))
