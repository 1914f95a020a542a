"""The Lightning module: optimisation, metrics and logging around any `attnres.Transformer`."""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from attnres.training.data import exact_match
from attnres.training.errors import ConfigError

LN2 = math.log(2.0)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def parameter_groups(model: nn.Module, query_lr_scale: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices only; norms, biases, embeddings and the residual
    strategy's parameters without decay; pseudo-queries also at `query_lr_scale` times the
    learning rate (DESIGN.md section 2b: they are sensitive to it)."""
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) or "norm" in type(module).__name__.lower():
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    residual = getattr(model, "residual", None)
    residual_names = {id(p): n for n, p in residual.named_parameters()} if residual is not None else {}
    decay, no_decay, queries, seen = [], [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if "query" in residual_names.get(id(p), ""):
            queries.append(p)
        elif id(p) in residual_names or id(p) in no_decay_ids or p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "lr_scale": 1.0, "name": "decay"},  # the optimiser's own weight_decay
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0, "name": "no_decay"},
        {"params": queries, "weight_decay": 0.0, "lr_scale": query_lr_scale, "name": "pseudo_query"},
    ]
    return [g for g in groups if g["params"]]


class LitLanguageModel(pl.LightningModule):
    """Trains `model` (idx, targets -> {"logits", "loss"}) on `(inputs, targets)` batches.

    `optimizer` is a partial optimiser (Hydra `_partial_: true`) taking parameter groups;
    `schedule` a partial `step -> multiplier` taking `total_steps` (default: the trainer's
    `max_steps`). `metric` is "bpb" (bits per byte) or "accuracy" (exact match).
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
    ) -> None:
        super().__init__()
        if metric not in ("bpb", "accuracy"):
            raise ValueError(f"metric must be 'bpb' or 'accuracy', got {metric!r}")
        self.model = model
        self.optimizer_factory, self.schedule_factory = optimizer, schedule
        self.query_lr_scale, self.total_steps, self.metric = query_lr_scale, total_steps, metric
        # kept out of the module tree so checkpoints hold one copy of the weights under `model.`
        self.__dict__["forward_fn"] = torch.compile(model) if compile else model
        self.tokens_seen = 0  # over the whole run, restored on resume
        self.session_tokens, self.session_train_s = 0, 0.0  # this process only: for throughput
        self._step_start: float | None = None
        self._val_sums: dict[str, float] = {}

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> dict[str, Tensor]:
        return self.forward_fn(idx, targets)

    # -- training ----------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self(inputs, targets)["loss"]
        self.log("train/loss", loss, prog_bar=True)
        if self.metric == "bpb":
            self.log("train/bpb", loss / LN2)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        tokens = batch[0].numel() * self.trainer.world_size
        self.tokens_seen += tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - (self._step_start or time.perf_counter())
        self.session_tokens += tokens
        self.session_train_s += elapsed
        if elapsed > 0:
            self.log("perf/tokens_per_sec", tokens / elapsed, prog_bar=True)
        self.log("perf/peak_memory_gb", peak_memory_bytes(self.device) / 2**30)
        self.log("perf/tokens_seen", float(self.tokens_seen))
        for group in self.optimizers().param_groups:
            self.log(f"lr/{group['name']}", group["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(parameter_groups(self.model, self.query_lr_scale))
        for group in optimizer.param_groups:
            group["lr"] *= group["lr_scale"]
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
        self._val_sums = {"loss": 0.0, "tokens": 0.0, "correct": 0.0, "examples": 0.0}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        out = self(inputs, targets)
        scored = (targets != -100).sum().item()
        self._val_sums["loss"] += out["loss"].item() * scored
        self._val_sums["tokens"] += scored
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
        loss = values["loss"] / values["tokens"]
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        if self.metric == "bpb":
            self.log("val/bpb", loss / LN2, prog_bar=True)
        elif values["examples"]:
            self.log("val/accuracy", values["correct"] / values["examples"], prog_bar=True)

    # -- state ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["attnres"] = {"tokens_seen": self.tokens_seen}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("attnres", {}).get("tokens_seen", 0))
