"""`tune=optuna`: the search stage of a tuned sweep as an Optuna study per arm (the `tune` extra).

Ask-and-tell: each round asks every arm's study for up to `batch` trials, runs each on every
tuning seed through the sweep's launcher (parallel slots or SLURM: Optuna never launches
anything), and tells each trial the mean of its seeds' metric (+inf for a trial that diverged or
failed: the worst). Every arm gets the same number of trials. The studies live in
`<sweep>/tuning/optuna.db` (SQLite): a killed sweep resumed with `resume=true` keeps the trials it
told and re-runs the ones it had asked (the same values, so their run folders continue from their
checkpoints). The sampler is reseeded before each ask from `seed` and the number of trials so far,
so the values asked do not depend on where a search was interrupted.

We drive Optuna directly rather than through hydra-optuna-sweeper: its 1.3.0 release pins
optuna<3 and Hydra's development plugin optuna<5, while this works with a current Optuna, and the
trials run through our own launchers (slots, dedup, resume, SLURM arrays).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.config.errors import ConfigError, user_errors
from attnres.results import tuning

SAMPLERS = ("tpe", "random")


def check_space(space: Any) -> dict[str, dict[str, Any]]:
    """The search space, each key one of {low, high[, log, int, relative]} or {choices}; else ConfigError."""
    if not isinstance(space, Mapping) or not space:
        raise ConfigError("hydra.sweeper.optuna.space is empty; give each searched key a range, e.g. "
                          "'+hydra.sweeper.optuna.space={optim.optimizer.lr:{low:1e-4,high:1e-2,log:true}}'")
    for key, spec in space.items():
        ok = isinstance(spec, Mapping) and (
            ("choices" in spec and isinstance(spec["choices"], list) and spec["choices"])
            or (isinstance(spec.get("low"), (int, float)) and isinstance(spec.get("high"), (int, float))
                and spec["low"] < spec["high"] and (not spec.get("log") or spec["low"] > 0)))
        if not ok:
            raise ConfigError(f"hydra.sweeper.optuna.space.{key}={spec} is not a range; give {{low: L, high: H}} "
                              "with L < H (and L > 0 with log: true), or {choices: [a, b, ...]}")
    return {str(k): dict(v) for k, v in space.items()}


def suggest(trial: Any, key: str, spec: Mapping[str, Any]) -> Any:
    if "choices" in spec:
        return trial.suggest_categorical(key, list(spec["choices"]))
    if spec.get("int") and not spec.get("relative"):
        return trial.suggest_int(key, int(spec["low"]), int(spec["high"]), log=bool(spec.get("log")))
    return trial.suggest_float(key, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")))


def values_of(sweeper: Any, params: Mapping[str, Any], cfg: DictConfig) -> dict[str, Any]:
    """A trial's (or the choice's) config values for one job: a relative parameter times that
    job's configured value, an absolute one as it is."""
    space = sweeper.optuna.get("space") or {}
    found = {}
    for key, param in params.items():
        spec = space.get(key, {})
        if spec.get("relative"):
            configured = OmegaConf.select(cfg, key, default=None)
            if isinstance(configured, (int, float)) and not isinstance(configured, bool):
                value = tuning.scaled(configured, float(param))
                found[key] = int(round(value)) if spec.get("int") else value
        else:
            found[key] = param
    return found


def _sampler(optuna: Any, name: str, seed: int) -> Any:
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def check_settings(sweeper: Any) -> tuple[dict[str, dict[str, Any]], int, int, str, int]:
    """The study's settings (space, trials per arm, batch, sampler, seed), or ConfigError naming the
    one to fix; also when Optuna is not installed. Called before anything of the sweep is written."""
    try:
        import optuna  # noqa: F401
    except ImportError as err:
        raise ConfigError("tune=optuna needs Optuna, which is not installed; pip install 'attnres[tune]' "
                          "(or tune=lr, a grid without it)") from err
    space = check_space(sweeper.optuna.get("space"))
    per_arm, batch_size, seed = (_integer(sweeper.optuna, key, default)
                                 for key, default in (("trials", 12), ("batch", 4), ("seed", 0)))
    name = str(sweeper.optuna.get("sampler", "tpe"))
    if per_arm < 1 or batch_size < 1:
        raise ConfigError(f"hydra.sweeper.optuna.trials={per_arm} and batch={batch_size} must be 1 or more")
    if name not in SAMPLERS:
        raise ConfigError(f"hydra.sweeper.optuna.sampler={name} is not one of {', '.join(SAMPLERS)}")
    return space, per_arm, batch_size, name, seed


