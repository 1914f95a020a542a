"""`hydra.sweeper.prune`: successive halving in a tuned sweep's grid (`tune=lr`, `attnres.sweep.tuned`).

With `prune: {rungs: [0.25, 0.5], keep: 0.5}` every point of an arm's grid runs, on every tuning
seed, to the first rung (a quarter of `trainer.max_steps`, paused there with `stop_at_step`); the
best `ceil(keep * n)` points by their mean metric over the tuning seeds at that step continue (the
same folder, `resume=true`, the next `stop_at_step`), and so on to the full length. The arm's choice
is the best point at full length. Every arm uses the same rungs and keep fraction: that is what
keeps the search fair. A paused run continues exactly as if it had not paused (the learning-rate
schedule spans `trainer.max_steps` all along; tests/training/test_pause.py), so the rung values are
those of the unpruned run at the same steps.

The grid grows at an edge as it does unpruned, on the full-length choice: a grown point enters at
the first rung, and the points that continue at each rung are recomputed over all the arm's points.
Every decision is a function of the recorded rung values (`next_runs`), so a resumed sweep replays
them and runs only what is missing; the values of a killed sweep's rungs come back from its
tuning.json (`carry_rungs`). experiments/halving_replay.py replays the same rule on an unpruned
sweep's validation curves.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres.atomic import read_json
from attnres.config.errors import ConfigError
from attnres.results import tuning
from attnres.sweep.tuned_grid import grow_at_edge, record_choice

log = logging.getLogger(__name__)

FULL = None  # a rung's stop_at_step at the full length: no pause


# -- the rule (pure) ---------------------------------------------------------------------------------
def check_prune(prune: Mapping[str, Any], method: str) -> None:
    """One line (exit 2) for prune settings that halve nothing, or halve unevenly."""
    rungs, keep = prune.get("rungs") or [], prune.get("keep", 0.5)
    if not isinstance(rungs, (list, tuple)) or not all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                                      and 0 < r < 1 for r in rungs) \
            or any(b <= a for a, b in zip(rungs, rungs[1:], strict=False)):
        raise ConfigError(f"hydra.sweeper.prune.rungs={_show(rungs)} must be fractions of trainer.max_steps, strictly "
                          "increasing between 0 and 1, e.g. hydra.sweeper.prune.rungs=[0.25,0.5] ([] prunes nothing)")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep < 1:
        raise ConfigError(f"hydra.sweeper.prune.keep={keep} must be a fraction between 0 and 1 (the share of points "
                          "that continue at each rung), e.g. hydra.sweeper.prune.keep=0.5")
    if rungs and method != "grid":
        raise ConfigError(f"hydra.sweeper.prune works with method=grid; with method={method} leave "
                          "hydra.sweeper.prune.rungs empty ([]), or search with tune=lr")


def _show(value: Any) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


def rung_steps(rungs: Sequence[float], max_steps: int) -> list[int]:
    """The steps each rung pauses at, then `max_steps` (the full length); ConfigError when two
    rungs fall on one step, or a rung on step 0 or the last."""
    steps = [int(round(r * max_steps)) for r in rungs] + [max_steps]
    if steps[0] < 1 or len(set(steps)) != len(steps):
        raise ConfigError(f"hydra.sweeper.prune.rungs={_show(list(rungs))} of trainer.max_steps={max_steps} pause at "
                          f"steps {_show(steps[:-1])}: each rung needs a step of its own, 1 to {max_steps - 1}; "
                          "use fewer rungs, or more steps")
    return steps


def _rank(point: Hashable, mean: float) -> tuple:
    return (mean, abs(point) if isinstance(point, int) else 0, str(point))  # ties as tuning.best_point


def rung_mean(values: Sequence[float]) -> float:
    return math.inf if any(not math.isfinite(v) for v in values) else statistics.fmean(values)


def next_runs(points: Sequence[Hashable], values: Mapping[tuple[Hashable, int], Mapping[int, float]],
              seeds: Sequence[int], steps: Sequence[int], keep: float) -> tuple[list[tuple[Hashable, int]], list]:
    """Successive halving over `points`, from the values recorded so far (`values[(point, seed)][step]`):
    ([(point, step)] still to run to that step, []) while a rung lacks a value, else ([], the points
    that reached the full length). At each rung the best ceil(keep * n) of the n points that reached
    it continue, ranked by their mean over `seeds` (ties: the point nearer the configured value)."""
    alive = list(points)
    for i, step in enumerate(steps):
        missing = [p for p in alive if any(step not in values.get((p, s), {}) for s in seeds)]
        if missing:
            return [(p, step) for p in missing], []
        if i == len(steps) - 1:
            return [], alive
        means = {p: rung_mean([values[(p, s)][step] for s in seeds]) for p in alive}
        alive = sorted(alive, key=lambda p: _rank(p, means[p]))[:math.ceil(keep * len(alive))]
    return [], alive


def full_length_means(alive: Sequence[Hashable], values: Mapping[tuple[Hashable, int], Mapping[int, float]],
                      seeds: Sequence[int], last: int) -> dict[Hashable, float]:
    return {p: rung_mean([values[(p, s)][last] for s in seeds]) for p in alive}


def trained_steps(n_points: int, steps: Sequence[int], keep: float) -> int:
    """Steps one seed's trials of an n-point grid train under the rule: n to the first rung, the kept
    ceil(keep * n) on to the next, and so on (the unpruned grid: n * steps[-1])."""
    total, alive, before = 0, n_points, 0
    for i, step in enumerate(steps):
        total += alive * (step - before)
        before = step
        if i < len(steps) - 1:
            alive = math.ceil(keep * alive)
    return total


# -- the search (the sweeper's) ----------------------------------------------------------------------
def carry_rungs(before: Mapping[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """A resumed sweep's rung values, from the tuning.json it left: a trial folder that went on past a
    rung no longer says what it measured there."""
    old = {g.get("label"): g for g in before.get("groups", [])}
    for group in groups:
        group["trials"] = [{k: t[k] for k in ("point", "seed", "values", "job", "rungs") if k in t}
                           for t in (old.get(group["label"]) or {}).get("trials", []) if t.get("rungs")]


def _values(group: Mapping[str, Any]) -> dict[tuple[Hashable, int], dict[int, float]]:
    return {(t["point"], t["seed"]): {int(s): (math.inf if v is None else float(v)) for s, v in t["rungs"].items()}
            for t in group["trials"]}


def halving_search(sweeper: Any, sweep_dir: Path, state: dict[str, Any]) -> bool:
    """Stage 1 with method=grid and prune rungs; False when stopped."""
    points, factor, extend = int(sweeper.grid["points"]), float(sweeper.grid["factor"]), int(sweeper.grid["max_extend"])
    keep, seeds = float(sweeper.prune["keep"]), sweeper.tuning_seeds
    for group in state["groups"]:
        group.update(extended={"down": 0, "up": 0})
        group.setdefault("trials", [])
        for trial in group["trials"]:
            trial.setdefault("rungs", {})
    while True:
        batch, pending = [], []
        for group in state["groups"]:
            group["exponents"] = tuning.grid_range(points, group["extended"]["down"], group["extended"]["up"])
            todo, _ = next_runs(group["exponents"], _values(group), seeds, group["rung_steps"], keep)
            by_key = {(t["point"], t["seed"]): t for t in group["trials"]}
            for point, step in todo:
                values = {key: tuning.scaled(v, factor ** point) for key, v in group["centre"].items()}
                for seed in seeds:
                    trial = by_key.get((point, seed))
                    if trial is not None and str(step) in trial["rungs"]:
                        continue
                    first = trial is None or not trial["rungs"]
                    overrides = _rung_overrides(sweeper, group, values, seed, step, first)
                    if trial is None:
                        trial = {"point": point, "seed": seed, "values": values, "job": sweeper.run_dir(overrides)[0],
                                 "rungs": {}}
                        group["trials"].append(trial)  # recorded before it runs: a sweep killed mid-batch names it
                    trial.update(status="unfinished", reaching=step)
                    batch.append(overrides)
                    pending.append((trial, step, overrides))
        if batch:
            log.info(f"tuned sweep: search, {len(batch)} trial runs (successive halving)")
            tuning.write_state(sweep_dir, state)
            ok = sweeper.launch_trials(batch)
            for trial, step, overrides in pending:
                found = sweeper.trial_result(overrides)
                trial.update({k: v for k, v in found.items() if k != "job"})
                folder = sweep_dir / (found.get("same_as") or found["job"])
                # a trial the stopped sweep never continued still holds its earlier rung's metrics
                if found["status"] == "diverged" or found["status"] == "finished" and \
                        read_json(folder / "metrics.json").get("steps") == step:
                    _record(trial, step, found, group_steps(state, trial))
            tuning.write_state(sweep_dir, state)
            if not ok:
                return False
            continue
        if not _grow(state, seeds, keep, extend):
            break
    for group in state["groups"]:
        _choose(group, seeds, keep, factor)
    tuning.write_state(sweep_dir, state)
    return True


def group_steps(state: Mapping[str, Any], trial: Mapping[str, Any]) -> list[int]:
    return next(g["rung_steps"] for g in state["groups"] if any(t is trial for t in g["trials"]))


def _record(trial: dict[str, Any], step: int, found: Mapping[str, Any], steps: Sequence[int]) -> None:
    """The trial's value at `step`; a diverged trial is the worst at every later rung too (it does not run on)."""
    if found["status"] == "diverged":
        for later in (s for s in steps if s >= step):
            trial["rungs"][str(later)] = None
    else:
        trial["rungs"][str(step)] = found["value"]


