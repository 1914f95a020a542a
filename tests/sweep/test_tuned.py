"""The tuned sweep (attnres/sweep/tuned.py, tuned_optuna.py; results/tuning.py, tuned_summary.py):
each arm searched on tuning seeds, then run at its own best on the verdict seeds.

Most tests drive the sweeper in this process with a launcher that trains nothing: it writes each
job's metrics.json from a known loss surface, so that where the best lies (inside the grid, past its
edge) is set by the test. The `slow` tests run `attnres-run -m tune=lr` itself: killed mid-search and
mid-verdict, then resumed; and (marked `slurm`) through the local SLURM cluster."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import attnres.config.naming  # noqa: F401  (the attnres.run_id resolver of run folder names)
from attnres.results import tuning
from attnres.results.tuned_summary import write_tuned_summary
from attnres.sweep import plan, stopping
from attnres.sweep.tuned import TunedSweeper
from tests.helpers import CLI, REPO, TINY, cli_env, one_line_error, run_cli

CENTRE = 3e-3  # conf/optim/adamw.yaml's lr


# -- the pure rules ----------------------------------------------------------------------------------
def test_grid_points_edges_and_selection():
    assert tuning.grid_range(5) == [-2, -1, 0, 1, 2]
    assert tuning.grid_range(5, down=1, up=2) == [-3, -2, -1, 0, 1, 2, 3, 4]
    assert tuning.grid_edge(2, [-2, -1, 0, 1, 2]) == "up"
    assert tuning.grid_edge(-2, [-2, -1, 0, 1, 2]) == "down"
    assert tuning.grid_edge(0, [-2, -1, 0, 1, 2]) is None
    assert tuning.grid_edge(0, [0]) == "both"
    trials = [{"point": p, "seed": s, "value": v} for p, s, v in
              [(0, 1, 3.0), (0, 2, 3.2), (1, 1, 2.9), (1, 2, 3.1), (2, 1, math.nan), (2, 2, 1.0), (3, 1, 0.5)]]
    means = tuning.point_means(trials, [1, 2])
    assert means == {0: pytest.approx(3.1), 1: pytest.approx(3.0), 2: math.inf}  # 3 lacks seed 2: left out
    assert tuning.best_point(means) == 1  # a diverged seed makes its point the worst, not the best
    assert tuning.best_point({-1: 2.0, 1: 2.0, 3: 2.5}) in (-1, 1)  # ties: the nearer the configured value
    assert tuning.best_point({0: math.inf}) is None
    assert tuning.scaled(3e-3, 0.25) == 0.00075 and tuning.scaled(100, 0.5) == 50
    assert tuning.format_value(0.00075) == "0.00075"


def test_a_changed_search_is_named_key_by_key():
    before = {"grid": {"points": 5, "factor": 2.0}, "tuning_seeds": [1000, 1001], "method": "grid"}
    now = {"grid": {"points": 7, "factor": 2.0}, "tuning_seeds": [1000], "method": "grid"}
    assert tuning.changed_fields(before, now) == ["grid.points (5 -> 7)", "tuning_seeds ([1000,1001] -> [1000])"]
    assert tuning.changed_fields(before, before) == []


def test_budgets_are_checked_equal_and_unequal_ones_said():
    arms = [{"label": "standard", "initial_trials": 10, "tokens_per_trial": 5000, "trials": [0] * 10},
            {"label": "block", "initial_trials": 10, "tokens_per_trial": 5000, "trials": [0] * 12}]
    equal, text = tuning.budget_check(arms)
    assert equal and "equal across arms: 10 trials each" in text and "block 12" in text
    arms[1]["tokens_per_trial"] = 9000
    equal, text = tuning.budget_check(arms)
    assert not equal and text.startswith("NOT equal")


# -- the sweeper, in this process, over a known loss surface -----------------------------------------
class SurfaceLauncher:
    """Runs nothing: writes each job's folder as a finished run whose val/loss is
    (log2(lr / 3e-3) - best[arm])^2 + 1 + 0.01 seed-noise; `stop_after` batches, it leaves the rest of
    the batch unstarted and stops the sweep as SIGTERM would."""

    def __init__(self, sweeper: TunedSweeper, best: dict[str, float], stop_after: int | None = None,
                 stop_at_job: int = 0) -> None:
        self.sweeper, self.best, self.stop_after, self.stop_at_job = sweeper, best, stop_after, stop_at_job
        self.batches: list[list[list[str]]] = []
        self.diverge_above = math.inf  # a trial at a higher lr fails with a non-finite loss

    @property
    def config(self):  # what plan.plan_jobs reads of a launcher
        return self.sweeper.config

    @property
    def hydra_context(self):
        return self.sweeper.hydra_context

    def launch(self, batch, initial_job_idx):
        self.batches.append([list(b) for b in batch])
        sweep_dir = Path(str(self.sweeper.config.hydra.sweep.dir))
        to_run = [overrides for overrides, _ in plan.plan_jobs(self, batch, sweep_dir)]  # dedup, resume's skips
        for index, overrides in enumerate(to_run):
            if self.stop_after is not None and len(self.batches) > self.stop_after and index >= self.stop_at_job:
                stopping.stopped_by = signal.SIGTERM
                return []
            name, folder = self.sweeper.run_dir(overrides)
            cfg = self.sweeper.compose(overrides)
            lr, seed = float(OmegaConf.select(cfg, "optim.optimizer.lr")), int(cfg.seed)
            arm = cfg.hydra.runtime.choices.residual
            loss = (math.log2(lr / CENTRE) - self.best[arm]) ** 2 + 1.0 + 0.01 * math.sin(seed)
            (folder / ".hydra").mkdir(parents=True, exist_ok=True)
            job = OmegaConf.to_container(cfg, resolve=False)
            job.pop("hydra")
            OmegaConf.save(OmegaConf.create(job), folder / ".hydra" / "config.yaml")
            OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"residual": arm}}}}),
                           folder / ".hydra" / "hydra.yaml")
            task = [o for o in overrides if not o.startswith("hydra.")]
            OmegaConf.save(OmegaConf.create(task), folder / ".hydra" / "overrides.yaml")
            if lr > self.diverge_above:
                failed = {"status": "failed", "error": "non-finite loss at step 3"}
                (folder / "metrics.json").write_text(json.dumps(failed))
                continue
            (folder / "metrics.json").write_text(json.dumps(
                {"status": "finished", "metrics": {"val/loss": loss, "val/bpb": loss / math.log(2)}}))
        return []


def make_sweeper(tmp_path: Path, *overrides: str, **settings) -> TunedSweeper:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import setup_globals
    from hydra.types import HydraContext, RunMode

    setup_globals()  # the ${hydra:...} resolver, as a Hydra app has it
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(REPO / "conf")))
    config = loader.load_configuration("config", overrides=["tune=lr", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                                                            *overrides], run_mode=RunMode.MULTIRUN)
    sweeper = TunedSweeper(**settings)
    sweeper.config, sweeper.hydra_context = config, HydraContext(config_loader=loader, callbacks=None)
    return sweeper


def run_sweeper(tmp_path: Path, best: dict[str, float], *extra: str, stop_after: int | None = None,
                stop_at_job: int = 0, **settings) -> tuple[TunedSweeper, SurfaceLauncher]:
    sweeper = make_sweeper(tmp_path, *[e for e in extra if "," not in e], **settings)
    sweeper.launcher = SurfaceLauncher(sweeper, best, stop_after, stop_at_job)
    stopping.stopped_by = None
    plan.sweep_jobs.clear()
    try:
        sweeper.sweep(["tune=lr", *extra])
    finally:
        stopped, stopping.stopped_by = stopping.stopped_by, None
    sweeper.stopped = stopped
    return sweeper, sweeper.launcher


GRID = {"points": 3, "factor": 2.0, "max_extend": 2, "keys": ["optim.optimizer.lr"]}


@pytest.mark.slow
def test_the_grid_grows_at_an_edge_until_the_best_is_inside(tmp_path):
    # block's best is 2 factors above the configured lr: the 3-point grid (-1..1) grows up twice, to 3
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 0.0, "block": 2.0}, "residual=standard,block",
                                    "seed=0,1", grid=GRID)
    state = tuning.read_state(tmp_path / "sweep")
    groups = {g["label"]: g for g in state["groups"]}
    assert groups["block"]["extended"] == {"down": 0, "up": 2} and groups["block"]["exponents"] == [-1, 0, 1, 2, 3]
    assert groups["block"]["chosen"] == 2 and groups["block"]["edge"] is None
    assert groups["block"]["chosen_values"] == {"optim.optimizer.lr": 0.012}
    assert groups["standard"]["extended"] == {"down": 0, "up": 0} and groups["standard"]["chosen"] == 0
    # each growth is a batch of its own, then the verdict: every verdict job at its arm's choice
    verdict = launcher.batches[-1]
    assert sorted((o[-1], o[1]) for o in verdict) == sorted(
        (f"seed={s}", f"residual={a}") for s in (0, 1) for a in ("standard", "block"))
    lrs = {o[1]: next(x for x in o if x.startswith("optim.optimizer.lr=")) for o in verdict}
    assert lrs == {"residual=standard": "optim.optimizer.lr=0.003", "residual=block": "optim.optimizer.lr=0.012"}


@pytest.mark.slow
def test_an_arm_still_best_at_the_edge_is_reported_never_silently_taken(tmp_path):
    run_sweeper(tmp_path, {"standard": 0.0, "block": 6.0}, "residual=standard,block", "seed=0,1", grid=GRID)
    state = tuning.read_state(tmp_path / "sweep")
    block = next(g for g in state["groups"] if g["label"] == "block")
    assert block["extended"]["up"] == 2 and block["edge"] == "up" and block["chosen"] == 3
    rows, lines = write_tuned_summary(tmp_path / "sweep")
    chosen = next(line for line in lines if line.startswith("chosen: block"))
    assert "STILL AT THE SEARCH'S UPPER EDGE" in chosen and "max_extend" in chosen
    assert "STILL AT THE SEARCH'S UPPER EDGE" in (tmp_path / "sweep" / "summary.md").read_text()
    for name in ("summary.png", "tuning.png", "summary.csv"):
        assert (tmp_path / "sweep" / name).stat().st_size > 0


@pytest.mark.slow
def test_the_search_never_runs_a_verdict_seed_and_the_verdict_reads_the_tuned_runs(tmp_path):
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 0.0, "block": 1.0}, "residual=standard,block",
                                    "seed=0,1,2", grid=GRID, tuning_seeds=[7, 8])
    *search, verdict = launcher.batches
    assert {o[-2] for batch in search for o in batch} == {"seed=7", "seed=8"}
    assert all(o[-1].startswith("hydra.sweep.subdir='tuning/") for batch in search for o in batch)
    assert {o[-1] for o in verdict} == {"seed=0", "seed=1", "seed=2"}
    rows, lines = write_tuned_summary(tmp_path / "sweep")
    head = lines[0]
    # block at 2x (loss 1.0) against standard at 1x (loss 1.0): the same loss at each arm's best
    assert head.startswith("verdict, each arm at its own best: block vs standard:") and "paired t, 3 seeds" in head
    assert any(line.startswith("search budget: equal across arms: 6 trials each at first") for line in lines)
    assert {r["stage"] for r in rows} == {"tuned"} and len(rows) == 6


def test_a_diverged_trial_is_the_worst_point_and_no_failure_of_the_sweep(tmp_path):
    sweeper = make_sweeper(tmp_path, grid={**GRID, "factor": 4.0, "max_extend": 0})
    sweeper.launcher = SurfaceLauncher(sweeper, {"standard": 3.0})  # the best lr (0.024) diverges
    sweeper.launcher.diverge_above = 0.01
    plan.sweep_jobs.clear()
    plan.outcomes.clear()
    sweeper.sweep(["tune=lr", "residual=standard", "seed=0"])
    state = tuning.read_state(tmp_path / "sweep")
    (group,) = state["groups"]
    assert {t["status"] for t in group["trials"] if t["point"] == 1} == {"diverged"}
    assert group["chosen"] == 0 and group["edge"] is None  # the diverged point is the worst, not skipped over
    counts = plan.record_outcome(tmp_path / "sweep")
    assert counts["diverged"] == 2 and "failed" not in counts and plan.exit_status() == 0
    rows, lines = write_tuned_summary(tmp_path / "sweep")
    assert "2 trials diverged or failed (scored as the worst)" in next(x for x in lines if x.startswith("chosen:"))
    plan.sweep_jobs.clear()
    plan.outcomes.clear()
    plan.diverged.clear()


@pytest.mark.slow
def test_identical_arms_run_their_trials_once(tmp_path):
    # residual=standard ignores num_blocks: the two arms are one run each, deduplicated by the launcher
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 1.0}, "residual=standard", "num_blocks=2,4", "seed=0",
                                    grid=GRID)
    state = tuning.read_state(tmp_path / "sweep")
    first, second = state["groups"]
    assert [t["value"] for t in first["trials"]] == [t["value"] for t in second["trials"]]
    assert first["chosen"] == second["chosen"] == 1
    notes = json.loads((tmp_path / "sweep" / "jobs.json").read_text())
    assert sum(n["status"] == "duplicate" for n in notes.values()) == len(second["trials"]) + 1  # + its verdict run
    made = [p for p in (tmp_path / "sweep" / "tuning").iterdir() if p.is_dir()]
    assert len(made) == len(first["trials"])


@pytest.mark.slow
def test_a_paper_sweep_searches_at_its_proxy_and_prices_the_trials_apart(tmp_path, capsys):
    sweeper = make_sweeper(tmp_path, "experiment=paper_scaling", "+hydra.sweeper.proxy.size=194m", "data=tokens",
                           "data.path=data", "trainer.accelerator=gpu", proxy={"size": "194m"},
                           params={"size": "194m,241m,296m,436m,528m", "residual": "standard,block,full"})
    jobs = sweeper.jobs_of(["tune=lr", "experiment=paper_scaling", "data=tokens", "data.path=data",
                            "trainer.accelerator=gpu"])
    state = sweeper.start_state(tmp_path / "sweep", jobs)
    assert [g["label"] for g in state["groups"]] == ["standard", "block", "full"] and len(state["arms"]) == 15
    assert {g["centre"]["optim.optimizer.lr"] for g in state["groups"]} == {2.99e-3}  # Table 2's lr at 194m
    out = capsys.readouterr().out
    assert "15 configurations, 3 arms; search at size=194m" in out
    trials, verdict = (float(x.replace(",", "")) for x in
                       re.search(r"about ([0-9,.]+) GPU-hours of search trials .* and ([0-9,.]+) GPU-hours of verdict",
                                 out).groups())
    assert 3000 < verdict < 3300 and 0 < trials < verdict  # the paper's 3,166 GPU-hours; 30 runs at 194m


@pytest.mark.slow
def test_a_paper_sweep_searches_a_narrow_proxy_and_prices_it_against_a_full_size_search(tmp_path, capsys):
    settings = {"size": "194m", "width": "0.25"}
    sweeper = make_sweeper(tmp_path, "experiment=paper_scaling", "+hydra.sweeper.proxy.size=194m",
                           "+hydra.sweeper.proxy.width=0.25", "data=tokens", "data.path=data",
                           "trainer.accelerator=gpu", proxy=settings,
                           params={"size": "194m,241m,296m,436m,528m", "residual": "standard,block"})
    jobs = sweeper.jobs_of(["tune=lr", "experiment=paper_scaling", "data=tokens", "data.path=data",
                            "trainer.accelerator=gpu"])
    state = sweeper.start_state(tmp_path / "sweep", jobs)
    # a quarter of the 194M preset's 12 heads of 74, its SwiGLU width (4,864) shrunk alike, all 12 layers
    for group in state["groups"]:
        assert group["narrow"] == ["model.n_embd=222", "model.n_head=3", "model.n_layer=12", "model.mlp_hidden=1216"]
        assert group["target"] == ["model.parametrization=mup", "model.base_width=222", "model.base_n_head=3",
                                   "model.base_depth=12"]
    out = capsys.readouterr().out
    assert "search at size=194m, 222 wide (3 heads) x 12 layers (every job then runs under muP" in out
    trials, full = (float(x.replace(",", "")) for x in re.search(
        r"about ([0-9,.]+) GPU-hours of search trials \(the same search at every configuration's full size: "
        r"([0-9,.]+)\)", out).groups())
    assert 0 < trials < full / 10  # 20 narrow trials against 100 trials at the five sizes


@pytest.mark.slow
def test_a_narrow_proxy_runs_the_verdict_under_mup_with_the_proxy_as_its_base(tmp_path):
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 1.0, "block": 1.0}, "residual=standard,block",
                                    "num_blocks=2", "model.n_embd=64", "model.n_head=4", "seed=0", grid=GRID,
                                    proxy={"width": 0.5, "depth": 0.5})
    *search, verdict = launcher.batches
    assert {o for b in search for job in b for o in job if o.startswith("model.")} >= \
        {"model.n_embd=32", "model.n_head=2", "model.n_layer=4"}  # half the heads of 16, half the 8 layers
    assert not any(o.startswith("model.parametrization") for b in search for job in b for o in job)
    for job in verdict:
        assert {"model.parametrization=mup", "model.base_width=32", "model.base_n_head=2",
                "model.base_depth=4"} <= set(job)
        cfg = sweeper.compose(job)
        assert (cfg.model.n_embd, cfg.model.parametrization, cfg.model.base_width) == (64, "mup", 32)
    assert sorted(o for job in verdict for o in job if o.startswith("optim.optimizer.lr=")) == \
        ["optim.optimizer.lr=0.006"] * 2  # the proxy's choice (2 x the configured lr), carried over


@pytest.mark.parametrize("extra,proxy,named", [
    (("model.parametrization=mup",), {"width": 0.5}, "model.parametrization is set by hydra.sweeper.proxy"),
    ((), {"width": 1.5}, "hydra.sweeper.proxy.width=1.5 must be a fraction"),
    (("num_blocks=8",), {"depth": 0.5}, "gives a proxy of 2 layers (4 sublayers), which num_blocks=8 does not"),
])
def test_a_bad_narrow_proxy_is_refused_in_one_line(tmp_path, capsys, extra, proxy, named):
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, {"block": 0.0}, "residual=block", "model.n_layer=4", *extra, "seed=0", grid=GRID,
                    proxy=proxy)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_a_tuning_seed_that_is_a_verdict_seed_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, {"standard": 0.0}, "residual=standard", "seed=0,1000", grid=GRID)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnres-run: error: seed 1000 is both a tuning seed and a verdict seed")
    assert not (tmp_path / "sweep" / "tuning").exists()


def test_bad_search_settings_are_refused_before_anything_is_written(tmp_path, capsys):
    pytest.importorskip("optuna")
    space = {"optim.optimizer.lr": {"low": 1e-4, "high": 1e-2, "log": True}}
    for settings, words in (({"method": "optuna", "optuna": {"sampler": "cmaes", "space": space}}, "sampler=cmaes"),
                            ({"method": "optuna", "optuna": {"space": {"optim.optimizer.lr": {"low": 1}}}},
                             "is not a range"),
                            ({"grid": {**GRID, "points": 4}}, "grid.points=4 must be an odd number")):
        with pytest.raises(SystemExit) as exit_:
            run_sweeper(tmp_path, {"standard": 0.0}, "residual=standard", **settings)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
        assert not tuning.state_path(tmp_path / "sweep").exists()


def test_a_searched_key_also_set_on_the_command_line_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_sweeper(tmp_path, {"standard": 0.0}, "residual=standard", "optim.optimizer.lr=0.01", grid=GRID)
    assert "optim.optimizer.lr is both searched" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_search_replays_it_and_a_changed_one_is_refused(tmp_path, capsys):
    best = {"standard": 0.0, "block": 2.0}
    first, launcher = run_sweeper(tmp_path, best, "residual=standard,block", "seed=0,1", stop_after=1, grid=GRID)
    assert first.stopped == signal.SIGTERM and len(launcher.batches) == 2  # the first growth was cut short
    assert tuning.read_state(tmp_path / "sweep")["stage"] == "search"
    # resumed: the same batches again (a finished job is skipped by the launcher), then the verdict
    again, launcher = run_sweeper(tmp_path, best, "residual=standard,block", "seed=0,1", "resume=true", grid=GRID)
    state = tuning.read_state(tmp_path / "sweep")
    assert state["stage"] == "done" and {g["label"]: g["chosen"] for g in state["groups"]} == {"standard": 0,
                                                                                              "block": 2}
    # resumed with another grid: refused before anything runs, naming what changed
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, best, "residual=standard,block", "seed=0,1", "resume=true",
                    grid={**GRID, "points": 5}, tuning_seeds=[1000])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "the search changed since this tuned sweep started" in err
    assert "grid.points (3 -> 5)" in err and "tuning_seeds ([1000,1001] -> [1000])" in err


@pytest.mark.slow
def test_an_optuna_study_resumes_from_its_sqlite_file(tmp_path):
    optuna = pytest.importorskip("optuna")
    settings = {"method": "optuna", "optuna": {"trials": 4, "batch": 2, "seed": 3, "sampler": "tpe", "space": {
        "optim.optimizer.lr": {"low": 0.25, "high": 4.0, "log": True, "relative": True}}}}
    best = {"standard": 0.0, "block": 1.0}
    # stopped in the first round, half of its runs never started: their trials stay asked, not told
    first, launcher = run_sweeper(tmp_path, best, "residual=standard,block", "seed=0", stop_after=0,
                                  stop_at_job=3, **settings)
    db = tmp_path / "sweep" / "tuning" / "optuna.db"
    assert first.stopped == signal.SIGTERM and db.is_file()
    storage = f"sqlite:///{db}"
    before = {t.number: (t.state.name, t.params) for t in optuna.load_study(study_name="block", storage=storage).trials}
    assert [s for s, _ in before.values()] == ["RUNNING", "RUNNING"]  # block's runs never started
    told = optuna.load_study(study_name="standard", storage=storage).trials
    assert [t.state.name for t in told] == ["COMPLETE", "RUNNING"]  # one of its second trial's two seeds did not
    again, launcher = run_sweeper(tmp_path, best, "residual=standard,block", "seed=0", "resume=true", **settings)
    for arm in ("standard", "block"):
        trials = optuna.load_study(study_name=arm, storage=storage).trials
        assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)  # the same count per arm
    after = {t.number: t.params for t in optuna.load_study(study_name="block", storage=storage).trials}
    assert all(after[n] == params for n, (_, params) in before.items())  # re-run with the values it had asked
    state = tuning.read_state(tmp_path / "sweep")
    assert state["stage"] == "done" and all(g["chosen_params"] for g in state["groups"])
    assert tuning.budget_check(state["groups"])[0]


def test_relative_values_carry_over_to_a_proxy_and_another_size(tmp_path):
    # search at n_embd=32 (the proxy), run n_embd=32 and 48 at the same multiple of their own lr
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 1.0}, "residual=standard", "model.n_embd=32,48",
                                    "seed=0", grid=GRID, proxy={"model.n_embd": 32})
    state = tuning.read_state(tmp_path / "sweep")
    assert len(state["groups"]) == 1 and len(state["arms"]) == 2
    *search, verdict = launcher.batches
    assert {next(o for o in job if o.startswith("model.n_embd=")) for b in search for job in b} == {"model.n_embd=32"}
    assert sorted(next(o for o in job if o.startswith("optim.optimizer.lr=")) for job in verdict) == \
        ["optim.optimizer.lr=0.006"] * 2


# -- the command line: kill, resume ----------------------------------------------------------------------
TUNED = ["-m", "tune=lr", *TINY, "trainer.max_steps=6", "trainer.val_check_interval=6",
         "optim.schedule.warmup_steps=1", "residual=standard,block", "num_blocks=2", "seed=0,1",
         "hydra.sweeper.grid.points=3", "hydra.sweeper.grid.max_extend=0", "hydra.sweeper.tuning_seeds=[5]",
         "hydra.launcher.cpu_jobs=2"]  # growth at an edge: the in-process tests above


def finished(folder: Path) -> dict[str, float]:
    return {p.parent.name: p.stat().st_mtime for p in folder.glob("*/metrics.json")
            if json.loads(p.read_text()).get("status") == "finished"}


def stop_when(proc: subprocess.Popen, check, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, "the sweep ended before the moment to stop it"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


@pytest.mark.slow
def test_a_tuned_sweep_killed_mid_search_and_mid_verdict_resumes_without_redoing_a_run(tmp_path):
    args = [*CLI, *TUNED, "hydra.sweep.dir=tq"]
    sweep, trials = tmp_path / "tq", tmp_path / "tq" / "tuning"
    proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stop_when(proc, lambda: len(finished(trials)) >= 2)
    assert proc.returncode == 143
    done = finished(trials)
    resumed = run_cli(*TUNED[:], "hydra.sweep.dir=tq", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert all(finished(trials)[name] == mtime for name, mtime in done.items())  # not one finished trial redone
    assert "skipped (duplicate or finished)" in resumed.stderr + resumed.stdout
    out = resumed.stdout
    assert "verdict, each arm at its own best: block vs standard:" in out and "chosen: block:" in out
    assert "search budget: equal across arms" in out
    # a resume of the finished sweep runs nothing again; the same command without resume is refused
    whole = {**finished(sweep), **finished(trials)}
    again = run_cli(*TUNED, "hydra.sweep.dir=tq", "resume=true", cwd=tmp_path)
    assert again.returncode == 0 and {**finished(sweep), **finished(trials)} == whole
    assert "jobs already hold a run" in one_line_error(run_cli(*TUNED, "hydra.sweep.dir=tq", cwd=tmp_path))
    # killed mid-verdict: every trial is finished, and the resumed sweep runs only what the verdict lacks
    args2 = [*CLI, *TUNED, "hydra.sweep.dir=tv", "seed=0,1,2"]
    proc = subprocess.Popen([a for a in args2 if a != "seed=0,1"], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stop_when(proc, lambda: tuning.read_state(tmp_path / "tv").get("stage") == "verdict" and
              len(finished(tmp_path / "tv")) >= 1)
    trials_done = finished(tmp_path / "tv" / "tuning")
    verdict_done = finished(tmp_path / "tv")
    resumed = run_cli(*[a for a in TUNED if a != "seed=0,1"], "seed=0,1,2", "hydra.sweep.dir=tv", "resume=true",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert finished(tmp_path / "tv" / "tuning") == trials_done
    assert all(finished(tmp_path / "tv")[n] == m for n, m in verdict_done.items())
    assert len(finished(tmp_path / "tv")) == 6 and "paired t, 3 seeds" in resumed.stdout


@pytest.mark.slurm
@pytest.mark.slow
def test_a_tuned_sweep_runs_on_the_slurm_cluster(tmp_path):
    pytest.importorskip("attnres.sweep.slurm", reason="needs the slurm extra (hydra-submitit-launcher)")
    from tests.sweep.test_slurm import cluster_reason

    reason = cluster_reason()
    if reason:
        pytest.skip(reason)
    # 2 arms x a 1-point grid (the configured lr) x 1 tuning seed, then 2 verdict runs: two SLURM arrays
    result = run_cli("-m", "hydra/launcher=slurm", "hydra.launcher.poll_s=1", "tune=lr", *TINY, "trainer.max_steps=4",
                     "trainer.val_check_interval=4", "optim.schedule.warmup_steps=1", "residual=standard,block",
                     "num_blocks=2", "seed=0", "hydra.sweeper.tuning_seeds=[5]", "hydra.sweeper.grid.points=1",
                     "hydra.sweeper.grid.max_extend=0", "hydra.sweep.dir=ts", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state = tuning.read_state(tmp_path / "ts")
    assert state["stage"] == "done" and [g["chosen"] for g in state["groups"]] == [0, 0]
    for arm in state["arms"]:
        (job,) = arm["jobs"].values()
        assert json.loads((tmp_path / "ts" / job / "slurm.json").read_text())["job_id"]  # it ran as a SLURM job
        assert json.loads((tmp_path / "ts" / job / "metrics.json").read_text())["status"] == "finished"
    trials = list((tmp_path / "ts" / "tuning").glob("*/slurm.json"))
    assert len(trials) == 2
    assert "verdict, each arm at its own best: block vs standard" in result.stdout
    assert "STILL AT THE SEARCH'S EDGES (ONE POINT)" in result.stdout  # a 1-point grid is its own edge, and says so


def test_tune_without_a_sweep_is_refused_in_one_line(tmp_path):
    line = one_line_error(run_cli("tune=lr", *TINY, cwd=tmp_path))
    assert "tune=lr tunes the arms of a sweep" in line and "add -m" in line
    assert not (tmp_path / "outputs").exists()
