"""What a tuned sweep (`attnres.sweep.tuned`) does before its first run: the refusals, each one line
(exit 2) with the fix, the sweep folder left as it was (`unlock_if_untouched`), and the start line
that says what will run and, for an experiment that prices its runs (`costs:`), its GPU-hours.

Functions of the sweeper (a `TunedSweeper`), as `tuned_optuna.py`'s are: this module imports
nothing of `tuned.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.config.errors import ConfigError
from attnres.results.summary import overrides_by_key
from attnres.sweep import on_demand, tuned_given, tuned_proxy

#: what a run's metrics.json holds (attnres/training/lit.py logs them); eval.tasks adds <task>/<metric>
RUN_METRICS = ("val/loss", "val/bpb", "val/accuracy", "train/loss", "train/bpb")

_ABSENT = object()


def check(sweeper: Any, jobs: list[list[str]]) -> None:
    """The refusals before anything runs, each one line (exit 2)."""
    if sweeper.problems:
        raise ConfigError(sweeper.problems[0])
    if sweeper.method not in ("grid", "optuna", tuned_given.METHOD):
        raise ConfigError(f"hydra.sweeper.method={sweeper.method} is not a search method; use grid or optuna (or "
                          "given: each arm's values from hydra.sweeper.given, no search)")
    if sweeper.method == tuned_given.METHOD:
        tuned_given.check_settings(sweeper.given)
    elif sweeper.given:  # else the values would be ignored and a search would run in their place
        raise ConfigError(f"hydra.sweeper.given is set, but hydra.sweeper.method={sweeper.method} searches; add "
                          "hydra.sweeper.method=given to run each arm at its given values, or drop hydra.sweeper.given")
    if not sweeper.tuning_seeds:
        raise ConfigError("hydra.sweeper.tuning_seeds is empty; give the search at least one seed, "
                          "e.g. hydra.sweeper.tuning_seeds=[1000,1001]")
    verdict = {s for job in jobs for s in job_seeds(job)} or {int(sweeper.config.seed)}
    shared = sorted(verdict & set(sweeper.tuning_seeds))
    if shared:
        raise ConfigError(
            f"seed {', '.join(map(str, shared))} is both a tuning seed and a verdict seed: a verdict must not "
            "read the runs its arms were chosen on; pick verdict seeds outside hydra.sweeper.tuning_seeds="
            f"{sweeper.tuning_seeds}, or set hydra.sweeper.tuning_seeds to other seeds")
    if sweeper.method == "grid":
        points, factor, extend = sweeper.grid["points"], sweeper.grid["factor"], sweeper.grid["max_extend"]
        if not isinstance(points, int) or points < 1 or points % 2 == 0:
            raise ConfigError(f"hydra.sweeper.grid.points={points} must be an odd number of points (the "
                              "configured value in the middle), e.g. 5")
        if not isinstance(factor, (int, float)) or factor <= 1:
            raise ConfigError(f"hydra.sweeper.grid.factor={factor} must be above 1, e.g. 2")
        if not isinstance(extend, int) or extend < 0:
            raise ConfigError(f"hydra.sweeper.grid.max_extend={extend} must be 0 or more, e.g. 3")
        if not sweeper.grid["keys"]:
            raise ConfigError("hydra.sweeper.grid.keys is empty; name the keys to search, "
                              "e.g. hydra.sweeper.grid.keys=[optim.optimizer.lr]")
        for key, value in sweeper.grid["centre"].items():
            if key not in sweeper.grid["keys"]:
                raise ConfigError(f"hydra.sweeper.grid.centre names {key}, which the grid does not search; "
                                  f"centre one of hydra.sweeper.grid.keys={list(sweeper.grid['keys'])}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"hydra.sweeper.grid.centre.{key}={value} must be a number above 0 (the "
                                  "value in the grid's middle), e.g. hydra.sweeper.grid.centre={" + key +
                                  ":0.001}")
    from attnres.sweep.tuned_halving import check_prune

    check_prune(sweeper.prune, sweeper.method)
    if sweeper.method == "optuna":
        from attnres.sweep.tuned_optuna import check_settings

        check_settings(sweeper)
    check_proxy_keys(sweeper)
    if tuned_proxy.fractions(sweeper.proxy_settings):
        for key in (k for job in jobs for k in overrides_by_key(job)):
            if key.lstrip("+~") in tuned_proxy.TARGET_KEYS:
                raise ConfigError(f"{key} is set by hydra.sweeper.proxy's width or depth fraction (the proxy is "
                                  f"every job's muP base); leave {key}=... out")
    searched = sweeper.searched_keys()
    groups = set(sweeper.config.hydra.runtime.choices or {})
    for job in jobs:
        for key in overrides_by_key(job):
            if key.lstrip("+~") in groups:
                continue  # optim=adamw,muon picks configs, each with its own value to centre on
            if key.lstrip("+~") in searched or any(key.startswith(f"{k}.") or k.startswith(f"{key}.")
                                                   for k in searched):
                raise ConfigError(f"{key} is both searched (hydra.sweeper) and set on the command line; "
                                  f"leave {key}=... out, or search other keys (hydra.sweeper.grid.centre="
                                  "{" + f"{key.lstrip('+~')}:VALUE" + "} centres the grid on a value)")


def check_proxy_keys(sweeper: Any) -> None:
    """Each proxy key a fraction, or a config key or group the search sets: else one line with a
    "did you mean" (`+hydra.sweeper.proxy.widht=0.25` would fail inside Hydra's composition)."""
    import difflib

    groups = set(sweeper.config.hydra.runtime.choices or {})
    for key in sweeper.proxy:
        head = key.split(".", 1)[0]
        if key in groups or (head in sweeper.config and OmegaConf.select(sweeper.config, key, default=_ABSENT)
                             is not _ABSENT):
            continue
        known = [*tuned_proxy.FRACTIONS, *sorted(groups), *(str(k) for k in sweeper.config if k != "hydra")]
        close = difflib.get_close_matches(key, known, n=1)
        maybe = f" (did you mean hydra.sweeper.proxy.{close[0]}?)" if close else ""
        raise ConfigError(f"hydra.sweeper.proxy.{key} is not a proxy setting{maybe}; the proxy takes width and "
                          "depth (fractions of the target's heads and layers) and config keys or groups the search "
                          "alone runs with, e.g. +hydra.sweeper.proxy.size=194m")


def check_answerable(sweeper: Any, arms: Sequence[Mapping[str, Any]], cfg: DictConfig) -> None:
    """The metric is one the runs write, and a baseline given by name is an arm that others are
    compared with: else the whole search would run to end with no verdict."""
    import difflib

    tasks = OmegaConf.select(cfg, "eval.tasks", default=None)
    head = sweeper.metric.split("/", 1)[0]
    if sweeper.metric not in RUN_METRICS and not (tasks and "/" in sweeper.metric and head not in ("val", "train")):
        close = difflib.get_close_matches(sweeper.metric, RUN_METRICS, n=1)
        maybe = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"hydra.sweeper.metric={sweeper.metric} is not a metric the runs write{maybe}; choose one "
                          f"of {', '.join(RUN_METRICS)} (or <task>/<metric> of eval.tasks)")
    if sweeper.baseline is None:
        return
    key, value = sweeper.baseline_spec()
    values = sorted({a["baseline_value"] for a in arms})
    given = f"hydra.sweeper.baseline={sweeper.baseline}"
    if value not in values:
        raise ConfigError(f"{given} matches no arm: every arm has {key}={' or '.join(values)}; name one of "
                          f"those, e.g. hydra.sweeper.baseline={key}:{values[0]}")
    if len(arms) > 1 and not any(a["baseline"] for a in arms):
        raise ConfigError(f"{given}: no arm differs from it in {key} alone (every arm has {key}="
                          f"{' or '.join(values)}); sweep {key} on the command line (e.g. {key}={value},...), or "
                          "name the key the arms differ in, e.g. hydra.sweeper.baseline=residual:standard")


