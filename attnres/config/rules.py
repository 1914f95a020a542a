"""The values of one composed job config: each key's type and range (`Rule`), then the checks
that read several keys at once. `validate_config(cfg)` runs before a run starts, from the
command line and again at the start of every run, sweep jobs included.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.config import margins, on_demand, selectors
from attnres.config.errors import ConfigError

KERNELS = ("auto", "triton", "cpu", "torch", "naive")  # ops.dispatch.KERNELS without torch (test_rules: equal)
ABSENT = object()


# == validate_config: the values of one job =========================================================
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
        "kernel": Rule("choice", choices=KERNELS),
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


def _active_rules(cfg: DictConfig) -> Iterator[tuple[str, Rule]]:
    for (section, targets), rules in RULES.items():
        if section and value_at(cfg, section) is ABSENT:
            continue
        if targets and not target_of(cfg, section).startswith(targets):
            continue
        for key, rule in rules.items():
            yield (f"{section}.{key}" if section else key), rule


def typed_keys(cfg: DictConfig) -> set[str]:
    """The keys whose type `validate_config` checks in this config."""
    return {key for key, _ in _active_rules(cfg)} | {
        "name", "ckpt_path", "trainer.precision", "trainer.accelerator", "trainer.devices", "trainer.strategy",
        "optim.optimizer.betas",
    }


def validate_config(cfg: DictConfig) -> None:
    """Values of the composed config (one job's), checked before anything is built or written.

    Works on a job config with or without its `hydra` node, resolved or not. Sections whose
    `_target_` was swapped for another class are left to that class.
    """
    blocks = value_at(cfg, "residual.num_blocks") is not ABSENT and target_of(cfg, "residual").startswith("attnres.")
    for key, rule in _active_rules(cfg):
        if key == "num_blocks" and blocks:
            continue  # check_residual names the values that divide the sublayers
        value = value_at(cfg, key)
        if value is not ABSENT and rule.problem(value) is not None:
            raise ConfigError(f"{key}={_show(value)} {rule.problem(value)}; {rule.wanted(key)}")
    check_top_level(cfg)
    margins.check(cfg)  # verdict.margin, verdict.margin_points: what a sweep's verdicts count as mattering
    on_demand.check(cfg)  # seeds.*: the design of seeds on demand
    if target_of(cfg, "model") == "attnres.Transformer":
        check_model(cfg)
    if target_of(cfg, "residual").startswith("attnres."):
        check_residual(cfg)
    if target_of(cfg, "trainer") in TRAINERS:
        check_trainer(cfg)
    check_logger_libraries(cfg)
    if target_of(cfg, "optim.optimizer").startswith(("torch.optim.", "attnres.training.optimizers.")):
        betas = value_at(cfg, "optim.optimizer.betas")
        if betas is not ABSENT and not (isinstance(betas, (list, ListConfig)) and len(betas) == 2 and
                                         all(_is_number(b) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"optim.optimizer.betas={_show(betas)} must be two numbers in [0, 1); "
                              "e.g. optim.optimizer.betas=[0.9,0.95]")


#: a logger whose `_target_` names one of these needs its library: (module, the attnres extra that installs it)
LOGGER_LIBRARIES = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: not importable either
        return False


def check_logger_libraries(cfg: DictConfig) -> None:
    """A logger whose library is not installed is refused before the run, naming the extra."""
    loggers = value_at(cfg, "logger")
    if not isinstance(loggers, DictConfig):
        return
    for name in loggers:
        target = target_of(cfg, f"logger.{name}").lower()
        for word, (module, extra) in LOGGER_LIBRARIES.items():
            if word in target and not _installed(module):
                raise ConfigError(f"logger.{name} needs the {module} package, which is not installed; "
                                  f"pip install 'attnres[{extra}]', or choose another logger (logger=tensorboard)")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return "''" if value == "" else str(value).replace("'", "").replace(" ", "")


def check_top_level(cfg: DictConfig) -> None:
    name = value_at(cfg, "name")
    if name is not ABSENT:
        parts = str(name).split("/")
        if name is None or not str(name).strip() or str(name).startswith("/") or ".." in parts or "." in parts:
            raise ConfigError(f"name={_show(name)} is not a folder name; "
                              "set name=<experiment name>, e.g. name=baseline (no '..', not absolute)")
    ckpt = value_at(cfg, "ckpt_path")
    exported = value_at(cfg, "mode") in ("eval", "sample") and (Path(str(ckpt)).expanduser() / "config.json").is_file()
    if ckpt not in (ABSENT, None) and not Path(str(ckpt)).expanduser().is_file() and not exported:
        raise ConfigError(f"ckpt_path={ckpt} is not a file; pass the path of a .ckpt written by attnres-run "
                          "(mode=eval and mode=sample also take a folder written by attnres-export)")
    if value_at(cfg, "resume") is True and value_at(cfg, "overwrite") is True:
        raise ConfigError("resume=true and overwrite=true contradict each other; pass only one of them")


def check_model(cfg: DictConfig) -> None:
    n_embd, n_head = value_at(cfg, "model.n_embd"), value_at(cfg, "model.n_head")
    if _is_int(n_embd) and _is_int(n_head) and (n_embd % n_head or (n_embd // n_head) % 2):
        good = math.ceil(n_embd / (2 * n_head)) * 2 * n_head
        raise ConfigError(
            f"model.n_embd={n_embd} must split into model.n_head={n_head} heads of an even size "
            f"(a multiple of 2 * n_head = {2 * n_head}); set e.g. model.n_embd={good}"
        )
    _check_mup_base(cfg)


def _check_mup_base(cfg: DictConfig) -> None:
    """muP's base (attnres.parametrization): its keys belong to parametrization=mup, and its width
    splits into its heads as the model's does; checked here so the run stops before its start line."""
    base = {k: value_at(cfg, f"model.{k}") for k in ("base_width", "base_depth", "base_n_head")}
    given = [k for k, v in base.items() if v not in (ABSENT, None)]
    if value_at(cfg, "model.parametrization") == "standard" and given:
        raise ConfigError(f"model.{given[0]}={_show(base[given[0]])} belongs to model.parametrization=mup; "
                          f"add model.parametrization=mup, or leave model.{given[0]} null")
    width, heads = base["base_width"], base["base_n_head"]
    heads = value_at(cfg, "model.n_head") if heads in (ABSENT, None) else heads
    if _is_int(width) and _is_int(heads) and heads >= 1 and (width % heads or (width // heads) % 2):
        named = "model.base_n_head" if base["base_n_head"] not in (ABSENT, None) else "model.n_head"
        good = math.ceil(width / (2 * heads)) * 2 * heads
        raise ConfigError(f"model.base_width={width} must split into {named}={heads} heads of an even size; "
                          f"set e.g. model.base_width={good}, or model.base_n_head to a divisor")


def check_residual(cfg: DictConfig) -> None:
    blocks, n_layer = value_at(cfg, "residual.num_blocks"), value_at(cfg, "model.n_layer")
    sizes = value_at(cfg, "residual.block_sizes")
    if sizes not in (ABSENT, None) and _is_int(n_layer) and n_layer >= 1:
        layers = 2 * n_layer
        listed = list(sizes) if isinstance(sizes, (list, tuple, ListConfig)) else None
        if not listed or not all(_is_int(n) and n >= 1 for n in listed) or sum(listed) != layers:
            raise ConfigError(f"residual.block_sizes={_show(sizes)} must be positive integers summing to the {layers} "
                              f"sublayers (2 per transformer layer); e.g. residual.block_sizes=[{layers - 1},1]")
        if _is_int(blocks) and blocks != len(listed):
            raise ConfigError(f"num_blocks={blocks} disagrees with residual.block_sizes, which lists {len(listed)} "
                              f"blocks; set num_blocks={len(listed)}")
        return _check_kernel(cfg)
    if blocks is not ABSENT and _is_int(n_layer) and n_layer >= 1:
        layers = 2 * n_layer
        valid = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
        if not _is_int(blocks):
            raise ConfigError(f"num_blocks={_show(blocks)} is not an integer; set num_blocks to one that divides the "
                              f"{layers} sublayers (2 per transformer layer): {valid}")
        if blocks < 1 or layers % blocks:
            raise ConfigError(f"num_blocks={blocks} must divide the {layers} sublayers (2 per transformer layer), "
                              f"or give unequal blocks with residual.block_sizes=[...]; valid values: {valid}")
    _check_kernel(cfg)


def _check_kernel(cfg: DictConfig) -> None:
    if value_at(cfg, "residual.kernel") == "triton":
        fix = "use residual.kernel=auto (Triton on CUDA, fused PyTorch elsewhere) or residual.kernel=torch"
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(f"residual.kernel=triton needs the triton package (pip install 'attnres[triton]'); "
                              f"{fix}")
        if os.environ.get("TRITON_INTERPRET") != "1":
            if not _cuda_available():
                raise ConfigError(f"residual.kernel=triton needs a CUDA GPU and none is visible; {fix}")
            if value_at(cfg, "trainer.accelerator") == "cpu":
                raise ConfigError(f"residual.kernel=triton needs the model on a GPU, but trainer.accelerator=cpu; "
                                  f"{fix}, or set trainer.accelerator=gpu")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _precisions() -> list[str]:
    try:
        import typing

        from lightning_fabric.connector import _PRECISION_INPUT_INT, _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

        names = [*typing.get_args(_PRECISION_INPUT_STR), *typing.get_args(_PRECISION_INPUT_STR_ALIAS)]
        return ["auto", *names, *map(str, typing.get_args(_PRECISION_INPUT_INT))]
    except ImportError:  # another Lightning: its own check will do
        return []


def check_trainer(cfg: DictConfig) -> None:
    max_steps = value_at(cfg, "trainer.max_steps")
    if max_steps == -1 and value_at(cfg, "optim.total_steps") in (None, ABSENT):
        raise ConfigError("trainer.max_steps=-1 (no limit) leaves the learning-rate schedule without a length; "
                          "set trainer.max_steps to a number of steps, or optim.total_steps=<steps>")
    precision = value_at(cfg, "trainer.precision")
    allowed = _precisions()
    if precision is not ABSENT and allowed and str(precision) not in allowed:
        raise ConfigError(f"trainer.precision={precision} is not a precision; choose one of: auto, 32-true, "
                          f"bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true")
    accelerator = value_at(cfg, "trainer.accelerator")
    gpu = accelerator in ("gpu", "cuda") or accelerator == "auto" and _cuda_available()
    if accelerator is not ABSENT and not isinstance(accelerator, str):
        raise ConfigError(f"trainer.accelerator={_show(accelerator)} is not an accelerator; "
                          "use trainer.accelerator=auto, cpu or gpu")
    if isinstance(accelerator, str) and accelerator not in ("auto", "cpu"):
        from pytorch_lightning.accelerators import AcceleratorRegistry

        names = sorted(AcceleratorRegistry.available_accelerators())
        if accelerator not in ("gpu", *names):
            raise ConfigError(f"trainer.accelerator={accelerator} is not an accelerator; "
                              f"use trainer.accelerator=auto, cpu or gpu ({', '.join(['auto', 'gpu', *names])})")
        if accelerator in ("gpu", "cuda"):
            usable = _cuda_available() or accelerator == "gpu" and AcceleratorRegistry["mps"]["accelerator"] \
                .is_available()
        else:
            try:
                usable = AcceleratorRegistry[accelerator]["accelerator"].is_available()
            except Exception:  # an accelerator whose library is missing (tpu without torch_xla)
                usable = False
        if not usable:
            raise ConfigError(f"trainer.accelerator={accelerator} but no {accelerator.upper()} is available on this "
                              "machine; use trainer.accelerator=cpu or trainer.accelerator=auto (or trainer=cpu)")
    devices = value_at(cfg, "trainer.devices")
    if devices is not ABSENT:
        check_devices(devices, gpu, per_job="gpus_per_job" in cfg)
    strategy = value_at(cfg, "trainer.strategy")
    if isinstance(strategy, str) and strategy != "auto":
        from pytorch_lightning.strategies import StrategyRegistry

        names = StrategyRegistry.available_strategies()
        if strategy not in names:
            close = difflib.get_close_matches(strategy, names, n=1)
            maybe = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"trainer.strategy={strategy} is not a strategy{maybe}; use trainer=ddp or trainer=fsdp, "
                              "or trainer.strategy=auto")
        if strategy.startswith(("fsdp", "deepspeed")) and not gpu:
            raise ConfigError(f"trainer.strategy={strategy} needs GPUs and this run is on the CPU; "
                              "use trainer=ddp (gloo on the CPU) or trainer=auto")


def check_devices(devices: Any, gpu: bool, per_job: bool = False) -> None:
    """`per_job`: the config sets its devices from a `gpus_per_job` key (experiment=paper_*), the
    key to name in the fix."""
    fix = "set trainer.devices to a number of devices >= 1, or trainer.devices=auto"
    if devices == "auto":
        return
    if isinstance(devices, (list, ListConfig)):
        if gpu and devices and all(_is_int(d) and d >= 0 for d in devices):
            return
        raise ConfigError(f"trainer.devices={_show(devices)} is not a list of GPU indices; {fix}")
    text = str(devices).strip()
    if isinstance(devices, str) and gpu and text and all(part.strip().isdigit() for part in text.split(",")):
        return  # "0,1": GPU indices
    try:
        count = int(text) if not isinstance(devices, (bool, float)) else None
    except ValueError:
        count = None
    if count is None or count < 1 and not (gpu and count == -1):
        raise ConfigError(f"trainer.devices={_show(devices)} is invalid; {fix}")
    if gpu and count > 0:
        import torch

        have = torch.cuda.device_count()
        if have and count > have:
            fix = (f"gpus_per_job={have} or fewer" if per_job
                   else f"trainer.devices={have} or fewer (or trainer.devices=auto)")
            raise ConfigError(f"trainer.devices={count} but this machine has {have} GPU(s); set {fix}")
