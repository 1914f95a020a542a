"""Each key's type and range: the `Rule` class and the `RULES` table that `rules.validate_config`
walks, with the lookups (`value_at`, `target_of`) and the command-line spelling of a value (`_show`)
that the checks in rules.py share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.config import selectors
from attnres.config.errors import ConfigError

KERNELS = ("auto", "triton", "cpu", "torch", "naive")  # ops.dispatch.KERNELS without torch (test_rules: equal)
ABSENT = object()


def value_at(cfg: DictConfig, key: str) -> Any:
    """The resolved value at `key`, or ABSENT; a broken interpolation is one line."""
    try:
        return OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise ConfigError(selectors.explain(cfg, err) or f"{key}: {err.msg.splitlines()[0]}; fix that ${{...}} "
                          "reference") from err


def target_of(cfg: DictConfig, section: str) -> str:
    value = value_at(cfg, f"{section}._target_")
    return value if isinstance(value, str) else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return "''" if value == "" else str(value).replace("'", "").replace(" ", "")


class Rule:
    """One key's type and range; `problem(value)` says what is wrong with a value, or None."""

    def __init__(self, kind: str, low: float | None = None, high: float | None = None, *, open_low: bool = False,
                 open_high: bool = False, choices: Sequence[Any] = (), also: Sequence[Any] = (),
                 nullable: bool = False, example: Any = None, hint: str = "") -> None:
        self.kind, self.low, self.high, self.open_low, self.open_high = kind, low, high, open_low, open_high
        self.choices, self.also, self.nullable, self.example = tuple(choices), tuple(also), nullable, example
        self.hint = hint

    def problem(self, value: Any) -> str | None:
        if value is None and self.nullable or any(type(value) is type(v) and value == v for v in self.also):
            return None
        if self.kind == "bool":
            return None if isinstance(value, bool) else "is not a boolean"
        if self.kind == "choice":
            return None if value in self.choices else "is not one of the choices"
        if not (_is_int(value) if self.kind == "int" else _is_number(value)):
            return "is not an integer" if self.kind == "int" else "is not a number"
        below = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        above = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        return "is out of range" if below or above else None

    def wanted(self, key: str) -> str:
        if self.hint:
            return self.hint.format(key=key)
        also = "".join(f" or {key}={_show(v)}" for v in self.also)
        if self.kind == "bool":
            return f"write {key}=true or {key}=false{also}"
        if self.kind == "choice":
            return f"choose one of: {', '.join(map(str, self.choices))}"
        noun = "an integer" if self.kind == "int" else "a number"
        lo = None if self.low is None else f"{'>' if self.open_low else '>='} {_number(self.low)}"
        hi = None if self.high is None else f"{'<' if self.open_high else '<='} {_number(self.high)}"
        bound = " and ".join(b for b in (lo, hi) if b)
        extra = "".join(f" (or {_show(v)})" for v in self.also if not isinstance(v, bool))
        extra += " (or null)" if self.nullable else ""
        example = f", e.g. {key}={self.example}" if self.example is not None else ""
        return f"set {key} to {noun}{' ' + bound if bound else ''}{extra}{example}"


BOOL = Rule("bool")
TRAINERS = ("pytorch_lightning.Trainer", "pytorch_lightning.trainer.trainer.Trainer", "lightning.pytorch.Trainer",
            "lightning.Trainer")
