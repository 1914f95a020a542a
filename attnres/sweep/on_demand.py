"""Seeds on demand (`seeds.on_demand=true`, docs/sweeps.md#seeds-on-demand): a sweep that adds seeds
in batches until every comparison is resolved, or its planned maximum is reached.

`attnres-run -m residual=standard,block seeds.on_demand=true` runs every arm (each combination of the
swept keys; `seed` is not swept: the design picks the seeds) on seeds `first` .. `first + start - 1`,
then reads the verdicts; while one is not resolved (verdict.RESOLVED: better or worse by the margin or
by less than it, or equivalent within it) it adds the next `batch` seeds to every arm, up to `max`.
Each look's intervals are the repeated confidence intervals of the group-sequential design in
attnres.results.sequential (O'Brien-Fleming-type alpha spending over `max` seeds), whose error rate
holds whichever look the sweep stops at; reading a fixed-n interval after every batch would not.

Each look is one batch through the configured launcher (`launch`: the parallel slots or SLURM; in a
tuned sweep, the tuned sweeper's verdict stage, `tuned_looks`), so dedup, resume, Ctrl-C and SIGTERM
work as in any sweep: a stopped look adds no more. `<sweep>/seeds.json` records the design and each
look's seeds before the look runs: a resumed sweep (`resume=true`) runs the recorded looks' seeds again
(the finished ones are skipped), never different ones, and a resume whose design changed is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.atomic import write_json
from attnres.config.errors import ConfigError
from attnres.results import sequential, verdict
from attnres.results.summary import collect_rows, primary_metric
from attnres.sweep import plan, stopping

log = logging.getLogger(__name__)


def design_of(config: DictConfig) -> dict[str, Any] | None:
    """The design of `seeds:` (checked by attnres.config.on_demand), or None without seeds on demand."""
    node = OmegaConf.select(config, "seeds", default=None)
    if node is None or not node.get("on_demand"):
        return None
    return {key: (float if key == "alpha" else int)(node[key]) for key in sequential.DESIGN_FIELDS}


def next_seeds(design: dict[str, Any], looks: int) -> list[int]:
    """The seeds look number `looks` (0-based) adds: `start` first, then `batch` at a time up to `max`."""
    done = 0 if looks == 0 else design["start"] + design["batch"] * (looks - 1)
    end = min(design["start"] if looks == 0 else done + design["batch"], design["max"])
    return list(range(design["first"] + done, design["first"] + end))


def seeds_of(record: dict[str, Any]) -> list[int]:
    return [int(s) for look in record.get("looks", []) for s in look]


def begin(sweep_dir: Path, design: dict[str, Any], config: DictConfig) -> dict[str, Any]:
    """The record to continue: a resumed sweep's, checked against this design, else a new one."""
    before = sequential.read_record(sweep_dir)
    if before.get("design") and config.get("resume") and not config.get("overwrite"):
        changed = [f"seeds.{k}={before['design'].get(k)} -> {design[k]}" for k in sequential.DESIGN_FIELDS
                   if before["design"].get(k) != design[k]]
        if changed:
            raise ConfigError(f"the design of seeds on demand changed since this sweep started in {sweep_dir}: "
                              f"{', '.join(changed)}; resume it with the settings it started with, or pass "
                              "name=<new name> (overwrite=true starts it again)")
        return {**before, "stopped": None}
    return {"design": design, "looks": [], "final": False, "stopped": None}


def outcome(record: dict[str, Any], found: Sequence[verdict.Comparison]) -> str | None:
    """Why the sweep stops after its last look, or None when it adds seeds."""
    seeds, looks = len(seeds_of(record)), len(record["looks"])
    open_ = [f"{c.label} vs {c.baseline or 'standard'}" for c in found if c.verdict not in verdict.RESOLVED]
    if not open_:
        why = "every comparison resolved" if found else "no comparison to resolve (no baseline arm)"
        return f"stopped at {seeds} seeds (look {looks}): {why}"
    if record["final"]:
        return (f"reached the maximum of {record['design']['max']} seeds (look {looks}): {', '.join(open_)} "
                "still not resolved")
    return None