def announce(sweeper: Any, state: Mapping[str, Any]) -> None:
    """The start line: the arms, the search's and the verdict's runs, and their GPU-hours when priced."""
    groups, arms = state["groups"], state["arms"]
    seeds = sorted({s for a in arms for s in a["seeds"]})
    verdict_runs = on_demand.planned_runs(sweeper.config, len(arms)) or \
        f"{sum(len(a['seeds']) for a in arms)} runs on seeds {', '.join(map(str, seeds))}"
    if sweeper.method == tuned_given.METHOD:
        print(f"tuned sweep: {len(arms)} arm{'s' * (len(arms) != 1)}; no search (hydra.sweeper.method=given): "
              f"{tuned_given.describe(groups)}; verdict: {verdict_runs}"
              + (", and as many at the configured values (untuned=true)" if sweeper.untuned else ""), flush=True)
        verdict = _verdict_hours(sweeper, arms)
        if verdict is not None:
            print(f"  about {verdict} of verdict runs (costs.mfu, costs.peak_flops)", flush=True)
        return
    if sweeper.method == "grid":
        per = sweeper.grid["points"] * len(sweeper.tuning_seeds)
        how = (f"{sweeper.grid['points']}-point log grid (factor {sweeper.grid['factor']:g}) of "
               f"{', '.join(sweeper.grid['keys'])}, up to {sweeper.grid['max_extend']} more points a side at an edge")
    else:
        per = int(sweeper.optuna.get("trials", 12)) * len(sweeper.tuning_seeds)
        how = f"Optuna ({sweeper.optuna.get('sampler', 'tpe')}), {sweeper.optuna.get('trials', 12)} trials of " + \
              ", ".join(sweeper.searched_keys())
    proxy = f" at {', '.join(f'{k}={v}' for k, v in sweeper.proxy.items())}" if sweeper.proxy else ""
    if groups and groups[0].get("narrow"):
        proxy += (" at " if not sweeper.proxy else ", ") + tuned_proxy.describe(groups[0]["narrow"]) + \
            " (every job then runs under muP with it as its base)"
    what = f"{len(arms)} arm{'s' * (len(arms) != 1)}" if len(arms) == len(groups) else \
        f"{len(arms)} configurations, {len(groups)} arms"
    share, pruned = _pruned_share(sweeper, groups)
    print(f"tuned sweep: {what}; search{proxy}: {how}, on tuning seeds "
          f"{', '.join(map(str, sweeper.tuning_seeds))}: {per * len(groups)} runs ({per} per arm){pruned}; verdict: "
          f"{verdict_runs}"
          + (", and as many at the configured values (untuned=true)" if sweeper.untuned else ""), flush=True)
    hours = _gpu_hours([sweeper.compose(sweeper.trial_overrides(g, {}, sweeper.tuning_seeds[0])) for g in groups])
    if hours is not None:
        verdict = _verdict_hours(sweeper, arms)
        full = _gpu_hours([sweeper.compose([*a["overrides"], f"seed={sweeper.tuning_seeds[0]}"]) for a in arms]) \
            if sweeper.proxy_settings else None
        against = f" (the same search at every configuration's full size: {full * per:,.1f})" if full else ""
        print(f"  about {hours * per * share:,.1f} GPU-hours of search trials{against} (more if a grid grows), and "
              f"{verdict or '0.0 GPU-hours'} of verdict runs (costs.mfu, costs.peak_flops)", flush=True)


