"""Seeds on demand (attnres/sweep/on_demand.py) in this process: a launcher that trains nothing writes
each job as a finished run whose val/bpb is known, so the loop's looks, stops and resume are checked
exactly; the CLI and SLURM runs are in test_on_demand_cli.py."""

from __future__ import annotations

import json
import math
import re
import signal

import pytest
from omegaconf import OmegaConf

import attnres.config.naming  # noqa: F401  (the attnres.run_id resolver of run folder names)
from attnres.config.errors import ConfigError
from attnres.config.on_demand import check
from attnres.results import sequential
from attnres.sweep import on_demand, plan, stopping
from tests.helpers import REPO


class FakeLauncher:
    """Runs nothing: each job of a batch becomes a finished run with val/bpb = 2 + effect[arm] + the
    arm's noise at its seed. `stop_in_batch`: in that batch (1-based) the sweep is stopped, as SIGTERM
    would, after its first `stop_after_jobs` jobs."""

    def __init__(self, config, loader, effect, noise, stop_in_batch=None, stop_after_jobs=0):
        from hydra.types import HydraContext

        self.config, self.hydra_context = config, HydraContext(config_loader=loader, callbacks=None)
        self.effect, self.noise = effect, noise
        self.stop_in_batch, self.stop_after_jobs = stop_in_batch, stop_after_jobs
        self.batches: list[list[list[str]]] = []
        self.ran: list[list[str]] = []

    def launch_batch(self, sweep_dir, job_overrides, initial_job_idx):
        self.batches.append([list(j) for j in job_overrides])
        planned = plan.plan_jobs(self, job_overrides, sweep_dir)
        for index, (overrides, cfg) in enumerate(planned):
            if len(self.batches) == self.stop_in_batch and index >= self.stop_after_jobs:
                stopping.stopped_by = signal.SIGTERM
                return []
            self.ran.append(list(overrides))
            folder = sweep_dir / str(cfg.hydra.sweep.subdir)
            arm, seed = cfg.hydra.runtime.choices.residual, int(cfg.seed)
            (folder / ".hydra").mkdir(parents=True, exist_ok=True)
            job = OmegaConf.to_container(cfg, resolve=False)
            job.pop("hydra")
            OmegaConf.save(OmegaConf.create(job), folder / ".hydra" / "config.yaml")
            OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"residual": arm}}}}),
                           folder / ".hydra" / "hydra.yaml")
            OmegaConf.save(OmegaConf.create([o for o in overrides if not o.startswith("hydra.")]),
                           folder / ".hydra" / "overrides.yaml")
            bpb = 2.0 + self.effect[arm] + self.noise[arm](seed)
            (folder / "metrics.json").write_text(json.dumps({"status": "finished", "metrics": {"val/bpb": bpb}}))
        return []


def sweep(tmp_path, effect, noise, *overrides, arms=("residual=standard", "residual=block"), **launcher_args):
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import setup_globals
    from hydra.types import RunMode

    setup_globals()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(REPO / "conf")))
    task = ["seeds.on_demand=true", *overrides]  # in every job's overrides, as Hydra's basic sweeper puts them
    config = loader.load_configuration("config", overrides=[f"hydra.sweep.dir={tmp_path / 'sweep'}", *task],
                                       run_mode=RunMode.MULTIRUN)
    launcher = FakeLauncher(config, loader, effect, noise, **launcher_args)
    stopping.stopped_by = None
    plan.sweep_jobs.clear()
    plan.sweep_notes.clear()
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir(exist_ok=True)
    try:
        on_demand.launch(launcher, sweep_dir, [[a, *task] for a in arms], 0, launcher.launch_batch)
    finally:
        launcher.stopped, stopping.stopped_by = stopping.stopped_by, None
    return launcher, sequential.read_record(sweep_dir)


def seeds_of(batch):
    return sorted({int(o.split("=")[1]) for job in batch for o in job if o.startswith("seed=")})


def small(scale):
    return lambda seed: scale * math.sin(1.7 * seed + 0.3)