#: (section whose _target_ must start with one of these, or "" for the top level) -> {key: rule}
RULES: dict[tuple[str, tuple[str, ...]], dict[str, Rule]] = {
    ("", ()): {
        "seed": Rule("int", 0, 2**32 - 1, example=0), "num_blocks": Rule("int", 1, example=4),
        "threads": Rule("int", 1, nullable=True, example=1),
        "stop_at_step": Rule("int", 1, nullable=True, example=100),  # below trainer.max_steps: rules.check_trainer
        "compile": BOOL, "resume": BOOL, "overwrite": BOOL, "keep_freed_memory": BOOL,
        "mode": Rule("choice", choices=("train", "eval", "sample")),
        "budget": Rule("number", 0, open_low=True, example=0.1),  # experiment=paper_*'s keys, absent elsewhere
        "gpus_per_job": Rule("int", 1, nullable=True, example=1), "gpus_per_node": Rule("int", 1, example=8),
    },
    ("sample", ()): {
        "max_new_tokens": Rule("int", 1, example=200), "temperature": Rule("number", 0, example=0.8),
        "top_k": Rule("int", 1, nullable=True, example=50), "num_samples": Rule("int", 1, example=1),
    },
    ("eval", ()): {  # downstream tasks at the end of a run; attnres-tasks checks its flags against these too
        "limit": Rule("int", 1, nullable=True, example=200), "num_fewshot": Rule("int", 0, nullable=True, example=5),
        "batch_size": Rule("int", 1, example=16), "num_docs": Rule("int", 1, example=500),
        "offline": BOOL, "unsafe_code": BOOL,
    },
    ("model", ("attnres.Transformer",)): {
        "n_layer": Rule("int", 1, example=8), "n_head": Rule("int", 1, example=4),
        "n_embd": Rule("int", 1, example=96), "block_size": Rule("int", 1, example=128),
        "dropout": Rule("number", 0, 1, open_high=True, example=0.0), "bias": BOOL, "tie_embeddings": BOOL,
        "mlp": Rule("choice", choices=("gelu", "swiglu")), "norm_eps": Rule("number", 0, open_low=True, example=1e-6),
        "init_std": Rule("number", 0, open_low=True, example=0.02),
        "mlp_hidden": Rule("int", 1, nullable=True, example=256),
        "parametrization": Rule("choice", choices=("standard", "mup")),  # attnres.parametrization.PARAMETRIZATIONS
        "base_width": Rule("int", 1, nullable=True, example=32), "base_depth": Rule("int", 1, nullable=True, example=2),
        "base_n_head": Rule("int", 1, nullable=True, example=2), "depth_alpha": Rule("number", 0, 1, example=1.0),
    },
    ("residual", ("attnres.",)): {
        "eps": Rule("number", 0, open_low=True, example=1e-6), "key_norm_gain": BOOL, "output_aggregation": BOOL,
        "kernel": Rule("choice", choices=KERNELS), "fuse_prenorm": BOOL,
    },
    ("data", ("attnres.data.",)): {
        "block_size": Rule("int", 1, example=128), "batch_size": Rule("int", 1, example=16),
        "num_workers": Rule("int", 0, example=0), "val_batches": Rule("int", 1, example=16),
        "val_fraction": Rule("number", 0, 1, open_low=True, open_high=True, example=0.05),
        "max_files": Rule("int", 1, nullable=True, example=100), "num_symbols": Rule("int", 2, example=8),
        "num_hops": Rule("int", 1, example=2), "num_pairs": Rule("int", 2, nullable=True, example=8),
        "num_queries": Rule("int", 1, nullable=True, example=8),
        "val_tokens": Rule("int", 1, nullable=True, example=1048576),
        "vocab_size": Rule("int", 1, nullable=True, example=50257),
        "tokens_per_step": Rule("int", 1, nullable=True, example=524288),
        "dtype": Rule("choice", choices=("uint16", "uint32"), nullable=True),
    },
    ("trainer", TRAINERS): {
        "max_steps": Rule("int", 1, also=(-1,), example=1500),
        "val_check_interval": Rule("int", 1, example=250),
        "accumulate_grad_batches": Rule("int", 1, example=1),
        "log_every_n_steps": Rule("int", 0, example=10),
        "num_sanity_val_steps": Rule("int", -1, example=0),
        "gradient_clip_val": Rule("number", 0, nullable=True, example=1.0),
        "enable_progress_bar": BOOL, "enable_model_summary": BOOL,
        "deterministic": Rule("bool", also=("warn",)),
        "fast_dev_run": Rule("int", 0, also=(True, False),
                             hint="write {key}=true, {key}=false or a number of batches (e.g. {key}=2)"),
    },
    ("optim.optimizer", ("torch.optim.",)): {
        "lr": Rule("number", 0, example=3e-3), "weight_decay": Rule("number", 0, example=0.1),
        "eps": Rule("number", 0, example=1e-8), "momentum": Rule("number", 0, example=0.9),
    },
    ("optim.optimizer", ("attnres.training.optimizers.",)): {  # optim=muon: AdamW's part
        "lr": Rule("number", 0, example=3e-3), "weight_decay": Rule("number", 0, example=0.1),
        "eps": Rule("number", 0, example=1e-8),
    },
    ("optim.optimizer.muon", ()): {  # optim=muon: torch.optim.Muon's arguments
        "lr": Rule("number", 0, example=3e-3), "momentum": Rule("number", 0, 1, open_high=True, example=0.95),
        "weight_decay": Rule("number", 0, example=0.1), "nesterov": BOOL, "ns_steps": Rule("int", 1, 99, example=5),
        "adjust_lr_fn": Rule("choice", choices=("match_rms_adamw", "original")),
    },
    ("optim.schedule", ("attnres.training.schedules.",)): {
        "warmup_steps": Rule("int", 0, example=100), "min_lr_ratio": Rule("number", 0, 1, example=0.1),
        "decay_fraction": Rule("number", 0, 1, example=0.2),
    },
    ("optim", ()): {
        "query_lr_scale": Rule("number", 0, example=0.1), "total_steps": Rule("int", 1, nullable=True, example=1500),
    },
    ("callbacks.depth_dashboard", ("attnres.training.dashboard.",)): {
        "every_n_steps": Rule("int", 1, example=100), "probe_size": Rule("int", 1, example=8), "histograms": BOOL,
    },
    ("callbacks.checkpoint", ("pytorch_lightning.callbacks.", "lightning.pytorch.callbacks.")): {
        "save_last": Rule("bool", also=("link",)), "save_top_k": Rule("int", -1, example=1),
        "auto_insert_metric_name": BOOL, "enable_version_counter": BOOL,
    },
    ("callbacks.progress_bar", ("attnres.training.progress.",)): {"refresh_rate": Rule("int", 0, example=10)},
    ("logger.tensorboard", ("pytorch_lightning.loggers.", "lightning.pytorch.loggers.",
                            "attnres.training.tensorboard.")): {"default_hp_metric": BOOL},
}