def _verdict_hours(sweeper: Any, arms: Sequence[Mapping[str, Any]]) -> str | None:
    """`12.3 GPU-hours` of the verdict's runs when the experiment prices them, else None; with seeds on
    demand, the first look's and the most the design may run (`seeds.max` a configuration)."""
    design = on_demand.design_of(sweeper.config)
    if design is None:
        hours = _gpu_hours([sweeper.compose([*a["overrides"], f"seed={s}"]) for a in arms for s in a["seeds"]])
        return None if hours is None else f"{hours:,.1f} GPU-hours"
    one = _gpu_hours([sweeper.compose([*a["overrides"], f"seed={design['first']}"]) for a in arms])
    if one is None:
        return None
    first = len(on_demand.next_seeds(design, 0))
    return f"{one * first:,.1f} GPU-hours for the first look, up to {one * design['max']:,.1f} GPU-hours at seeds.max"


def _pruned_share(sweeper: Any, groups: Sequence[Mapping[str, Any]]) -> tuple[float, str]:
    """The share of the unpruned grid's training steps that successive halving trains (at the grid's
    first size), and the start line's words for it; (1.0, "") unpruned."""
    from attnres.sweep.tuned_halving import trained_steps

    if not sweeper.prune["rungs"] or not groups:
        return 1.0, ""
    points, keep, steps = int(sweeper.grid["points"]), float(sweeper.prune["keep"]), groups[0]["rung_steps"]
    share = trained_steps(points, steps, keep) / (points * steps[-1])
    grows = ", up to more if a grid grows" if int(sweeper.grid["max_extend"]) else ""
    return share, (f", pruned by successive halving at steps {', '.join(map(str, steps[:-1]))} of {steps[-1]} "
                   f"keeping {keep:g} of the points at each, the same for every arm: the training steps of "
                   f"{share * per_arm(sweeper):,.1f} full runs per arm ({share:.0%} of the unpruned grid{grows})")