@pytest.mark.slow
def test_a_clear_effect_adds_a_batch_then_stops_resolved(tmp_path):
    """Block 0.1 bpb better (5%, ten times the 0.5% margin) with a 0.002 spread: 3 seeds at look 1 are
    not enough under the design (df 2, early alpha almost unspent); 5 at look 2 resolve it."""
    launcher, record = sweep(tmp_path, {"standard": 0.0, "block": -0.1},
                             {"standard": small(0.0), "block": small(0.002)})
    assert [seeds_of(b) for b in launcher.batches] == [[0, 1, 2], [3, 4]]
    assert record["looks"] == [[0, 1, 2], [3, 4]] and not record["final"]
    assert record["stopped"] == "stopped at 5 seeds (look 2): every comparison resolved"
    assert on_demand.summary_line(tmp_path / "sweep").startswith(
        "seeds on demand: stopped at 5 seeds (look 2): every comparison resolved (group-sequential design")


def test_no_difference_resolves_as_equivalent(tmp_path):
    launcher, record = sweep(tmp_path, {"standard": 0.0, "block": 0.0},
                             {"standard": small(0.0), "block": small(0.0005)})
    assert record["stopped"].startswith("stopped at 5 seeds (look 2)")
    found = on_demand.plain_comparisons(tmp_path / "sweep", launcher.config, record)
    assert [c.verdict for c in found] == ["equivalent within the margin"]
    assert "repeated 95% interval of the sequential design at look 2" in found[0].sentence()


@pytest.mark.slow
def test_a_noisy_comparison_stops_at_the_maximum_and_says_which_is_open(tmp_path):
    launcher, record = sweep(tmp_path, {"standard": 0.0, "block": 0.0},
                             {"standard": small(0.0), "block": small(0.05)}, "seeds.max=7")
    assert [seeds_of(b) for b in launcher.batches] == [[0, 1, 2], [3, 4], [5, 6]]
    assert record["final"] and record["stopped"] == \
        "reached the maximum of 7 seeds (look 3): block vs standard still not resolved"


@pytest.mark.slow
def test_a_stopped_sweep_resumes_with_the_recorded_seeds_then_adds_looks(tmp_path):
    noise = {"standard": small(0.0), "block": small(0.05)}
    launcher, record = sweep(tmp_path, {"standard": 0.0, "block": 0.0}, noise, "seeds.max=7",
                             stop_in_batch=2, stop_after_jobs=1)
    assert launcher.stopped == signal.SIGTERM
    assert record["looks"] == [[0, 1, 2], [3, 4]] and record["stopped"].startswith("stopped by SIGTERM during look 2")
    resumed, record = sweep(tmp_path, {"standard": 0.0, "block": 0.0}, noise, "seeds.max=7", "resume=true")
    assert seeds_of(resumed.batches[0]) == [0, 1, 2, 3, 4]  # the recorded looks' seeds, not new ones
    assert seeds_of(resumed.ran[:3]) == [3, 4]  # the finished jobs were skipped: the stopped look's rest ran
    assert [seeds_of(b) for b in resumed.batches[1:]] == [[5, 6]]
    assert record["looks"] == [[0, 1, 2], [3, 4], [5, 6]] and record["stopped"].startswith("reached the maximum")


def test_a_resume_with_another_design_is_refused_in_one_line(tmp_path):
    noise = {"standard": small(0.0), "block": small(0.05)}
    sweep(tmp_path, {"standard": 0.0, "block": 0.0}, noise, "seeds.max=7", stop_in_batch=2)
    with pytest.raises(ConfigError, match=r"^the design of seeds on demand changed since this sweep started in .*: "
                                          r"seeds.batch=2 -> 3; resume it with the settings it started with"):
        sweep(tmp_path, {"standard": 0.0, "block": 0.0}, noise, "seeds.max=7", "seeds.batch=3", "resume=true")


def test_a_seed_on_the_command_line_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="picks the seeds itself"):
        sweep(tmp_path, {"standard": 0.0}, {"standard": small(0.0)}, arms=("seed=0", "seed=1"))


