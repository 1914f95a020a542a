"""Issue 50 ("Trust, round four"), the tuned sweeper's items: a crashed trial is never scored (1), a
search with no possible answer is refused or fails (4), the summary counts what is on disk (5), the
documented optimiser comparison and a centre of the user's choice (6), sweeper settings refused in
one line (7, 8), a refusal writes nothing (9), muP's checks before the start line (12).

In this process over test_tuned.py's known loss surface, as its tests are; the `slow` test runs the
command line and SIGKILLs a trial's job process."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import time

import pytest

from attnres.config.errors import user_errors
from attnres.results import summarize, tuning
from attnres.sweep import plan, slots, stopping
from tests.helpers import CLI, REPO, TINY, cli_env
from tests.sweep.test_tuned import GRID, SurfaceLauncher, make_sweeper, run_sweeper


@pytest.fixture(autouse=True)
def _clean_sweep_globals():
    for registry in (plan.sweep_jobs, plan.sweep_notes, plan.outcomes, plan.diverged):
        registry.clear()
    getattr(plan, "unanswered", set()).clear()
    yield
    for registry in (plan.sweep_jobs, plan.sweep_notes, plan.outcomes, plan.diverged):
        registry.clear()
    getattr(plan, "unanswered", set()).clear()
    stopping.stopped_by = None


class CrashingLauncher(SurfaceLauncher):
    """The surface, but the job at lr `crash_lr` of arm `crash_arm` on seed `crash_seed` is killed
    (as an out-of-memory kill is) its first `crashes` times."""

    def __init__(self, *args, crash_arm="standard", crash_lr=1.5e-3, crash_seed=1000, crashes=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash = (crash_arm, crash_lr, crash_seed)
        self.crashes_left = crashes

    def launch(self, batch, initial_job_idx):
        super().launch(batch, initial_job_idx)
        for overrides in batch:
            cfg = self.sweeper.compose(overrides)
            job = (cfg.hydra.runtime.choices.residual, float(cfg.optim.optimizer.lr), int(cfg.seed))
            if job == self.crash and self.crashes_left > 0:
                self.crashes_left -= 1
                metrics = self.sweeper.run_dir(overrides)[1] / "metrics.json"
                killed = {"status": "failed", "error": "killed by signal SIGKILL (out of memory?)"}
                metrics.write_text(json.dumps(killed))
        return []


def crashing_sweep(tmp_path, crashes, best):
    sweeper = make_sweeper(tmp_path, grid=GRID)
    sweeper.launcher = CrashingLauncher(sweeper, best, crash_lr=1.5e-3, crashes=crashes)
    sweeper.sweep(["tune=lr", "residual=standard,block", "seed=0,1"])
    return sweeper, sweeper.launcher


# -- 1. a crashed trial ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_trial_runs_again_and_the_choice_rests_on_every_point(tmp_path, capsys):
    # standard's best lies one factor below the configured lr: exactly the point whose trial is killed
    sweeper, launcher = crashing_sweep(tmp_path, crashes=1, best={"standard": -1.0, "block": 0.0})
    assert "1 trial failed" in capsys.readouterr().out
    retry = launcher.batches[1]
    assert len(retry) == 1 and retry[0][-1] == "resume=true"  # from its checkpoint, in its own folder
    state = tuning.read_state(tmp_path / "sweep")
    standard = next(g for g in state["groups"] if g["label"] == "standard")
    assert all(t["status"] == "finished" for t in standard["trials"])
    assert standard["chosen"] == -1  # scored as the worst it would have been 0 or the grown point -2
    assert state["stage"] == "done" and plan.exit_status() == 0


@pytest.mark.slow
def test_a_trial_killed_twice_stops_the_search_before_choosing(tmp_path, capsys):
    sweeper, launcher = crashing_sweep(tmp_path, crashes=2, best={"standard": -1.0, "block": 0.0})
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 trial of the search failed twice" in err[0] and "resume=true" in err[0]
    state = tuning.read_state(tmp_path / "sweep")
    assert state["stage"] == "search" and all(g.get("chosen") is None for g in state["groups"])
    assert len(launcher.batches) == 2  # the search and its one retry: no verdict
    assert plan.exit_status() == 1


# -- 4. no answer possible -----------------------------------------------------------------------------
@pytest.mark.parametrize("settings,extra,words", [
    ({"metric": "val/los"}, (), "hydra.sweeper.metric=val/los is not a metric the runs write (did you mean val/loss?)"),
    ({"baseline": "residual:nosuch"}, (), "hydra.sweeper.baseline=residual:nosuch matches no arm"),
    ({"baseline": "optim:adamw"}, (), "no arm differs from it in optim alone"),
])
def test_a_search_that_could_give_no_verdict_is_refused_before_it_runs(tmp_path, capsys, settings, extra, words):
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, {"standard": 0.0, "block": 0.0}, "residual=standard,block", "seed=0", *extra,
                    grid=GRID, **settings)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_an_arm_whose_every_trial_diverged_fails_the_sweep(tmp_path, capsys):
    sweeper = make_sweeper(tmp_path, grid={**GRID, "max_extend": 0})
    sweeper.launcher = SurfaceLauncher(sweeper, {"standard": 0.0})
    sweeper.launcher.diverge_above = 1e-4  # every lr of the grid
    sweeper.sweep(["tune=lr", "residual=standard", "seed=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no trial of the search ended with a finite val/loss" in err[0]
    assert plan.exit_status() == 1


@pytest.mark.slow
def test_a_full_disk_mid_search_is_one_line_and_resumable(tmp_path, capsys, monkeypatch):
    real, calls = tuning.write_state, []

    def fills_on_the_third_write(sweep_dir, state):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tuning.state_path(sweep_dir)))
        real(sweep_dir, state)

    monkeypatch.setattr(tuning, "write_state", fills_on_the_third_write)
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, {"standard": 0.0}, "residual=standard", "seed=0", grid=GRID)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnres-run: error: disk full writing") and "resume=true" in err[0]
    monkeypatch.setattr(tuning, "write_state", real)
    plan.sweep_jobs.clear()
    plan.sweep_notes.clear()
    again, _ = run_sweeper(tmp_path, {"standard": 0.0}, "residual=standard", "seed=0", "resume=true", grid=GRID)
    assert tuning.read_state(tmp_path / "sweep")["stage"] == "done"


# -- 5. the count of a sweep killed mid-search ----------------------------------------------------------
class DiesAfter(SurfaceLauncher):
    """Runs the first `n` jobs of the first batch, then the sweep process dies (as by SIGKILL)."""

    def __init__(self, *args, n=3, **kwargs):
        super().__init__(*args, **kwargs)
        self.n = n

    def launch(self, batch, initial_job_idx):
        super().launch(batch[:self.n], initial_job_idx)
        raise SystemError("SIGKILL")


@pytest.mark.slow
def test_summarize_counts_the_trials_that_finished_before_the_sweep_died(tmp_path, capsys):
    sweeper = make_sweeper(tmp_path, grid=GRID)
    sweeper.launcher = DiesAfter(sweeper, {"standard": 0.0, "block": 0.0})
    with pytest.raises(SystemError):
        sweeper.sweep(["tune=lr", "residual=standard,block", "seed=0"])
    capsys.readouterr()
    assert summarize.main([str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert "standard: not chosen yet: the search was stopped with 3 of its trials finished" in out, out
    assert "6 trials each at first" in out and "None trials" not in out


# -- 6. the documented optimiser comparison, and a centre of one's choice --------------------------------
def test_the_optimiser_comparison_of_the_docs_starts(tmp_path):
    keys = ["optim.optimizer.lr", "optim.optimizer.muon.lr"]
    sweeper = make_sweeper(tmp_path, "optim=adamw", grid={**GRID, "keys": keys}, baseline="optim:adamw")
    jobs = sweeper.jobs_of(["tune=lr", "optim=adamw,muon", "seed=0,1,2"])
    sweeper.check(jobs)
    state = sweeper.start_state(tmp_path / "sweep", jobs)
    arms = {a["baseline_value"]: a for a in state["arms"]}
    assert arms["muon"]["baseline"] == arms["adamw"]["label"] and arms["adamw"]["is_baseline"]
    centres = [g["centre"] for g in state["groups"]]
    assert centres == [{"optim.optimizer.lr": 3e-3}, {"optim.optimizer.lr": 3e-3, "optim.optimizer.muon.lr": 0.03}]


def test_the_grid_centres_on_a_value_of_ones_choice(tmp_path):
    sweeper, launcher = run_sweeper(tmp_path, {"standard": -2.0}, "residual=standard", "seed=0",
                                    grid={**GRID, "max_extend": 0, "centre": {"optim.optimizer.lr": 7.5e-4}})
    search, verdict = launcher.batches
    lrs = sorted(float(o.split("=")[1]) for job in search for o in job if o.startswith("optim.optimizer.lr="))
    assert lrs == [3.75e-4, 3.75e-4, 7.5e-4, 7.5e-4, 1.5e-3, 1.5e-3]
    assert [o for o in verdict[0] if o.startswith("optim.optimizer.lr=")] == ["optim.optimizer.lr=0.00075"]
    assert tuning.read_state(tmp_path / "sweep")["signature"]["grid"]["centre"] == {"optim.optimizer.lr": 7.5e-4}


# -- 7, 8, 9. settings refused in one line, and nothing written ---------------------------------------------
REFUSED = [
    ({"tuning_seeds": [0]}, "seed 0 is both a tuning seed and a verdict seed"),
    ({"grid": {**GRID, "points": 4}}, "hydra.sweeper.grid.points=4 must be an odd number"),
    ({"method": "grd"}, "hydra.sweeper.method=grd is not a search method"),
    ({"untuned": "maybe"}, "hydra.sweeper.untuned=maybe is not a boolean; write hydra.sweeper.untuned=true or "
                           "hydra.sweeper.untuned=false"),
    ({"untuned": "no"}, "hydra.sweeper.untuned=no is not a boolean"),
    ({"tuning_seeds": "abc"}, "hydra.sweeper.tuning_seeds=abc is not a list of integer seeds"),
    ({"method": "optuna", "optuna": {"seed": "abc", "space": {"optim.optimizer.lr": {"low": 1e-4, "high": 1e-2}}}},
     "hydra.sweeper.optuna.seed=abc is not an integer"),
    ({"proxy": {"widht": "0.25"}}, "hydra.sweeper.proxy.widht is not a proxy setting (did you mean "
                                   "hydra.sweeper.proxy.width?)"),
    ({"metric": "val/los"}, "hydra.sweeper.metric=val/los"),
]


@pytest.mark.parametrize("settings,words", REFUSED, ids=[w.split(" ")[0] for _, w in REFUSED])
def test_a_refused_tuned_sweep_leaves_no_lock_and_no_folder(tmp_path, capsys, monkeypatch, settings, words):
    if settings.get("method") == "optuna":
        pytest.importorskip("optuna")
    monkeypatch.chdir(tmp_path)
    sweeper = make_sweeper(tmp_path, **settings)
    sweeper.launcher = SurfaceLauncher(sweeper, {"standard": 0.0})
    sweep_dir = tmp_path / "sweep"
    with user_errors():
        slots.lock_sweep_dir(sweep_dir)  # as the sweep callback does before the sweeper runs
    with pytest.raises(SystemExit) as exit_:
        sweeper.sweep(["tune=lr", "residual=standard", "seed=0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not sweep_dir.exists() and not sweeper.launcher.batches
    assert str(sweep_dir.resolve()) not in slots._sweep_locks


# -- 12. muP's checks --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,words", [
    (["model.base_width=0"], "model.base_width=0 is out of range; set model.base_width to an integer >= 1"),
    (["model.base_width=7"], "model.base_width=7 must split into model.n_head=4 heads of an even size"),
    (["model.depth_alpha=-1"], "model.depth_alpha=-1 is out of range"),
])
def test_mup_settings_are_refused_in_one_line_before_the_run_starts(capsys, extra, words):
    from attnres.config.command import check_command_line

    with pytest.raises(SystemExit) as exit_, user_errors():
        check_command_line(["model.parametrization=mup", *extra], REPO / "conf")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


# -- 1, on the command line: a trial's job process SIGKILLed ------------------------------------------------
@pytest.mark.slow
def test_a_trial_sigkilled_on_the_command_line_runs_again_before_anything_is_chosen(tmp_path):
    args = [*CLI, "-m", "tune=lr", *TINY, "trainer.max_steps=6", "trainer.val_check_interval=6",
            "optim.schedule.warmup_steps=1", "residual=standard", "seed=0", "hydra.sweeper.grid.points=1",
            "hydra.sweeper.grid.max_extend=0", "hydra.sweeper.tuning_seeds=[5]", "hydra.sweep.dir=k"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline, killed = time.monotonic() + 300, None
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        listing = subprocess.run(["ps", "-eww", "-o", "pid,ppid,args"], capture_output=True, text=True).stdout
        for line in listing.splitlines():
            pid, ppid, *rest = line.split(None, 2)
            if rest and "attnres.sweep.job" in rest[0] and f"{tmp_path}/k/tuning/" in rest[0]:  # this sweep's only
                os.kill(int(pid), signal.SIGKILL)  # as the kernel's out-of-memory killer would
                killed = int(pid)
                break
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=600)
    assert killed is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert "1 trial failed" in out and "running it again, once" in out
    state = tuning.read_state(tmp_path / "k")
    (trial,) = state["groups"][0]["trials"]
    assert trial["status"] == "finished" and math.isfinite(trial["value"]) and state["stage"] == "done"
