"""What a SLURM sweep asks for: the partition as `sinfo` tells, what the runs need, and a request
that fits the partition's nodes (checked before anything is submitted: a request no node can
meet is one line and exit 2, never an array PENDING forever).
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from attnres.config.errors import ConfigError

log = logging.getLogger(__name__)


# -- the partition, as sinfo tells ------------------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    name: str
    cpus: int  # per node (the largest node)
    mem_mb: int  # per node
    gpus: int  # per node
    max_time_min: float  # math.inf without a limit


def run_command(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def parse_time_limit(text: str) -> float:
    """sinfo's time limit (`infinite`, `D-HH:MM:SS`, `HH:MM:SS`, `MM:SS`, `MM`) in minutes."""
    text = text.strip()
    if text in ("infinite", "UNLIMITED", "n/a", ""):
        return math.inf
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    hours, minutes, seconds = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return (int(days or 0) * 24 + hours) * 60 + minutes + seconds / 60


def parse_gpus(gres: str) -> int:
    """GPUs per node from sinfo's GRES column (`gpu:4`, `gpu:a100:8(S:0-1)`, `(null)`)."""
    total = 0
    for item in gres.split(","):
        fields = re.sub(r"\(.*?\)", "", item).split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def read_partition(name: str | None) -> Partition:
    """The partition the jobs go to (the cluster's default when `name` is None), from `sinfo`."""
    if shutil.which("sinfo") is None:
        raise ConfigError("hydra/launcher=slurm needs SLURM's commands (sinfo, sbatch, squeue, sacct) on this "
                          "machine; run the sweep on a login node of the cluster, or drop hydra/launcher=slurm")
    try:
        out = run_command(["sinfo", "-h", "-o", "%P|%c|%m|%G|%l"])
    except subprocess.TimeoutExpired as err:
        raise ConfigError("sinfo did not answer within 30 s: the SLURM controller is down or unreachable; "
                          "try again, or ask the cluster's admins") from err
    if out.returncode != 0:
        said = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit status {out.returncode}"
        raise ConfigError(f"sinfo failed ({said}); the SLURM controller must answer before a sweep can be sent to it")
    rows: dict[str, list[list[str]]] = {}
    default = None
    for line in out.stdout.splitlines():
        fields = line.split("|")
        if len(fields) != 5:
            continue
        part = fields[0]
        if part.endswith("*"):
            part = default = part[:-1]
        rows.setdefault(part, []).append(fields)
    wanted = name or default
    if wanted not in rows:
        known = ", ".join(sorted(rows)) or "none"
        if name is None:
            raise ConfigError(f"this cluster has no default partition; pass hydra.launcher.partition=<one of: {known}>")
        raise ConfigError(f"hydra.launcher.partition={name} is not a partition of this cluster; "
                          f"pass one of: {known}")

    def number(text: str) -> int:
        return int(re.sub(r"\D.*$", "", text) or 0)

    found = rows[wanted]
    return Partition(
        name=wanted, cpus=max(number(f[1]) for f in found), mem_mb=max(number(f[2]) for f in found),
        gpus=max(parse_gpus(f[3]) for f in found), max_time_min=max(parse_time_limit(f[4]) for f in found),
    )


# -- what the runs need, and what is asked for -------------------------------------------------------
def run_needs(config: DictConfig, partition: Partition, cpus_per_process: int, mem_gb_per_process: float
              ) -> dict[str, Any]:
    """Resources one job of the sweep needs, from its config: the devices its trainer uses (a GPU
    only where the trainer asks for one, or under `auto` on a partition with GPUs), a CPU per
    process and per data-loading worker, memory per process. `processes` is per node."""
    trainer, data = config.get("trainer", {}), config.get("data", {})
    accelerator = str(trainer.get("accelerator", "auto"))
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and partition.gpus > 0)
    devices = trainer.get("devices", 1)
    if isinstance(devices, int) and devices > 0:
        processes = devices
    elif isinstance(devices, (list, tuple)):
        processes = len(devices)
    else:  # auto / -1: every device of the node
        processes = partition.gpus if gpu else 1
    workers = int(data.get("num_workers", 0) or 0)
    return {"gpus_per_node": processes if gpu else 0,
            "cpus_per_task": max(1, processes * (cpus_per_process + workers)),
            "mem_gb": max(1, math.ceil(processes * mem_gb_per_process)),
            "processes": processes, "gpu": gpu, "per_process_cpus": cpus_per_process + workers,
            "nodes": int(trainer.get("num_nodes", 1) or 1)}