@pytest.mark.parametrize("override, message", [
    ("start=2", "seeds.start=2 must be an integer of at least 3 (two seeds barely estimate a spread)"),
    ("max=2", "seeds.max=2 must be an integer of at least 3"),
    ("batch=0", "seeds.batch=0 must be an integer of at least 1"),
    ("alpha=0.7", "seeds.alpha=0.7 must be a number above 0 and below 0.5"),
    ("on_demand=yes", "seeds.on_demand=yes is not true or false"),
])
def test_bad_settings_are_one_line(override, message):
    node = {"on_demand": True, "first": 0, "start": 3, "batch": 2, "max": 10, "alpha": 0.05}
    key, value = override.split("=")
    node[key] = {"start": 2, "max": 2, "batch": 0, "alpha": 0.7, "on_demand": "yes"}[key]
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        check(OmegaConf.create({"seeds": node}))
    node = {"on_demand": True, "first": 0, "start": 5, "batch": 2, "max": 4, "alpha": 0.05}
    with pytest.raises(ConfigError, match="seeds.max=4 is below seeds.start=5"):
        check(OmegaConf.create({"seeds": node}))


# -- tuned sweeps: the looks are the tuned sweeper's verdict stages ------------------------------------------
@pytest.mark.slow
def test_a_tuned_sweep_runs_its_looks_after_the_search(tmp_path):
    """Both arms' best lr is the configured one and the surface's seed noise is the same for both arms:
    every paired difference is 0, equivalent within the margin at the first look."""
    from tests.sweep.test_tuned import GRID, run_sweeper

    sweeper, launcher = run_sweeper(tmp_path, {"standard": 0.0, "block": 0.0}, "residual=standard,block",
                                    "seeds.on_demand=true", grid=GRID)
    verdict_batches = [b for b in launcher.batches if not any("tuning/" in o for o in b[0])]
    assert [seeds_of(b) for b in verdict_batches] == [[0, 1, 2]]
    record = sequential.read_record(tmp_path / "sweep")
    assert record["looks"] == [[0, 1, 2]]
    assert record["stopped"] == "stopped at 3 seeds (look 1): every comparison resolved"
    assert all(sorted(arm["jobs"], key=int) == ["0", "1", "2"] for arm in sweeper_state(tmp_path)["arms"])


@pytest.mark.parametrize("design, verdict", [
    ([], "verdict: seeds on demand, 6 runs on seeds 0, 1, 2 first, then 2 seeds a look while a verdict is not "
         "resolved, up to 20 runs on seeds 0-9"),
    (["seeds.first=5", "seeds.start=4", "seeds.batch=1", "seeds.max=6"],
     "verdict: seeds on demand, 8 runs on seeds 5, 6, 7, 8 first, then 1 seed a look while a verdict is not "
     "resolved, up to 12 runs on seeds 5-10"),
    (["seeds.start=3", "seeds.max=3"], "verdict: seeds on demand, 6 runs on seeds 0, 1, 2 first, no later look"),
])
def test_a_tuned_sweeps_start_line_names_the_designs_seeds(tmp_path, capsys, design, verdict):
    """It said "verdict: 2 runs on seeds 0": the configured seed, which seeds on demand never runs."""
    from tests.sweep.test_tuned import GRID, make_sweeper

    sweeper = make_sweeper(tmp_path, "seeds.on_demand=true", *design, grid=GRID)
    jobs = sweeper.jobs_of(["tune=lr", "residual=standard,block", "seeds.on_demand=true", *design])
    sweeper.start_state(tmp_path / "sweep", jobs)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tuned sweep: "))
    assert line.endswith(verdict), line

def sweeper_state(tmp_path):
    from attnres.results import tuning

    return tuning.read_state(tmp_path / "sweep")


def test_a_tuned_sweep_refuses_seeds_on_demand_that_reach_its_tuning_seeds(tmp_path, capsys):
    from tests.sweep.test_tuned import GRID, run_sweeper

    with pytest.raises(SystemExit) as stop:
        run_sweeper(tmp_path, {"standard": 0.0, "block": 0.0}, "residual=standard,block", "seeds.on_demand=true",
                    "seeds.first=995", grid=GRID)
    assert stop.value.code == 2
    assert "seed 1000, 1001 is both a tuning seed and one seeds on demand may add (seeds.first=995 to 1004)" in \
        capsys.readouterr().err