def per_arm(sweeper: Any) -> int:
    return int(sweeper.grid["points"]) * len(sweeper.tuning_seeds)


def _gpu_hours(configs: Sequence[DictConfig]) -> float | None:
    """The GPU-hours of runs of these configs when their experiment prices them (`costs:`), else None."""
    from attnres.config import costs

    priced = [c for c in configs if OmegaConf.select(c, "costs") is not None]
    if not priced:
        return None
    built: dict[str, int] = {}
    return sum(costs.job_cost(c, built)["flops"] / (float(c.costs.mfu) * float(c.costs.peak_flops)) / 3600
               for c in priced) / len(priced) * len(configs)


def unlock_if_untouched(sweep_dir: Path) -> None:
    """Drop this process's lock on a sweep folder that holds nothing else, and the folder itself with
    the parents it made empty (up to the current folder): a refused sweep leaves nothing behind."""
    import os

    from attnres.sweep import slots

    key = str(sweep_dir.resolve()) if sweep_dir.exists() else None
    if key not in slots._sweep_locks or {p.name for p in sweep_dir.iterdir()} != {slots.SWEEP_LOCK}:
        return
    (sweep_dir / slots.SWEEP_LOCK).unlink(missing_ok=True)  # unlinked before it is unlocked: no one else takes it
    os.close(slots._sweep_locks.pop(key))
    cwd, folder = Path.cwd().resolve(), sweep_dir.resolve()
    try:
        folder.rmdir()
    except OSError:
        return
    folder = folder.parent
    while folder != cwd and cwd in folder.parents:  # multirun/ of multirun/<name>, when made for it
        try:
            folder.rmdir()  # only when empty
        except OSError:
            break
        folder = folder.parent


def seed_list(value: Any, problems: list[str]) -> list[int]:
    """`tuning_seeds` as a list of ints; a problem recorded (and the default kept) when it is not one."""
    if isinstance(value, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        return [int(s) for s in value]
    shown = "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else value
    problems.append(f"hydra.sweeper.tuning_seeds={shown} is not a list of integer seeds; "
                    "e.g. hydra.sweeper.tuning_seeds=[1000,1001]")
    return [1000, 1001]


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def job_seeds(job: Sequence[str]) -> list[int]:
    found = []
    for o in job:
        if override_key(o) == "seed":
            try:
                found.append(int(o.split("=", 1)[1]))
            except ValueError as err:
                raise ConfigError(f"{o}: a seed is an integer; e.g. seed=0,1,2") from err
    return found
