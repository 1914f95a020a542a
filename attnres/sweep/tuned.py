"""`hydra/sweeper=tuned` (`tune=lr`, `tune=optuna`): each arm of a sweep at its own best.

`attnres-run -m tune=lr residual=standard,block seed=0,1,2,3,4` has two arms (every combination of
the swept keys but `seed`) and five verdict seeds. Two stages, each a batch (or several) handed to
the configured launcher (parallel slots or SLURM), so every launcher, dedup, resume and Ctrl-C work
as in any sweep:

1. search: for every arm, the same search on the tuning seeds (`tuning_seeds`, never a verdict
   seed): a log grid around the arm's configured value (`method: grid`, grown at an edge where the
   arm's best lies on it, `max_extend` points at most) or an Optuna study (`method: optuna`,
   `tuned_optuna.py`). The trials' run folders go to `<sweep>/tuning/`.
2. verdict: every job of the command line at its arm's choice (the lowest mean `metric` over the
   tuning seeds; the verdict seeds' runs are not read while choosing).

With `proxy` (say `{size: 194m}`; `width` and `depth` fractions: a narrow muP proxy, `tuned_proxy.py`),
the search runs at the proxy alone and each size's jobs run at
their arm's choice: a relative value carries over as the same multiple of that job's configured
value. `tuning/tuning.json` records the search; the summary (`attnres.results.tuned_summary`)
leads with the tuned verdict. A resumed sweep (`resume=true`) redoes no finished trial and
replays the same decisions; a resume whose search settings changed is refused, naming them.
The refusals before any run, and the start line, are `tuned_start.py`'s.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from attnres.atomic import DISK_FULL, WRITE_ERRORS, read_json
from attnres.config.errors import ConfigError, user_errors
from attnres.config.rules import BOOL
from attnres.results import tuning
from attnres.results.summary import config_labels, overrides_by_key
from attnres.sweep import on_demand, plan, stopping, tuned_given, tuned_halving, tuned_proxy, tuned_start
from attnres.sweep.tuned_start import job_seeds, override_key

log = logging.getLogger(__name__)

TUNE_GROUP = "tune"  # the config group that picks this sweeper: not part of an arm's name


class TunedSweeper(Sweeper):
    """Hydra sweeper: a search per arm on the tuning seeds, then each arm at its best (module doc)."""

    def __init__(self, method: str = "grid", tuning_seeds: Sequence[int] = (1000, 1001), metric: str = "val/loss",
                 grid: Mapping[str, Any] | None = None, optuna: Mapping[str, Any] | None = None,
                 baseline: str | None = None, proxy: Mapping[str, Any] | None = None, untuned: bool = False,
                 params: Mapping[str, str] | None = None, prune: Mapping[str, Any] | None = None,
                 given: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        grid, optuna, proxy, params, tuning_seeds, prune, given = (
            _plain(x) for x in (grid, optuna, proxy, params, tuning_seeds, prune, given))
        # a bad setting is kept to be refused in check() (one line, exit 2, the sweep folder left as it
        # was): raised here, Hydra would print its instantiation error
        self.problems: list[str] = []
        self.method, self.metric, self.baseline = str(method), str(metric), baseline
        self.untuned = untuned is True
        if not isinstance(untuned, bool):
            self.problems.append(f"hydra.sweeper.untuned={untuned} {BOOL.problem(untuned)}; "
                                 f"{BOOL.wanted('hydra.sweeper.untuned')}")
        self.tuning_seeds = tuned_start.seed_list(tuning_seeds, self.problems)
        self.grid = {"keys": ["optim.optimizer.lr"], "points": 5, "factor": 2.0, "max_extend": 3, "centre": {},
                     **(grid or {})}
        centre = self.grid.get("centre") or {}
        if not isinstance(centre, Mapping):
            self.problems.append(f"hydra.sweeper.grid.centre={centre} is not a {{key: value}} map; e.g. "
                                 "'hydra.sweeper.grid.centre={optim.optimizer.lr:0.001}'")
        self.grid["centre"] = dict(centre) if isinstance(centre, Mapping) else {}
        self.optuna = dict(optuna or {})
        self.prune = {"rungs": [], "keep": 0.5, **(prune or {})}  # successive halving (tuned_halving.py)
        if isinstance(proxy, (list, tuple)):  # [size=194m]: overrides
            proxy = dict(str(o).split("=", 1) for o in proxy if "=" in str(o))
        self.proxy_settings = tuned_proxy.flatten(proxy)  # with the fractions (tuned_proxy.py), as given
        self.proxy = {k: v for k, v in self.proxy_settings.items() if k not in tuned_proxy.FRACTIONS}
        self.params = dict(params or {})
        self.given = given if given is not None else {}  # method=given: each arm's values (tuned_given.py)
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.launcher: Any = None
        self.job_idx = 0
        self.incomplete: list[str] = []  # trials that failed twice (launch_trials): the search stops unchosen
        self._composed: dict[tuple[str, ...], DictConfig] = {}

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    # -- the plan --------------------------------------------------------------------------------------
    def signature(self) -> dict[str, Any]:
        """What defines the search (tuning.SEARCH_FIELDS): a resume must not change it."""
        grid = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in self.grid.items()
                if k != "centre" or v}  # no centre given: as the sweeps started before grid.centre recorded it
        space = self.optuna
        return {"method": self.method, "metric": self.metric, "tuning_seeds": self.tuning_seeds,
                "grid": grid if self.method == "grid" else None, "optuna": space if self.method == "optuna" else None,
                "proxy": self.proxy_settings, "baseline": self.baseline,
                **({"prune": self.prune} if self.prune["rungs"] else {}),  # unpruned: as sweeps before it
                **({"given": self.given} if self.method == tuned_given.METHOD else {})}

    def jobs_of(self, arguments: Sequence[str]) -> list[list[str]]:
        """The command line's jobs (the basic sweeper's cross product). They keep the `tune=` choice:
        a job is composed with the sweep's hydra overrides (`hydra.sweeper.grid.points=3`), which need
        this sweeper's config; `tune` names no run folder (conf/config.yaml's exclude_keys)."""
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs = BasicSweeper.split_arguments(parser.parse_overrides(lines), None)[0]
        return [list(job) for job in jobs]

    def compose(self, overrides: Sequence[str]) -> DictConfig:
        """A job's config, as the launcher will compose it (cached: a sweep asks for each job's several times)."""
        key = tuple(overrides)
        if key not in self._composed:
            self._composed[key] = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        return self._composed[key]

    def run_dir(self, overrides: Sequence[str]) -> tuple[str, Path]:
        """A job's folder name relative to the sweep folder, and its path."""
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        path = sweep_dir / str(self.compose(overrides).hydra.sweep.subdir)
        return path.relative_to(sweep_dir).as_posix(), path

    def check(self, jobs: list[list[str]]) -> None:
        """The refusals before anything runs, each one line (exit 2): tuned_start.check."""
        tuned_start.check(self, jobs)

    def searched_keys(self) -> list[str]:
        if self.method == "grid":
            return [str(k) for k in self.grid["keys"]]
        if self.method == tuned_given.METHOD:
            return tuned_given.given_keys(self.given)
        return [str(k) for k in (self.optuna.get("space") or {})]

    def baseline_spec(self) -> tuple[str, str]:
        """(key, value) of the baseline arms: `optim:adamw` (or `optim=adamw`, quoted); residual=standard."""
        key, _, value = re.split(r"([:=])", self.baseline or "residual=standard", maxsplit=1)
        return key.strip(), value.strip()

    def baseline_value(self, overrides: Sequence[str], cfg: DictConfig) -> str:
        """An arm's value of the baseline's key (a config group's choice, or a config value)."""
        key = self.baseline_spec()[0]
        chosen = cfg.hydra.runtime.choices.get(key) if key in cfg.hydra.runtime.choices else \
            OmegaConf.select(cfg, key, default=None)
        return str(overrides_by_key(list(overrides)).get(key, chosen))

    def is_baseline(self, overrides: Sequence[str], cfg: DictConfig) -> bool:
        return self.baseline_value(overrides, cfg) == self.baseline_spec()[1]

    def baseline_keys(self) -> tuple[str, ...]:
        key = self.baseline_spec()[0]
        return (key, "num_blocks") if key == "residual" else (key,)

    # -- the sweep ---------------------------------------------------------------------------------------
    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        try:
            with user_errors():
                jobs = self.jobs_of(arguments)
                if not jobs:
                    raise plan.no_jobs_error(self.config)
                self.check(jobs)
                on_demand.check_tuned(self, jobs)  # seeds.on_demand: its seeds are no tuning seed
                state = self.start_state(sweep_dir, jobs)
        except SystemExit:  # refused: the folder as it was (the sweep callback locked it before this sweeper ran)
            tuned_start.unlock_if_untouched(sweep_dir)
            raise
        fresh = not tuning.state_path(sweep_dir).is_file()
        if fresh or self.config.get("resume") or self.config.get("overwrite"):  # else the launcher refuses first
            tuning.write_state(sweep_dir, state)  # the search's settings, for a resume's check, before any run
        try:
            self.run_stages(sweep_dir, state)
        except OSError as err:  # a full disk mid-search: one line, as a plain sweep's; resume=true goes on
            if err.errno not in WRITE_ERRORS:
                raise
            why = "disk full" if err.errno in DISK_FULL else f"cannot write ({err.strerror})"
            print(f"attnres-run: error: {why} writing {err.filename or sweep_dir}; the finished trials and runs are "
                  f"kept in {sweep_dir}: free some space, then run the same command with resume=true to go on",
                  file=sys.stderr, flush=True)
            sys.exit(2)
        return None

    def run_stages(self, sweep_dir: Path, state: dict[str, Any]) -> None:
        if self.method == "grid" and self.prune["rungs"]:
            from attnres.sweep.tuned_halving import halving_search

            done = halving_search(self, sweep_dir, state)
        elif self.method == "grid":
            from attnres.sweep.tuned_grid import grid_search

            done = grid_search(self, sweep_dir, state)
        elif self.method == tuned_given.METHOD:
            done = tuned_given.choose(sweep_dir, state)
        else:
            from attnres.sweep.tuned_optuna import optuna_search

            done = optuna_search(self, sweep_dir, state)
        if not done and self.incomplete:  # a trial failed twice: nothing is chosen on a search that lacks it
            plan.unanswered.add(plan.folder_key(sweep_dir))
            print(f"attnres-run: error: {len(self.incomplete)} trial{'s' * (len(self.incomplete) != 1)} of the "
                  f"search failed twice (first: {self.incomplete[0]}); no arm is chosen and no verdict runs: see "
                  "its log, then run the same command with resume=true to run it again", file=sys.stderr, flush=True)
        if not done:  # stopped (Ctrl-C, SIGTERM): the summary says how far it got
            return
        unchosen = [g["label"] for g in state["groups"] if g.get("chosen") is None]
        if unchosen:  # every trial of an arm diverged: no answer for it, a failure as a plain sweep's failed job
            plan.unanswered.add(plan.folder_key(sweep_dir))
            which = ", ".join(unchosen) if len(state["groups"]) > 1 else "the search"
            print(f"attnres-run: error: no trial of {which} ended with a finite {self.metric}; nothing to choose: "
                  "search lower values (e.g. hydra.sweeper.grid.centre) and run again", file=sys.stderr, flush=True)
        on_demand.tuned_looks(self, sweep_dir, state)  # the verdict stage, once or (seeds.on_demand) once a look

    def start_state(self, sweep_dir: Path, jobs: list[list[str]], announce: bool = True) -> dict[str, Any]:
        """The search's groups and the verdict's arms, checked against a resumed sweep's record (and
        the start line printed, unless `announce` is False: tests/test_docs.py's checks)."""
        before = tuning.read_state(sweep_dir)
        signature = self.signature()
        resuming = bool(self.config.get("resume")) and not self.config.get("overwrite")
        if resuming and before.get("signature"):
            changed = tuning.changed_fields(before["signature"], signature)
            if changed:
                raise ConfigError(
                    f"the search changed since this tuned sweep started in {sweep_dir}: {', '.join(changed)}; run it "
                    "with the settings it started with, or pass name=<new name> (overwrite=true starts it again)")
        proxy_keys = set(self.proxy)
        groups: dict[tuple[str, ...], dict[str, Any]] = {}
        arms: dict[tuple[str, ...], dict[str, Any]] = {}
        for job in jobs:
            arm_key = tuple(o for o in job if override_key(o) != "seed")
            group_key = tuple(o for o in arm_key if override_key(o) not in proxy_keys)
            groups.setdefault(group_key, {"overrides": list(group_key)})
            arm = arms.setdefault(arm_key, {"overrides": list(arm_key), "group": group_key, "seeds": []})
            arm["seeds"] += job_seeds(job) or [int(self.config.seed)]
        glabels = config_labels({str(i): overrides_by_key(list(k), (TUNE_GROUP,)) for i, k in enumerate(groups)})
        alabels = config_labels({str(i): overrides_by_key(list(k), (TUNE_GROUP,)) for i, k in enumerate(arms)})
        found = tuned_proxy.fractions(self.proxy_settings)
        for i, group in enumerate(groups.values()):
            group["label"] = glabels[str(i)]
            group["narrow"], group["target"] = tuned_proxy.narrow(self.compose(
                [*group["overrides"], *(f"{k}={v}" for k, v in self.proxy.items())]), found) if found else ([], [])
            cfg = self.compose(self.trial_overrides(group, {}, self.tuning_seeds[0]))
            group["centre"] = {k: v for k in self.searched_keys()
                               if isinstance(v := OmegaConf.select(cfg, k, default=None), (int, float))
                               and not isinstance(v, bool)}
            if not group["centre"]:
                raise ConfigError(f"{', '.join(self.searched_keys())}: no numeric value in the config of "
                                  f"{group['label']}; search keys the config sets to a number "
                                  "(docs/sweeps.md#tuned-comparisons)")
            if self.method == "grid" and self.grid["centre"]:  # the user's centre; the verdict's values relative
                given = {k: v for k, v in self.grid["centre"].items() if k in group["centre"]}
                group["centre_ratio"] = {k: v / group["centre"][k] for k, v in given.items()}
                group["centre"].update(given)
            group["tokens_per_trial"] = _tokens(cfg)
            group["trials"] = []
            if self.prune["rungs"]:  # the same fractions of every arm's steps
                group["prune"], group["rung_steps"] = self.prune, tuned_halving.rung_steps(
                    self.prune["rungs"], int(OmegaConf.select(cfg, "trainer.max_steps")))
            group["initial_trials"] = len(self.tuning_seeds) * (
                int(self.grid["points"]) if self.method == "grid" else int(self.optuna.get("trials", 12)))
        if self.method == tuned_given.METHOD:  # no search: each arm's values as given
            tuned_given.place(self.given, list(groups.values()))
        for i, arm in enumerate(arms.values()):
            arm["label"] = alabels[str(i)]
            cfg = self.compose([*arm["overrides"], f"seed={arm['seeds'][0]}"])
            arm["baseline_value"] = self.baseline_value(arm["overrides"], cfg)
            arm["is_baseline"] = arm["baseline_value"] == self.baseline_spec()[1]
            arm["group"] = groups[arm["group"]]["label"]
        drop = set(self.baseline_keys())
        for arm in arms.values():
            rest = [o for o in arm["overrides"] if override_key(o) not in drop]
            arm["baseline"] = None if arm["is_baseline"] else next(
                (b["label"] for b in arms.values() if b["is_baseline"]
                 and [o for o in b["overrides"] if override_key(o) not in drop] == rest), None)
        tuned_start.check_answerable(self, list(arms.values()), cfg)
        if resuming and self.prune["rungs"]:  # what a folder that went on past a rung measured there
            tuned_halving.carry_rungs(before, list(groups.values()))
        state = {"signature": signature, "tuning_seeds": self.tuning_seeds,
                 "groups": list(groups.values()), "arms": list(arms.values()), "stage": "search"}
        if announce:
            tuned_start.announce(self, state)
        return state

    def trial_overrides(self, group: Mapping[str, Any], values: Mapping[str, Any], seed: int) -> list[str]:
        raw = OmegaConf.to_container(self.config.hydra.sweep, resolve=False)["subdir"]
        return [*group["overrides"], *(f"{k}={v}" for k, v in self.proxy.items()), *group.get("narrow", []),
                *(f"{k}={tuning.format_value(v)}" for k, v in values.items()), f"seed={seed}",
                f"hydra.sweep.subdir='{tuning.TUNING_DIR}/{raw}'"]

    def launch(self, batch: list[list[str]]) -> bool:
        """Run a batch through the configured launcher; False when the sweep was stopped."""
        if batch:
            self.launcher.launch(batch, initial_job_idx=self.job_idx)
            self.job_idx += len(batch)
        return stopping.stopped_by is None

    def trial_result(self, overrides: Sequence[str]) -> dict[str, Any]:
        """A finished (or failed) trial's score, from its run folder (or the one it duplicates)."""
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        name, path = self.run_dir(overrides)
        same_as = (plan.sweep_jobs.get(plan.folder_key(sweep_dir)) or {}).get(name)
        outcome = tuning.trial_outcome(read_json((sweep_dir / same_as if same_as else path) / "metrics.json"),
                                       self.metric)
        if outcome["status"] == "diverged":
            plan.diverged.setdefault(plan.folder_key(sweep_dir), set()).add(name)
        return {"job": name, **({"same_as": same_as} if same_as else {}), **outcome}

    def launch_trials(self, batch: list[list[str]]) -> bool:
        """Run a batch of trials; a trial that failed for another reason than a non-finite loss (killed,
        out of memory, an error) runs once more, from its checkpoint. False when the sweep was
        stopped, or when a trial failed again (`self.incomplete` names them): nothing may be chosen
        on a search that lacks a point."""
        if not self.launch(batch):
            return False
        again = [o for o in batch if self.trial_result(o)["status"] not in tuning.SCORED]
        if again:
            first = self.trial_result(again[0])
            print(f"tuned sweep: {len(again)} trial{'s' * (len(again) != 1)} failed ({first['job']}: "
                  f"{first['error'] or first['status']}); running {'them' if len(again) > 1 else 'it'} again, once",
                  flush=True)
            resumed = self.config.get("overwrite") or self.config.get("resume")  # else resume=true: from its checkpoint
            retry = again if resumed else [[*o, "resume=true"] for o in again]
            if not self.launch(retry):
                return False
        self.incomplete = [self.trial_result(o)["job"] for o in again
                           if self.trial_result(o)["status"] not in tuning.SCORED]
        return not self.incomplete

    def verdict_stage(self, sweep_dir: Path, state: dict[str, Any]) -> None:
        """Stage 2: every job of the command line at its arm's choice (and, with untuned, as configured)."""
        groups = {g["label"]: g for g in state["groups"]}
        batch: list[list[str]] = []
        for arm in state["arms"]:
            group = groups[arm["group"]]
            arm["jobs"], arm["untuned_jobs"], arm["values"] = {}, {}, {}
            for seed in arm["seeds"]:
                plain = [*arm["overrides"], f"seed={seed}"]
                if self.untuned:
                    batch.append(plain)
                    arm["untuned_jobs"][str(seed)] = self.run_dir(plain)[0]
                if group.get("chosen_multiplier") is None and group.get("chosen_params") is None:
                    continue  # no trial of the arm finished: it has no choice to run
                values = self.values_for(group, self.compose(plain))
                overrides = [*arm["overrides"], *group.get("target", []),
                             *(f"{k}={tuning.format_value(v)}" for k, v in values.items()), f"seed={seed}"]
                batch.append(overrides)
                arm["jobs"][str(seed)] = self.run_dir(overrides)[0]
                arm["values"][str(seed)] = values
            if not self.untuned:  # an earlier sweep's runs at the configured values, if this folder holds them
                for seed in arm["seeds"]:
                    name = self.run_dir([*arm["overrides"], f"seed={seed}"])[0]
                    if (sweep_dir / name / "metrics.json").is_file():
                        arm["untuned_jobs"][str(seed)] = name
        state["stage"] = "verdict"
        tuning.write_state(sweep_dir, state)
        launched = plan.sweep_jobs.get(plan.folder_key(sweep_dir)) or {}  # seeds on demand: a look's new seeds alone
        batch = [job for job in batch if self.run_dir(job)[0] not in launched]
        if batch:
            log.info(f"tuned sweep: verdict, {len(batch)} runs")
            self.launch(batch)
        state["stage"] = "done" if stopping.stopped_by is None else "verdict"
        tuning.write_state(sweep_dir, state)

    def values_for(self, group: Mapping[str, Any], cfg: DictConfig) -> dict[str, Any]:
        """The chosen values for one verdict job: a relative choice times that job's configured value."""
        if group.get("chosen_params") is not None:  # optuna
            from attnres.sweep.tuned_optuna import values_of

            return values_of(self, group["chosen_params"], cfg)
        found = {}
        for key in group["centre"]:
            configured = OmegaConf.select(cfg, key, default=None)
            if isinstance(configured, (int, float)) and not isinstance(configured, bool):
                ratio = (group.get("centre_ratio") or {}).get(key, 1.0)  # hydra.sweeper.grid.centre
                found[key] = tuning.scaled(configured, group["chosen_multiplier"] * ratio)
        return found


def _plain(value: Any) -> Any:
    """A Hydra-given DictConfig / ListConfig as plain dicts and lists (the state file is JSON)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _tokens(cfg: DictConfig) -> int | None:
    """Training tokens of one run of this config (steps x tokens a step), or None when unknown."""
    steps = OmegaConf.select(cfg, "trainer.max_steps", default=None)
    per_step = OmegaConf.select(cfg, "data.tokens_per_step", default=None)
    if per_step is None:
        batch, block = (OmegaConf.select(cfg, f"data.{k}", default=None) for k in ("batch_size", "block_size"))
        accumulate = OmegaConf.select(cfg, "trainer.accumulate_grad_batches", default=1) or 1
        per_step = batch * block * accumulate if isinstance(batch, int) and isinstance(block, int) else None
    return int(steps * per_step) if isinstance(steps, int) and steps > 0 and per_step else None