def run_looks(sweep_dir: Path, config: DictConfig, launch: Callable[[list[int]], bool],
              compare: Callable[[dict[str, Any]], Sequence[verdict.Comparison]]) -> dict[str, Any]:
    """The loop: `launch(seeds)` runs every arm on those seeds (False: the sweep was stopped);
    `compare(record)` gives the comparisons with the design's intervals at the record's last look."""
    design = design_of(config)
    assert design is not None
    record = begin(sweep_dir, design, config)
    if record["looks"]:  # a resume: the recorded looks' seeds again (their finished jobs are skipped)
        log.info(f"seeds on demand: resuming at look {len(record['looks'])} ({len(seeds_of(record))} seeds)")
        if not launch(seeds_of(record)):
            return _stopped(sweep_dir, record)
    while True:
        if record["looks"]:
            record["stopped"] = outcome(record, compare(record))
            if record["stopped"]:
                write_json(sweep_dir / sequential.RECORD, record)
                log.info(f"seeds on demand: {record['stopped']}")
                return record
        seeds = next_seeds(design, len(record["looks"]))
        record["looks"].append(seeds)
        record["final"] = seeds[-1] >= design["first"] + design["max"] - 1
        write_json(sweep_dir / sequential.RECORD, record)  # before the look runs: a resume runs these seeds
        log.info(f"seeds on demand: look {len(record['looks'])}, seeds {seeds[0]}-{seeds[-1]}")
        if not launch(seeds):
            return _stopped(sweep_dir, record)