def job_shape(params: dict[str, Any], needs: Sequence[dict[str, Any]], configs: Sequence[DictConfig]
              ) -> tuple[int, int]:
    """(tasks per node, nodes) of every job: what the launcher sets, else the runs' `trainer.devices`
    and `trainer.num_nodes` when all runs agree (one SLURM task per training process, started by
    srun), else one task whose Lightning starts the other processes itself (one node)."""
    shape = []
    for key, need in (("tasks_per_node", "processes"), ("nodes", "nodes")):
        value = params.get(key)
        wanted = {n[need] for n in needs}
        if value is None:
            value = wanted.pop() if len(wanted) == 1 else 1
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"hydra.launcher.{key}={value!r} must be a whole number >= 1, or null (from the runs' "
                              f"trainer.{'devices' if need == 'processes' else 'num_nodes'})")
        shape.append(value)
    tasks, nodes = shape
    if tasks > 1 or nodes > 1:  # each rank is a SLURM task: a run must not ask for another shape
        for config, need in zip(configs, needs, strict=True):
            devices = config.get("trainer", {}).get("devices", 1)
            if isinstance(devices, int) and devices > 1 and devices != tasks:
                raise ConfigError(f"trainer.devices={devices} but hydra.launcher.tasks_per_node={tasks}: each rank "
                                  f"is one SLURM task; pass hydra.launcher.tasks_per_node={devices} (or null), or "
                                  f"trainer.devices={tasks}")
            if need["nodes"] > 1 and need["nodes"] != nodes:
                raise ConfigError(f"trainer.num_nodes={need['nodes']} but hydra.launcher.nodes={nodes}; pass "
                                  f"hydra.launcher.nodes={need['nodes']} (or null)")
    for config in configs:  # the global batch is kept: it must divide over the ranks
        data = config.get("data", {})
        step, batch, block = data.get("tokens_per_step"), data.get("batch_size"), data.get("block_size")
        if isinstance(step, int) and isinstance(batch, int) and isinstance(block, int) and \
                step % (batch * block * tasks * nodes):
            raise ConfigError(f"data.tokens_per_step={step} does not divide over the job's {tasks * nodes} rank(s) x "
                              f"data.batch_size={batch} x data.block_size={block}: pass a multiple of "
                              f"{batch * block * tasks * nodes}, or change data.batch_size")
    return tasks, nodes


def fit_groups(params: dict[str, Any], configs: Sequence[DictConfig], partition: Partition
               ) -> list[tuple[list[int], dict[str, Any]]]:
    """The jobs grouped by the shape their runs ask for, each group with its fitted resources
    ([(indices into configs, params)], one SLURM job array each): where the launcher leaves
    `tasks_per_node` and `nodes` null and the runs differ in `trainer.devices` x `trainer.num_nodes`
    (experiment=paper_scaling: 8 GPUs for the small sizes, 16 for the large), each shape is its
    own group; otherwise one group of every job (`fit_resources`)."""
    if params.get("tasks_per_node") is not None or params.get("nodes") is not None:
        return [(list(range(len(configs))), fit_resources(params, configs, partition))]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, config in enumerate(configs):
        need = run_needs(config, partition, int(params.get("cpus_per_process") or 1),
                         float(params.get("mem_gb_per_process") or 4))
        groups.setdefault((need["processes"], need["nodes"]), []).append(i)
    return [(indices, fit_resources(params, [configs[i] for i in indices], partition))
            for indices in groups.values()]