def _rung_overrides(sweeper: Any, group: Mapping[str, Any], values: Mapping[str, Any], seed: int, step: int,
                    first: bool) -> list[str]:
    """A trial's overrides to `step`: paused there unless it is the full length; a continuation
    resumes its folder (never `overwrite=true`, which would start it again)."""
    overrides = sweeper.trial_overrides(group, values, seed)
    stop = None if step == group["rung_steps"][-1] else step
    if not first:
        overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in ("resume", "overwrite")]
        overrides.insert(-1, "resume=true")
    overrides.insert(-1, f"stop_at_step={'null' if stop is None else stop}")
    return overrides


def _grow(state: Mapping[str, Any], seeds: Sequence[int], keep: float, extend: int) -> bool:
    """The grid grows a point on the side where an arm's full-length choice lies on its edge."""
    grew = False
    for group in state["groups"]:
        values = _values(group)
        _, alive = next_runs(group["exponents"], values, seeds, group["rung_steps"], keep)
        best = tuning.best_point(full_length_means(alive, values, seeds, group["rung_steps"][-1]))
        grew = grow_at_edge(group, best, extend, ", entering at the first rung") or grew
    return grew


def _choose(group: dict[str, Any], seeds: Sequence[int], keep: float, factor: float) -> None:
    values, last = _values(group), group["rung_steps"][-1]
    _, alive = next_runs(group["exponents"], values, seeds, group["rung_steps"], keep)
    means = full_length_means(alive, values, seeds, last)
    for trial in group["trials"]:  # stopped at a rung: no full-length value (means leave it out; tuning.png marks it)
        if str(last) not in trial["rungs"]:
            reached = max(map(int, trial["rungs"]), default=0)
            trial.update(status="pruned", pruned_at=reached, value=None)
    record_choice(group, means, factor)
    group["trained_steps"] = sum(max(map(int, t["rungs"]), default=0) for t in group["trials"])
