"""The values of one composed job config: each key's type and range (`Rule`, the `RULES` table in
rules_table.py), then the checks that read several keys at once. `validate_config(cfg)` runs
before a run starts, from the command line and again at the start of every run, sweep jobs included.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from attnres.config import margins, on_demand
from attnres.config.errors import ConfigError
from attnres.config.rules_table import ABSENT, RULES, TRAINERS, Rule, _is_int, _is_number, _show, target_of, value_at
from attnres.config.rules_table import BOOL as BOOL  # re-exported: sweep.tuned builds its rules from it
from attnres.config.rules_table import KERNELS as KERNELS  # re-exported: test_rules compares it with ops.dispatch


# == validate_config: the values of one job =========================================================
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
    stop = value_at(cfg, "stop_at_step")
    if isinstance(stop, int) and isinstance(max_steps, int) and 0 < max_steps <= stop:
        raise ConfigError(f"stop_at_step={stop} is not below trainer.max_steps={max_steps}; pause earlier, e.g. "
                          f"stop_at_step={max(1, max_steps // 2)}, or leave it out (null) to train to the end")
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
