"""What a sweep will cost, said before it starts: training FLOPs and GPU-hours at a stated MFU.

An experiment that sets a top-level `costs:` block (conf/experiment/paper_*.yaml) gets, when
its sweep is planned (`attnres.sweep.plan.plan_jobs`), one line per job and a total:

    paper_scaling: 15 jobs to run, 4.51e+21 training FLOPs (52.2 PFLOP/s-days), about 3,166 GPU-hours at 40% MFU ...

FLOPs per token are the runner's MFU count (`attnres.training.lit.flops_per_token`):
6 (N + V D) + 12 n_layer T D, N the non-embedding parameters (the residual strategy's
included), V D the LM head; forward and backward, training steps only (validation left out).
The depth attention's own arithmetic is left out: at the paper's shapes it is under 1% of it.

Each job's line gives its shape too: GPUs (`trainer.devices` x `trainer.num_nodes`) and the wall
hours its GPU-hours take on them.

Also here, registered on import (`attnres.config.naming` imports this module):
`${attnres.steps:TOKENS,TOKENS_PER_STEP[,FRACTION...]}`, the optimiser steps that train on
TOKENS x every FRACTION tokens (at least 1, rounded up), so that an experiment states its
token budget and a `budget` fraction, not step counts; `${attnres.devices:GPUS,PER_NODE}` and
`${attnres.nodes:GPUS,PER_NODE}`, a job of GPUS GPUs as `trainer.devices` per node on
`trainer.num_nodes` nodes of PER_NODE GPUs each; `${attnres.val_every:STEPS,TOKENS_PER_STEP,MICRO_TOKENS,
COUNT}`, the validation interval in micro-batches of one GPU; `${attnres.product:A,B,...}` and
`${attnres.or:VALUE,DEFAULT}` (DEFAULT where VALUE is null).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.config.errors import ConfigError

BYTE_DATA = ("StdlibBytesDataModule", "TextBytesDataModule")  # one token per byte: V = 256


def steps(tokens: Any, tokens_per_step: Any, *fractions: Any) -> int:
    """Optimiser steps that see `tokens` x each of `fractions` tokens, `tokens_per_step` a step."""
    values = [tokens, tokens_per_step, *fractions]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in values):
        raise ConfigError(f"attnres.steps takes positive numbers (tokens, tokens per step, fractions), got {values}; "
                          "e.g. budget=0.1 for a tenth of the token budget")
    return max(1, math.ceil(float(tokens) * math.prod(float(f) for f in fractions) / float(tokens_per_step)))


def _job_gpus(gpus: Any, per_node: Any) -> tuple[int, int]:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (gpus, per_node)):
        raise ConfigError(f"GPUs per job and per node must be whole numbers >= 1, got {gpus!r} and {per_node!r}; e.g. "
                          "gpus_per_job=1 on a machine with one GPU")
    if gpus > per_node and gpus % per_node:
        raise ConfigError(f"a job of {gpus} GPUs does not fill whole nodes of {per_node} GPUs (gpus_per_node); pass "
                          f"gpus_per_job={per_node * math.ceil(gpus / per_node)} or another gpus_per_node")
    return gpus, per_node


def devices(gpus: Any, per_node: Any) -> int:
    """`trainer.devices` of a job of `gpus` GPUs on nodes of `per_node` GPUs."""
    gpus, per_node = _job_gpus(gpus, per_node)
    return min(gpus, per_node)


def nodes(gpus: Any, per_node: Any) -> int:
    """`trainer.num_nodes` of a job of `gpus` GPUs on nodes of `per_node` GPUs."""
    gpus, per_node = _job_gpus(gpus, per_node)
    return max(1, gpus // per_node)


def val_every(max_steps: Any, tokens_per_step: Any, micro_tokens: Any, count: Any) -> int:
    """`trainer.val_check_interval` for `count` validations in a run of `max_steps` optimiser steps
    of `tokens_per_step`, counted as Lightning counts it: in micro-batches of `micro_tokens` on one
    GPU (rounded down, so that the last one falls inside the run)."""
    values = [max_steps, tokens_per_step, micro_tokens, count]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in values):
        raise ConfigError(f"attnres.val_every takes positive numbers (steps, tokens per step, tokens per micro-batch "
                          f"and GPU, validations), got {values}")
    return max(1, int(max_steps * tokens_per_step / micro_tokens // count))


def product(*values: Any) -> int | float:
    """The product of numbers (an interpolation's arithmetic)."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"attnres.product takes numbers, got {list(values)}")
    return math.prod(values)


def either(value: Any, default: Any) -> Any:
    """`value`, or `default` where it is null."""
    return default if value is None else value


for _name, _resolver in (("attnres.steps", steps), ("attnres.devices", devices), ("attnres.nodes", nodes),
                         ("attnres.val_every", val_every), ("attnres.product", product), ("attnres.or", either)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)


# -- one job ------------------------------------------------------------------------------------
def vocab_size(cfg: DictConfig) -> tuple[int, str]:
    """The vocabulary the job's model gets, and where that figure comes from."""
    data = cfg.get("data") or {}
    if data.get("vocab_size"):
        return int(data.vocab_size), "data.vocab_size"
    if str(data.get("_target_", "")).endswith(BYTE_DATA):
        return 256, "bytes"
    path = data.get("path")
    meta = Path(str(path)).expanduser() / "meta.json" if path else None
    if meta is not None and meta.is_file():
        try:
            return int(json.loads(meta.read_text())["vocab_size"]), "meta.json"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return int(cfg.costs.vocab_size), "assumed: costs.vocab_size"


def tokens_per_step(cfg: DictConfig) -> int:
    """Training tokens of one optimiser step: `data.tokens_per_step`, else batch x length x
    devices x gradient accumulation."""
    if cfg.data.get("tokens_per_step"):
        return int(cfg.data.tokens_per_step)
    devices = cfg.trainer.get("devices")
    return (int(cfg.data.batch_size) * int(cfg.data.block_size) * (devices if isinstance(devices, int) else 1)
            * int(cfg.trainer.get("accumulate_grad_batches") or 1))


def job_cost(cfg: DictConfig, built: dict[str, int] | None = None) -> dict[str, Any]:
    """Parameters, tokens and training FLOPs of one job, its model built on the meta device
    (no memory, no time); `built` caches parameter counts by model and strategy."""
    import torch
    from hydra.utils import instantiate

    vocab, vocab_from = vocab_size(cfg)
    shape = json.dumps([OmegaConf.to_container(cfg.model, resolve=True),
                        OmegaConf.to_container(cfg.residual, resolve=True), vocab], sort_keys=True, default=str)
    built = {} if built is None else built
    if shape not in built:
        with torch.device("meta"):
            model = instantiate(cfg.model, vocab_size=vocab, residual=instantiate(cfg.residual))
        built[shape] = model.num_parameters(exclude_embedding=True)
    width, layers, length = int(cfg.model.n_embd), int(cfg.model.n_layer), int(cfg.data.block_size)
    per_token = 6.0 * (built[shape] + vocab * width) + 12.0 * layers * length * width
    tokens = int(cfg.trainer.max_steps) * tokens_per_step(cfg)
    return {"non_embedding_parameters": built[shape], "vocab_size": vocab, "vocab_from": vocab_from,
            "tokens": tokens, "flops_per_token": per_token, "flops": per_token * tokens}


# -- a sweep ------------------------------------------------------------------------------------
def job_gpus(cfg: DictConfig) -> int:
    """GPUs one job runs on: `trainer.devices` (a number; else 1) x `trainer.num_nodes`."""
    found = cfg.trainer.get("devices")
    per_node = found if isinstance(found, int) and found > 0 else len(found) if isinstance(found, (list, tuple)) else 1
    return per_node * int(cfg.trainer.get("num_nodes") or 1)


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _labels(overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each job's overrides, only those that differ between the jobs."""
    parsed = [{k.split("/")[-1].split("@")[0]: v for k, v in (o.split("=", 1) for o in job if "=" in o)}
              for job in overrides]  # experiment/paper_ablation@_global_=full reads paper_ablation=full
    keys = sorted({k for job in parsed for k in job})
    varying = [k for k in keys if len({job.get(k) for job in parsed}) > 1]
    return [",".join(f"{k}={job[k]}" for k in varying if k in job) or "(the one job)" for job in parsed]


def check_data(cfg: DictConfig) -> None:
    """Refuse a job whose data group the experiment's scale names as unfit (`costs.unfit_data`):
    the paper's shapes on the 30 MB stdlib corpus would repeat it thousands of times."""
    choice = OmegaConf.select(cfg, "hydra.runtime.choices.data")
    unfit = cfg.costs.get("unfit_data") or []
    if choice is not None and choice in unfit:
        name, scale = cfg.get("name", "this experiment"), cfg.get("scale", "?")
        raise ConfigError(f"{name} at scale={scale} trains on tokenized text, not data={choice}; add data=tokens "
                          "data.path=<a folder written by attnres-prepare> (docs/configuration.md#the-papers-"
                          "experiments), or run scale=cpu")


def announce(jobs: Sequence[tuple[Sequence[str], DictConfig]], skipped: int = 0) -> list[str]:
    """The lines a sweep prints before it starts when its jobs set `costs:`: per job its
    parameters, tokens, FLOPs and GPU-hours, then the total. Nothing for other sweeps. Raises
    ConfigError for a job on data the experiment refuses (`check_data`)."""
    priced = [(list(o), cfg) for o, cfg in jobs if OmegaConf.select(cfg, "costs") is not None]
    if not priced:
        return []
    built: dict[str, int] = {}
    for _, cfg in priced:
        check_data(cfg)
    rows = [job_cost(cfg, built) for _, cfg in priced]
    head = priced[0][1]
    mfu, peak, gpu = float(head.costs.mfu), float(head.costs.peak_flops), str(head.costs.gpu)
    hours = [r["flops"] / (mfu * peak) / 3600 for r in rows]
    total, gpu_hours = sum(r["flops"] for r in rows), f"{sum(hours):,.{0 if sum(hours) >= 10 else 2}f}"
    vocab = sorted({f"V {r['vocab_size']:,} ({r['vocab_from']})" for r in rows})
    lines = [
        f"{head.get('name', 'sweep')}: {len(rows)} job{'s' * (len(rows) != 1)} to run"
        + (f" ({skipped} skipped: duplicate or finished)" if skipped else "")
        + f", {total:.3g} training FLOPs ({total / 1e15 / 86400:.3g} PFLOP/s-days), "
        f"about {gpu_hours} GPU-hours at {mfu:.0%} MFU of {peak / 1e12:,.0f} TFLOP/s ({gpu}; "
        f"a stated MFU, not a measured one: costs.mfu, costs.peak_flops)",
        f"  FLOPs per token 6 (N + V D) + 12 n_layer T D, {', '.join(vocab)}; depth attention's own FLOPs "
        "left out (under 1%)",
    ]
    labels = _labels([o for o, _ in priced])
    width = max(len(label) for label in labels)
    lines.append(f"  {'job':<{width}}  {'N':>7}  {'tokens':>7}  {'FLOPs':>8}  {'GPU-hours':>9}  {'GPUs':>4}  "
                 f"{'wall hours':>10}")
    for label, row, h, (_, cfg) in zip(labels, rows, hours, priced, strict=True):
        gpus = job_gpus(cfg)
        lines.append(f"  {label:<{width}}  {_human(row['non_embedding_parameters']):>7}  {_human(row['tokens']):>7}  "
                     f"{row['flops']:>8.2e}  {h:>9,.1f}  {gpus:>4}  {h / gpus:>10,.1f}")
    return lines