def _stopped(sweep_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    sig = stopping.stopped_by.name if stopping.stopped_by is not None else "a stop"
    record["stopped"] = (f"stopped by {sig} during look {len(record['looks'])} ({len(seeds_of(record))} seeds "
                         "planned): resume=true continues it")
    write_json(sweep_dir / sequential.RECORD, record)
    return record


# -- plain sweeps: the launcher's hook ---------------------------------------------------------------------
def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def arms_of(job_overrides: Sequence[Sequence[str]]) -> list[list[str]]:
    """The sweep's arms (its jobs without a seed), in order; a swept or set seed is refused."""
    arms: list[list[str]] = []
    for job in job_overrides:
        if any(_key(o) == "seed" for o in job):
            raise ConfigError("seeds.on_demand=true picks the seeds itself (seeds.first, seeds.start, seeds.batch, "
                              "seeds.max); leave seed=... out of the command line")
        if list(job) not in arms:
            arms.append(list(job))
    return arms


def plain_comparisons(sweep_dir: Path, config: DictConfig, record: dict[str, Any]) -> list[verdict.Comparison]:
    """The verdicts of the sweep's runs so far, with the design's repeated intervals."""
    rows = collect_rows(sweep_dir, only=plan.sweep_jobs.get(plan.folder_key(sweep_dir)) or None)
    margin = verdict.Margin.from_config(OmegaConf.select(config, "verdict", default=None))
    found = verdict.comparisons(rows, primary_metric(rows), margin) if rows else []
    return list(sequential.apply(found, record))


def launch(launcher: Any, sweep_dir: Path, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
           launch_batch: Callable[[Path, Sequence[Sequence[str]], int], Any]) -> Any:
    """A launcher's `_launch`: one batch (`launch_batch`), or, for a plain sweep with seeds on demand,
    a batch per look. A tuned sweep's stages are batches: its sweeper runs the looks (`tuned_looks`)."""
    sweeper = str(OmegaConf.select(launcher.config, "hydra.sweeper._target_", default=""))
    if design_of(launcher.config) is None or not sweeper.endswith("BasicSweeper"):
        if launcher.config.get("overwrite"):  # an earlier design's record must not judge the new runs
            (sweep_dir / sequential.RECORD).unlink(missing_ok=True)
        return launch_batch(sweep_dir, job_overrides, initial_job_idx)
    arms = arms_of(job_overrides)
    results: list[Any] = []
    index = [initial_job_idx]

    def run(seeds: list[int]) -> bool:
        batch = [[*arm, f"seed={seed}"] for seed in seeds for arm in arms]
        results.extend(launch_batch(sweep_dir, batch, index[0]) or [])
        index[0] += len(batch)
        return stopping.stopped_by is None

    run_looks(sweep_dir, launcher.config, run, lambda record: plain_comparisons(sweep_dir, launcher.config, record))
    return results


# -- tuned sweeps: the tuned sweeper's hooks ----------------------------------------------------------------
def check_tuned(sweeper: Any, jobs: Sequence[Sequence[str]]) -> None:
    """Before the search: seeds on demand's seeds are verdict seeds, never the search's."""
    design = design_of(sweeper.config)
    if design is None:
        return
    arms_of(jobs)  # no seed on the command line
    seeds = set(range(design["first"], design["first"] + design["max"]))
    shared = sorted(seeds & {int(s) for s in sweeper.tuning_seeds})
    if shared:
        raise ConfigError(f"seed {', '.join(map(str, shared))} is both a tuning seed and one seeds on demand may add "
                          f"(seeds.first={design['first']} to {design['first'] + design['max'] - 1}): a verdict must "
                          "not read the runs its arms were chosen on; move seeds.first or hydra.sweeper.tuning_seeds")


def tuned_looks(sweeper: Any, sweep_dir: Path, state: dict[str, Any]) -> None:
    """The tuned sweeper's verdict stage: once, or with seeds on demand once a look, each arm at its
    choice on the look's seeds (the verdict stage launches only the jobs this process has not)."""
    if design_of(sweeper.config) is None:
        if sweeper.config.get("overwrite"):  # an earlier design's record must not judge the new runs
            (sweep_dir / sequential.RECORD).unlink(missing_ok=True)
        sweeper.verdict_stage(sweep_dir, state)
        return
    from attnres.results.tuned_summary import tuned_comparisons

    def run(seeds: list[int]) -> bool:
        so_far = sorted(set(seeds_of(sequential.read_record(sweep_dir))) | set(seeds))
        for arm in state["arms"]:
            arm["seeds"] = so_far
        sweeper.verdict_stage(sweep_dir, state)
        return stopping.stopped_by is None

    def compare(current: dict[str, Any]) -> list[verdict.Comparison]:
        margin = verdict.Margin.from_config(OmegaConf.select(sweeper.config, "verdict", default=None))
        return list(sequential.apply(tuned_comparisons(sweep_dir, state, margin), current))

    run_looks(sweep_dir, sweeper.config, run, compare)


def planned_runs(config: DictConfig, arms: int) -> str | None:
    """The verdict's runs for a tuned sweep's start line under seeds on demand: the first look's, then
    the most the design may add (the arms' seeds are known only look by look); None without it."""
    design = design_of(config)
    if design is None:
        return None
    first, last = next_seeds(design, 0), design["first"] + design["max"] - 1
    then = (f"then {design['batch']} seed{'s' * (design['batch'] != 1)} a look while a verdict is not resolved, up "
            f"to {arms * design['max']} runs on seeds {first[0]}-{last}") if last > first[-1] else "no later look"
    return f"seeds on demand, {arms * len(first)} runs on seeds {', '.join(map(str, first))} first, {then}"


def summary_line(sweep_dir: Path) -> str | None:
    """The sweep's line on where seeds on demand stopped and why (SweepSummary prints it)."""
    record = sequential.read_record(sweep_dir)
    if not record.get("design") or not record.get("stopped"):
        return None
    return f"seeds on demand: {record['stopped']} ({sequential.describe(record['design'])})"
