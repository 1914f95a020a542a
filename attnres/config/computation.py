"""What a run computes: the config keys that a resume or a `ckpt_path` must share with its checkpoint.

Every checkpoint records them (`checkpoint["attnres"]["config"]`, written by the Lightning module);
continuing it under other values would train something else and call it the same run. Keys that
only say how long, how fast or how loudly a run goes (`trainer.max_steps`, the progress bar, the
logging and validation intervals, `residual.kernel`, `residual.fuse_prenorm`, the data loader's
workers) may differ.
A checkpoint written before the record existed is held against the `.hydra/config.yaml` of the run
that wrote it, when that file still says what the run was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.config.errors import ConfigError

#: the parts of a config that decide what is computed, step by step
COMPUTED = ("residual", "model", "data", "optim", "seed", "nonfinite", "trainer.precision",
            "trainer.gradient_clip_val", "trainer.gradient_clip_algorithm", "trainer.accumulate_grad_batches")
#: keys inside those parts that do not change the numbers (the kernels, and a fused pre-norm, agree to float rounding)
NOT_COMPUTED = ("residual.kernel", "residual.fuse_prenorm", "data.num_workers", "data.cache_dir",
                "optim.total_steps")
SHOWN = 3  # differences named in the refusal; the rest are counted
#: keys added since runs were first recorded, with the value that computes what a run without them did
ADDED = {"model.parametrization": "standard", "model.depth_alpha": 1.0}


def _value(cfg: DictConfig, key: str) -> Any:
    node = OmegaConf.select(cfg, key, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
    if isinstance(node, (DictConfig,)) or OmegaConf.is_list(node):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException:
            return OmegaConf.to_container(node, resolve=False)
    return node


def _flat(value: Any, prefix: str, into: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(v, f"{prefix}.{k}", into)
    else:
        into[prefix] = value


def computation(cfg: DictConfig) -> dict[str, Any]:
    """{dotted key: value} of what `cfg` computes (COMPUTED less NOT_COMPUTED), resolved where it can be."""
    found: dict[str, Any] = {}
    for key in COMPUTED:
        _flat(_value(cfg, key), key, found)
    return {k: v for k, v in found.items() if not k.startswith(NOT_COMPUTED) and v is not None}


def _same(a: Any, b: Any) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if numbers:
        return float(a) == float(b)  # 1e-3 written as 0.001, 2 as 2.0
    if isinstance(a, str) and isinstance(b, str):  # a class that moved (config/moved.py) is the same class
        from attnres.config.moved import MOVED

        return MOVED.get(a, a) == MOVED.get(b, b)
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The keys whose values differ (present on one side only counts, except a key of ADDED at its
    value), sorted."""
    return sorted(k for k in set(recorded) | set(current)
                  if not _same(recorded.get(k, ADDED.get(k)), current.get(k, ADDED.get(k))))


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    return json.dumps(value, default=str) if isinstance(value, (list, dict)) else str(value)


def refuse_other_computation(path: str | Path, recorded: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Raise ConfigError, naming the keys, when the checkpoint at `path` was trained under another
    computation than `current`; nothing to compare (`recorded` None) passes."""
    if recorded is None:
        return
    differ = differences(recorded, current)
    if not differ:
        return
    named = ", ".join(f"{k} ({_show(recorded.get(k, ADDED.get(k)))} there, {_show(current.get(k, ADDED.get(k)))} here)"
                      for k in differ[:SHOWN])
    more = f" and {len(differ) - SHOWN} more: {', '.join(differ[SHOWN:])}" if len(differ) > SHOWN else ""
    raise ConfigError(
        f"checkpoint {path} was trained with another config: {named}{more}; continue it with the config it was "
        "trained with (the overrides in its run's metrics.json), or start a new run from scratch (name=<new name>)"
    )


def recorded_computation(path: str | Path, run_config: bool = True, loaded: Any = None) -> dict[str, Any] | None:
    """What the checkpoint at `path` computed: its own record, else (with `run_config`) the
    `.hydra/config.yaml` of the run folder that holds it; None when neither says (or it is unreadable:
    the checkpoint's own check says so). `loaded`: the checkpoint, when the caller has read it already."""
    ckpt = loaded
    if ckpt is None:
        import torch  # a checkpoint is a torch file; mmap reads only what is asked for

        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # unreadable: `check_checkpoint` words that, with the file's name
            return None
    record = ckpt.get("attnres", {}).get("config") if isinstance(ckpt, dict) else None
    if record is not None or not run_config:
        return record
    saved = Path(path).resolve().parent.parent / ".hydra" / "config.yaml"
    if not saved.is_file():
        return None
    try:
        return computation(OmegaConf.load(saved))
    except (OmegaConfBaseException, OSError, ValueError):
        return None
