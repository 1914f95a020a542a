"""The Lightning module: optimisation, metrics and logging around any `attnres.Transformer`."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from attnres.config.errors import ConfigError
from attnres.data import exact_match
from attnres.training.faults import NonFiniteLoss, at_last_step
from attnres.training.optimizers import parameter_groups  # noqa: F401 (lit.parameter_groups, as before)

log = logging.getLogger("attnres")
NONFINITE_POLICIES = ("stop", "skip", "rollback")

LN2 = math.log(2.0)
#: throughput after warm-up (metrics.json's tokens_per_sec_after_warmup, report.throughput) leaves out each
#: process's first THROUGHPUT_WARMUP optimiser steps (the C++ kernel's first build, torch.compile, allocator warm-up)
THROUGHPUT_WARMUP, THROUGHPUT_MIN_STEPS = 10, 10  # ... and needs THROUGHPUT_MIN_STEPS after them
METRICS = ("bpb", "accuracy", "loss")

#: dense bf16 peak FLOP/s per GPU by device-name fragment, for model FLOPs utilisation (vendor data
#: sheets, without sparsity); ATTNRES_PEAK_FLOPS=<FLOP/s> overrides, e.g. for another precision
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
                   "A10": 125e12, "4090": 165e12, "3090": 71e12, "V100": 125e12}


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one `device` (None on CPU or for an unknown GPU)."""
    if os.environ.get("ATTNRES_PEAK_FLOPS"):
        return float(os.environ["ATTNRES_PEAK_FLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token, forward and backward: 6 (N + V D) + 12 n_layer T D, where N is the
    non-embedding parameter count and V D the LM head's matrix product (Kaplan et al. 2020, table 1;
    the attention term as in PaLM, Chowdhery et al. 2022, appendix B). None for other models."""
    if not hasattr(model, "num_parameters") or not hasattr(model, "embed"):
        return None
    vocab, width = model.embed.weight.shape
    return 6.0 * (model.num_parameters(exclude_embedding=True) + vocab * width) + 12.0 * model.n_layer * seq_len * width


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed of the random numbers (dropout) used by training step `step` on `rank`: a pure
    function of its arguments, so a resumed run draws what an uninterrupted one would."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:8], "little") >> 1


def rng_states() -> dict[str, Any]:
    """Every global random state a run touches (saved in checkpoints)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    # plain numbers and tensors only: Lightning loads checkpoints with torch.load(weights_only=True)
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                              "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


class LitLanguageModel(pl.LightningModule):
    """Trains `model` (idx, targets -> {"logits", "loss"}) on `(inputs, targets)` batches.

    `optimizer` is a partial optimiser (Hydra `_partial_: true`) taking parameter groups;
    `schedule` a partial `step -> multiplier` taking `total_steps` (default: the trainer's
    `max_steps`). `metric` is "bpb" (bits per byte) or "accuracy" (exact match).

    Random numbers (dropout) of step k come from `step_seed(seed, k, rank)`, so a resumed run is
    bit-identical to an uninterrupted one. A non-finite loss or gradient norm is handled by
    `nonfinite["policy"]`: "stop" (raise `NonFiniteLoss` before the optimiser step), "skip" (drop
    the step) or "rollback" (reload the weights and optimiser state of `rollback_checkpoint`,
    scale the learning rate by `lr_factor`, and go on with the next batches); "skip" and
    "rollback" stop after `max_in_a_row` bad steps in a row and "rollback" after `max_rollbacks`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        schedule: Callable[..., float] | None = None,
        query_lr_scale: float = 0.1,
        total_steps: int | None = None,
        compile: bool = False,
        metric: str = "bpb",
        seed: int = 0,
        nonfinite: dict[str, Any] | None = None,
        rollback_checkpoint: str | Path | None = None,
    ) -> None:
        super().__init__()
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
        self.nonfinite = {"policy": "stop", "max_in_a_row": 10, "lr_factor": 0.5, "max_rollbacks": 3,
                          **(nonfinite or {})}
        if self.nonfinite["policy"] not in NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite.policy={self.nonfinite['policy']!r} is not one of "
                              f"{', '.join(NONFINITE_POLICIES)}; set nonfinite.policy=stop")
        self.seed, self.rollback_checkpoint = seed, rollback_checkpoint
        self.skipped_steps, self.rollbacks, self._bad_in_a_row = 0, 0, 0  # the first two are checkpointed
        self.last_validation_step: int | None = None
        self.model = model
        self.optimizer_factory, self.schedule_factory = optimizer, schedule
        self.query_lr_scale, self.total_steps, self.metric = query_lr_scale, total_steps, metric
        # kept out of the module tree so checkpoints hold one copy of the weights under `model.`
        self.__dict__["forward_fn"] = torch.compile(model) if compile else model
        self.tokens_seen = 0  # over the whole run, restored on resume
        self.run_config: dict[str, Any] | None = None  # what the run computes, recorded in checkpoints
        self.session_tokens, self.session_train_s = 0, 0.0  # this process only: for throughput
        self.steady_tokens, self.steady_train_s = 0, 0.0  # the same after warm-up (THROUGHPUT_WARMUP)
        self.session_start_step: int | None = None
        self._warm = False
        self._step_start: float | None = None
        self._val_sums: dict[str, float] = {}
        self._token_bytes: Tensor | None = None
        self._flops_per_token: float | None = None

    def setup(self, stage: str) -> None:
        """Gradient accumulation from the data's `tokens_per_step` (a global batch in tokens)."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and getattr(datamodule, "tokens_per_step", None) is not None:
            steps = datamodule.accumulation(self.trainer.world_size)
            if self.trainer.accumulate_grad_batches not in (1, steps):
                raise ConfigError(
                    f"data.tokens_per_step={datamodule.tokens_per_step} sets gradient accumulation to {steps}, but "
                    f"trainer.accumulate_grad_batches={self.trainer.accumulate_grad_batches}; set only one of them")
            self.trainer.accumulate_grad_batches = steps
            log.info(f"data.tokens_per_step={datamodule.tokens_per_step}: {steps} micro-batch(es) of "
                     f"{datamodule.batch_size} x {datamodule.block_size} per device and step, "
                     f"{self.trainer.world_size} device(s)")

    def on_fit_start(self) -> None:
        """With compile=true on CPU, build the fused CPU kernel before the first step is traced:
        torch.compile then keeps it as two opaque ops (nothing is built while Dynamo traces, and
        the unbuilt alternative, the plain-PyTorch path, compiled for minutes at depth)."""
        if self.forward_fn is not self.model and self.device.type == "cpu":
            if getattr(getattr(self.model, "residual", None), "kernel", None) in ("auto", "cpu"):
                from attnres.ops import cpu_fused

                cpu_fused.available()

    def token_bytes(self) -> Tensor | None:
        """UTF-8 bytes of each token id on this device (the data module's), or None: one byte each."""
        if self._token_bytes is None or self._token_bytes.device != self.device:
            table = getattr(getattr(self.trainer, "datamodule", None), "token_bytes", None)
            self._token_bytes = None if table is None else table.to(self.device)
        return self._token_bytes

    def bytes_of(self, targets: Tensor) -> Tensor:
        """UTF-8 bytes the scored targets decode to, a 0-dim int64 tensor."""
        scored = targets != -100
        table = self.token_bytes()
        if table is None:
            return scored.sum()
        return table[targets[scored]].sum()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> dict[str, Tensor]:
        return self.forward_fn(idx, targets)

    # -- training ----------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()
        if self.session_start_step is None:
            self.session_start_step = self.trainer.global_step
        self._warm = self.trainer.global_step - self.session_start_step >= THROUGHPUT_WARMUP
        torch.manual_seed(step_seed(self.seed, self.trainer.global_step, self.global_rank))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        inputs, targets = batch
        loss = self(inputs, targets)["loss"]
        if not self._all_finite(loss):
            return self._non_finite("loss")
        self.log("train/loss", loss, prog_bar=True)
        if self.metric == "bpb":  # nats per scored token -> bits per byte of this batch's text
            scored = (targets != -100).sum()
            self.log("train/bpb", loss.detach() / LN2 * scored / self.bytes_of(targets).clamp(min=1))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if at_last_step(self.trainer):
            # the last step: Lightning then validates inside fit, so the checkpoint callback
            # also judges the final weights (best.ckpt exists even for a run shorter than
            # val_check_interval)
            self.trainer.should_stop = True
        tokens = batch[0].numel() * self.trainer.world_size
        self.tokens_seen += tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - (self._step_start or time.perf_counter())
        self.session_tokens += tokens
        self.session_train_s += elapsed
        if self._warm:
            self.steady_tokens, self.steady_train_s = self.steady_tokens + tokens, self.steady_train_s + elapsed
        if elapsed > 0:
            self.log("perf/tokens_per_sec", tokens / elapsed, prog_bar=True)
            mfu = self.mfu(tokens / elapsed, batch[0].shape[1])
            if mfu is not None:
                self.log("perf/mfu", mfu)
        self.log("perf/peak_memory_gb", peak_memory_bytes(self.device) / 2**30)
        self.log("perf/tokens_seen", float(self.tokens_seen))
        for group in self.optimizers().param_groups:
            self.log(f"lr/{group['name']}", group["lr"])

    def mfu(self, tokens_per_sec: float, seq_len: int) -> float | None:
        """Model FLOPs utilisation at `tokens_per_sec` (all devices), on GPU with a known peak only."""
        peak = peak_flops(self.device)
        if peak is None:
            return None
        if self._flops_per_token is None:
            self._flops_per_token = flops_per_token(self.model, seq_len) or 0.0
        return tokens_per_sec * self._flops_per_token / (peak * self.trainer.world_size) or None

    def session_mfu(self, warm: bool = False) -> float | None:
        """MFU over this process's training steps (`warm`: after warm-up) for metrics.json, None on CPU."""
        tokens, seconds = ((self.steady_tokens, self.steady_train_s) if warm
                           else (self.session_tokens, self.session_train_s))
        if not seconds or self._flops_per_token is None:
            return None
        return self.mfu(tokens / seconds, 0)

    # -- non-finite losses and gradients ---------------------------------------------------
    def _all_finite(self, value: Tensor) -> bool:
        finite = bool(torch.isfinite(value.detach()).all())  # one host sync per step
        return self.trainer.strategy.reduce_boolean_decision(finite, all=True)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        # the gradient norm is checked before the optimiser step; under a loss scaler (16-mixed)
        # an overflow is the scaler's to handle, and sharded strategies clip in their own way
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        sharded = "fsdp" in type(self.trainer.strategy).__name__.lower()
        if scaler is None and not sharded:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if not grads:
                return  # a skipped step (training_step returned None): nothing to check or clip
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            if not self._all_finite(norm):
                self._non_finite("gradient norm")  # raises, or drops this step's gradients:
                for p in self.parameters():
                    p.grad = None  # the optimiser skips parameters without a gradient
                return
        self._bad_in_a_row = 0
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def _non_finite(self, what: str) -> None:
        """Apply the non-finite policy to the step being trained; returns None (skip it) or raises."""
        step = self.trainer.global_step + 1
        policy = self.nonfinite["policy"]
        self._bad_in_a_row += 1
        if policy == "stop":
            raise NonFiniteLoss(step, what)
        if self._bad_in_a_row > self.nonfinite["max_in_a_row"]:
            raise NonFiniteLoss(step, what, f"{self._bad_in_a_row} steps in a row")
        if policy == "rollback":
            self._roll_back(step, what)
        self.skipped_steps += 1
        log.warning(f"non-finite {what} at step {step}: step skipped ({policy}; {self.skipped_steps} so far)")
        return None

    def _roll_back(self, step: int, what: str) -> None:
        path = self.rollback_checkpoint
        if path is None or not Path(path).is_file():
            raise NonFiniteLoss(step, what, "no checkpoint to roll back to yet")
        if self.rollbacks >= self.nonfinite["max_rollbacks"]:
            raise NonFiniteLoss(step, what, f"after {self.rollbacks} rollbacks")
        ckpt = torch.load(path, map_location=self.device, weights_only=False)
        self.load_state_dict(ckpt["state_dict"])
        optimizer = self.optimizers().optimizer
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        factor = float(self.nonfinite["lr_factor"])
        scheduler = self.lr_schedulers()
        if scheduler is not None:  # base_lrs travel in the scheduler's state: later checkpoints keep the factor
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        for group in optimizer.param_groups:
            group["lr"] *= factor
        self.rollbacks += 1
        log.warning(f"non-finite {what} at step {step}: rolled back to {path} (step {ckpt.get('global_step')}), "
                    f"learning rate x{factor}; training goes on with the next batches")

    def configure_optimizers(self) -> Any:
        # an optimiser that splits off the hidden weight matrices (MuonWithAdamW) says so itself
        hidden = getattr(getattr(self.optimizer_factory, "func", self.optimizer_factory), "hidden_matrices", False)
        scales = getattr(self.model, "lr_scales", None)  # model.parametrization=mup: per-parameter factors
        muon = getattr(self.optimizer_factory, "keywords", {}).get("muon") or {}
        scales = scales(muon_adjust_lr_fn=muon.get("adjust_lr_fn"), muon=hidden) if callable(scales) else None
        optimizer = self.optimizer_factory(parameter_groups(self.model, self.query_lr_scale, hidden_matrices=hidden,
                                                            lr_scales=scales))
        for group in optimizer.param_groups:
            group["lr"] *= group["lr_scale"]
        if hasattr(optimizer, "describe"):
            log.info(optimizer.describe())
        if self.schedule_factory is None:
            return optimizer
        total = self.total_steps or self.trainer.max_steps
        if total is None or total < 1:
            raise ConfigError(
                f"the learning-rate schedule needs a length: set trainer.max_steps (now {self.trainer.max_steps}) "
                "or optim.total_steps to a positive number of steps"
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(self.schedule_factory, total_steps=total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # -- validation --------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {"loss": 0.0, "tokens": 0.0, "bytes": 0.0, "correct": 0.0, "examples": 0.0}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        out = self(inputs, targets)
        scored = (targets != -100).sum().item()
        self._val_sums["loss"] += out["loss"].item() * scored
        self._val_sums["tokens"] += scored
        if self.metric == "bpb":
            self._val_sums["bytes"] += self.bytes_of(targets).item()
        if self.metric == "accuracy":
            self._val_sums["correct"] += exact_match(out["logits"], targets).item() * inputs.shape[0]
            self._val_sums["examples"] += inputs.shape[0]

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(
            torch.tensor(list(self._val_sums.values()), dtype=torch.float64, device=self.device), reduce_op="sum"
        )
        values = dict(zip(self._val_sums, sums.tolist(), strict=True))
        if values["tokens"] == 0:
            return
        if not self.trainer.sanity_checking:
            self.last_validation_step = self.trainer.global_step
        loss = values["loss"] / values["tokens"]
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        if self.metric == "bpb" and values["bytes"]:  # total nats / ln 2 / total UTF-8 bytes
            self.log("val/bpb", values["loss"] / LN2 / values["bytes"], prog_bar=True)
        elif values["examples"]:
            self.log("val/accuracy", values["correct"] / values["examples"], prog_bar=True)

    # -- state ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["attnres"] = {"tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
                                 "rollbacks": self.rollbacks, "rng": rng_states()}
        if self.run_config is not None:  # what this run computes (attnres.config.computation)
            checkpoint["attnres"]["config"] = self.run_config

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("attnres", {})
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.skipped_steps, self.rollbacks = int(state.get("skipped_steps", 0)), int(state.get("rollbacks", 0))
        if "rng" in state:
            set_rng_states(state["rng"])