def _integer(settings: Mapping[str, Any], key: str, default: int) -> int:
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"hydra.sweeper.optuna.{key}={value} is not an integer; e.g. hydra.sweeper.optuna.{key}="
                          f"{default}")
    return value


def optuna_search(sweeper: Any, sweep_dir: Path, state: dict[str, Any]) -> bool:
    """Stage 1 with method=optuna; False when the sweep was stopped."""
    import optuna

    with user_errors():
        space, per_arm, batch_size, name, seed = check_settings(sweeper)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (sweep_dir / tuning.TUNING_DIR).mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(sweep_dir / tuning.TUNING_DIR / 'optuna.db').resolve()}"
    seeds = sweeper.tuning_seeds
    studies = {g["label"]: optuna.create_study(study_name=g["label"], storage=storage, direction="minimize",
                                               load_if_exists=True) for g in state["groups"]}
    params_by: dict[tuple[str, int], dict[str, Any]] = {}
    for group in state["groups"]:
        group["initial_trials"] = per_arm * len(seeds)
        group["trials"] = []
        for t in studies[group["label"]].trials:  # what earlier invocations told
            params_by[(group["label"], t.number)] = dict(t.params)
    while True:
        batch, pending = [], []
        for group in state["groups"]:
            study = studies[group["label"]]
            finished = [t for t in study.trials if t.state.is_finished()]
            asked = [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
            while len(finished) + len(asked) < per_arm and len(asked) < batch_size:
                study.sampler = _sampler(optuna, name, seed + len(study.trials))
                trial = study.ask()
                for key, spec in space.items():
                    suggest(trial, key, spec)
                params_by[(group["label"], trial.number)] = dict(trial.params)
                asked.append(trial.number)
            for number in asked:
                params = params_by[(group["label"], number)]
                values = values_of(sweeper, params, sweeper.compose(sweeper.trial_overrides(group, {}, seeds[0])))
                runs = [sweeper.trial_overrides(group, values, s) for s in seeds]
                batch += runs
                pending.append((group, number, values, runs))
        if not batch:
            break
        ok = sweeper.launch_trials(batch)
        for group, number, values, runs in pending:
            results = [{"point": number, "seed": s, "values": values, **sweeper.trial_result(o)}
                       for s, o in zip(seeds, runs, strict=True)]
            group["trials"] += results
            if not ok and any(r["status"] not in tuning.SCORED for r in results):
                continue  # stopped mid-trial, or failed twice: it stays asked, and a resume runs it again
            scores = [tuning.trial_value(r) for r in results]
            mean = math.inf if any(map(math.isinf, scores)) else sum(scores) / len(scores)
            studies[group["label"]].tell(number, mean)
        tuning.write_state(sweep_dir, state)
        if not ok:
            return False
    for group in state["groups"]:  # earlier invocations' trials, read back for the summary
        known = {(t["point"], t["seed"]) for t in group["trials"]}
        for t in studies[group["label"]].trials:
            if not t.state.is_finished():
                continue
            values = values_of(sweeper, t.params, sweeper.compose(sweeper.trial_overrides(group, {}, seeds[0])))
            for s in seeds:
                if (t.number, s) not in known:
                    o = sweeper.trial_overrides(group, values, s)
                    group["trials"].append({"point": t.number, "seed": s, "values": values,
                                            **sweeper.trial_result(o)})
        means = tuning.point_means(group["trials"], seeds)
        best = tuning.best_point(means)
        group["means"] = {str(k): m for k, m in means.items()}
        group["chosen"], group["chosen_multiplier"] = best, None
        group["chosen_params"] = None if best is None else params_by[(group["label"], best)]
        group["chosen_values"] = None if best is None else \
            next(t["values"] for t in group["trials"] if t["point"] == best)
        group["chosen_mean"] = None if best is None else means[best]
        group["edge"], group["edge_key"] = _space_edge(space, group["chosen_params"])
    tuning.write_state(sweep_dir, state)
    return True


def _space_edge(space: Mapping[str, Mapping[str, Any]],
                params: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """("up"/"down", the key) when a chosen numeric parameter lies within 2% of its range's end (in
    log space for log: true): the best may lie outside the space; else (None, None)."""
    if not params:
        return None, None
    for key, spec in space.items():
        if "choices" in spec or key not in params:
            continue
        low, high, value = float(spec["low"]), float(spec["high"]), float(params[key])
        f = math.log if spec.get("log") else (lambda x: x)
        span = f(high) - f(low)
        if f(value) - f(low) <= 0.02 * span:
            return "down", key
        if f(high) - f(value) <= 0.02 * span:
            return "up", key
    return None, None