def fit_resources(params: dict[str, Any], configs: Sequence[DictConfig], partition: Partition) -> dict[str, Any]:
    """`params` with the resources left null derived from the runs (capped to a node of the
    partition, with a warning), and those set by hand checked against it (ConfigError). A job of
    several tasks (`job_shape`) asks for a CPU share per task, and memory and GPUs per node."""
    params = dict(params)
    needs = [run_needs(c, partition, int(params.get("cpus_per_process") or 1),
                       float(params.get("mem_gb_per_process") or 4)) for c in configs]
    tasks, nodes = job_shape(params, needs, configs)
    params["tasks_per_node"], params["nodes"] = tasks, nodes
    if tasks > 1 or nodes > 1:  # one rank per task
        mem_per_process = float(params.get("mem_gb_per_process") or 4)
        needs = [{"gpus_per_node": tasks if n["gpu"] else 0, "cpus_per_task": max(1, n["per_process_cpus"]),
                  "mem_gb": max(1, math.ceil(tasks * mem_per_process))} for n in needs]
    if tasks > partition.cpus:
        raise ConfigError(f"hydra.launcher.tasks_per_node={tasks} is more than the {partition.cpus} CPUs of a node in "
                          f"partition {partition.name} (sinfo): each task needs one; pass fewer, or another "
                          "hydra.launcher.partition")
    have = {"gpus_per_node": partition.gpus, "cpus_per_task": partition.cpus // tasks,
            "mem_gb": partition.mem_mb // 1024}
    what = {"gpus_per_node": "GPUs", "cpus_per_task": "CPUs", "mem_gb": "GB of memory"}
    per_task = f" ({partition.cpus} CPUs shared by {tasks} tasks)" if tasks > 1 else ""
    for key in ("gpus_per_node", "cpus_per_task", "mem_gb"):
        value = params.get(key)
        if value is None:
            value = max(n[key] for n in needs)
            if key == "gpus_per_node" and value > have[key]:
                raise ConfigError(
                    f"the runs ask for {value} GPU(s) (trainer.accelerator={configs[0].trainer.get('accelerator')}) "
                    f"but a node of partition {partition.name} has {have[key]}; pass hydra.launcher.partition=<a GPU "
                    "partition>, or trainer.accelerator=cpu to train on the CPU")
            if value > have[key]:
                capped = max(1, have[key])
                log.warning(f"the runs would use {value} {what[key]} but a node of partition {partition.name} has "
                            f"{have[key]:g}: asking for {capped} (hydra.launcher.{key})")
                value = capped
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"hydra.launcher.{key}={value!r} must be a number >= 0, or null (derived from the runs)")
        elif value > have[key]:
            raise ConfigError(
                f"hydra.launcher.{key}={value:g} is more than the {have[key]:g} {what[key]} of a node in partition "
                f"{partition.name}{per_task if key == 'cpus_per_task' else ''} (sinfo): the jobs would never start; "
                f"pass hydra.launcher.{key}={have[key]:g} or less, null to derive it from the runs, or another "
                "hydra.launcher.partition")
        params[key] = value
    timeout = params.get("timeout_min")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 1:
        raise ConfigError(f"hydra.launcher.timeout_min={timeout!r} must be a whole number of minutes >= 1")
    if timeout > partition.max_time_min:
        raise ConfigError(f"hydra.launcher.timeout_min={timeout} is more than partition {partition.name}'s time "
                          f"limit of {partition.max_time_min:g} min (sinfo); pass "
                          f"hydra.launcher.timeout_min={int(partition.max_time_min)} or less")
    delay = params.get("signal_delay_s")
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0 or delay >= timeout * 60:
        raise ConfigError(f"hydra.launcher.signal_delay_s={delay!r} must be a whole number of seconds >= 0 and "
                          f"below the time limit ({timeout} min = {timeout * 60} s)")
    if tasks > 1 and params.get("gpus_per_node") and params["gpus_per_node"] != tasks:
        raise ConfigError(f"hydra.launcher.gpus_per_node={params['gpus_per_node']} but tasks_per_node={tasks}: each "
                          f"rank drives one GPU; pass hydra.launcher.gpus_per_node={tasks} (or null)")
    if params.get("gpus_per_node") == 0:
        params["gpus_per_node"] = None  # sbatch is never asked about GPUs for a CPU job
    return params


