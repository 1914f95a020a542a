"""Successive halving in the tuned search (`hydra.sweeper.prune`, attnres/sweep/tuned_halving.py; issue 49
item 6): the promotion rule, the same rungs for every arm, the grid's growth, a killed sweep resumed
without training a step twice, the start line's and the summary's budget, the refusals.

The sweeper runs in this process over a launcher that trains nothing: it writes each job's
metrics.json from a known loss surface at the step the job trains to (`stop_at_step`), and counts the
steps each folder trains, continuing a paused folder from its step as a resumed run does."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnres.results import tuning
from attnres.sweep import plan, stopping, tuned_halving
from tests.sweep.test_tuned import CENTRE, make_sweeper

MAX_STEPS = 8
GRID = {"points": 5, "factor": 2.0, "max_extend": 0, "keys": ["optim.optimizer.lr"]}
PRUNE = {"rungs": [0.25, 0.5], "keep": 0.5}


class StepSurfaceLauncher:
    """val/loss at step s of the point at log2(lr / 3e-3) = x: (x - best(arm, s))^2 + 1 + 4 / s + seed noise."""

    def __init__(self, sweeper, best, stop_after: int | None = None) -> None:
        self.sweeper, self.best, self.stop_after = sweeper, best, stop_after
        self.batches: list[list[list[str]]] = []
        self.trained: list[tuple[str, int, int]] = []  # (folder, from step, to step) of every run that trained

    @property
    def config(self):
        return self.sweeper.config

    @property
    def hydra_context(self):
        return self.sweeper.hydra_context

    def launch(self, batch, initial_job_idx):
        self.batches.append([list(b) for b in batch])
        if self.stop_after is not None and len(self.batches) > self.stop_after:
            stopping.stopped_by = signal.SIGTERM  # killed before this batch ran
            return []
        sweep_dir = Path(str(self.sweeper.config.hydra.sweep.dir))
        for overrides, cfg in plan.plan_jobs(self, batch, sweep_dir):
            name, folder = self.sweeper.run_dir(overrides)
            before = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").is_file() else {}
            start = before.get("steps", 0) if cfg.resume else 0
            stop = cfg.stop_at_step if cfg.stop_at_step is not None else int(cfg.trainer.max_steps)
            if stop <= start:
                continue  # nothing to do, as run.py says
            self.trained.append((name, start, stop))
            lr, seed = float(OmegaConf.select(cfg, "optim.optimizer.lr")), int(cfg.seed)
            arm = cfg.hydra.runtime.choices.residual
            best = self.best[arm](stop) if callable(self.best[arm]) else self.best[arm]
            loss = (math.log2(lr / CENTRE) - best) ** 2 + 1.0 + 4.0 / stop + 0.01 * math.sin(seed)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "metrics.json").write_text(json.dumps({
                "status": "finished", "steps": stop, "metrics": {"val/loss": loss},
                "stopped_by": "stop_at_step" if cfg.stop_at_step is not None else "trainer.max_steps"}))
        return []


def run(tmp_path: Path, best, *extra: str, stop_after: int | None = None, prune=PRUNE, grid=GRID):
    sweeper = make_sweeper(tmp_path, f"trainer.max_steps={MAX_STEPS}",
                           *[e for e in extra if "," not in e], grid=grid, prune=prune)
    sweeper.launcher = StepSurfaceLauncher(sweeper, best, stop_after)
    stopping.stopped_by = None
    plan.sweep_jobs.clear()
    try:
        sweeper.sweep(["tune=lr", f"trainer.max_steps={MAX_STEPS}", *extra])
    finally:
        sweeper.stopped, stopping.stopped_by = stopping.stopped_by, None
    return sweeper, sweeper.launcher, tuning.read_state(tmp_path / "sweep")


# -- the rule -----------------------------------------------------------------------------------------
def test_the_best_ceil_keep_n_go_on_ties_to_the_point_nearer_the_configured_value():
    seeds, steps = [1, 2], [2, 4, 8]
    values = {(p, s): {2: v} for p, v in {-2: 3.0, -1: 2.0, 0: 2.5, 1: 2.0, 2: 1.0}.items() for s in seeds}
    todo, alive = tuned_halving.next_runs([-2, -1, 0, 1, 2], values, seeds, steps, 0.5)
    # ceil(0.5 * 5) = 3 go on: 2 (1.0), then -1 and 1 (2.0); 0 (2.5) and -2 (3.0) stop at step 2
    assert alive == [] and sorted(todo) == [(-1, 4), (1, 4), (2, 4)]
    values[(0, 1)][2] = 1.5  # 0's mean is 2.0 now: a three-way tie, and 0 is the nearest the configured value
    todo, _ = tuned_halving.next_runs([-2, -1, 0, 1, 2], values, seeds, steps, 0.5)
    assert sorted(todo) == [(-1, 4), (0, 4), (2, 4)]
    values[(2, 1)] = {2: math.inf}  # a diverged seed makes its point the worst
    todo, _ = tuned_halving.next_runs([-2, -1, 0, 1, 2], values, seeds, steps, 0.5)
    assert sorted(todo) == [(-1, 4), (0, 4), (1, 4)]
    for p in (-1, 0, 1):  # every value at step 4 in: the two best of the three go on to the full length
        for s in seeds:
            values[(p, s)][4] = {-1: 1.5, 0: 1.2, 1: 1.4}[p]
    todo, _ = tuned_halving.next_runs([-2, -1, 0, 1, 2], values, seeds, steps, 0.5)
    assert sorted(todo) == [(0, 8), (1, 8)]
    # 5 points, keep 0.5, rungs at 2 and 4 of 8: 5 x 2 + 3 x 2 + 2 x 4 = 24 steps, against 40 unpruned
    assert tuned_halving.trained_steps(5, steps, 0.5) == 24


@pytest.mark.slow  # a tuned sweep in process, training every trial (integration)
def test_every_arm_runs_the_same_rungs_and_picks_what_the_unpruned_grid_picks(tmp_path):
    best = {"standard": 0.0, "block": 1.0}
    sweeper, launcher, state = run(tmp_path / "p", best, "residual=standard,block", "seed=0")
    assert [g["rung_steps"] for g in state["groups"]] == [[2, 4, 8], [2, 4, 8]]
    for group in state["groups"]:  # per arm and seed: 5 points to 2, 3 on to 4, 2 on to 8
        reached = sorted(max(map(int, t["rungs"])) for t in group["trials"] if t["seed"] == 1000)
        assert reached == [2, 2, 4, 8, 8], (group["label"], reached)
        assert group["trained_steps"] == 2 * 24
    assert {g["label"]: g["chosen"] for g in state["groups"]} == {"standard": 0, "block": 1}
    assert search_steps(launcher) == 2 * 2 * 24  # 2 arms x 2 seeds: no step trained twice
    unpruned, plain, whole = run(tmp_path / "u", best, "residual=standard,block", "seed=0", prune={"rungs": []})
    assert {g["label"]: g["chosen"] for g in whole["groups"]} == {"standard": 0, "block": 1}
    assert search_steps(plain) == 2 * 2 * 5 * MAX_STEPS
    equal, text = tuning.budget_check(state["groups"])
    assert equal and "pruned at the same rungs, equal across arms: rungs at 0.25, 0.5 of the steps" in text
    assert "block 48" in text and "standard 48" in text
    mixed = [g for g in whole["groups"] if g["label"] == "standard"] + \
        [g for g in state["groups"] if g["label"] == "block"]
    equal, text = tuning.budget_check(mixed)  # an unpruned arm against a pruned one
    assert not equal and "standard: 10 trials of" in text and "unpruned" in text
    state["groups"][1]["prune"] = {"rungs": [0.5], "keep": 0.5}
    equal, text = tuning.budget_check(state["groups"])
    assert not equal and text.startswith("NOT equal across arms") and "rungs at 0.5 of the steps" in text


@pytest.mark.slow  # a tuned sweep in process, training every trial (integration)
def test_a_grown_point_enters_at_the_first_rung(tmp_path):
    # block's best lies 3 factors up, past the 5-point grid (-2..2): the grid grows up once
    grid = {**GRID, "max_extend": 1}
    sweeper, launcher, state = run(tmp_path, {"standard": 0.0, "block": 3.0}, "residual=standard,block", "seed=0",
                                   grid=grid)
    block = next(g for g in state["groups"] if g["label"] == "block")
    assert block["exponents"] == [-2, -1, 0, 1, 2, 3] and block["chosen"] == 3
    grown = {t["job"] for t in block["trials"] if t["point"] == 3}
    assert len(grown) == 2 and all(sorted(map(int, t["rungs"])) == [2, 4, 8] for t in block["trials"]
                                   if t["point"] == 3)
    for job in grown:  # each tuning seed's folder: from the first rung up
        assert [(a, b) for name, a, b in launcher.trained if name == job] == [(0, 2), (2, 4), (4, 8)]


@pytest.mark.slow  # a tuned sweep in process, training every trial (integration)
def test_a_killed_pruned_sweep_resumes_without_training_a_step_twice(tmp_path):
    best = {"standard": 0.0, "block": lambda step: 2.0 if step < 4 else 1.0}  # the early best is not the last
    first, killed, _ = run(tmp_path, best, "residual=standard,block", "seed=0", stop_after=1)
    assert first.stopped == signal.SIGTERM
    again, resumed, state = run(tmp_path, best, "residual=standard,block", "seed=0", "resume=true")
    assert state["stage"] == "done"
    trained = [r for r in killed.trained + resumed.trained if r[0].startswith("tuning/")]
    by_folder: dict[str, list[tuple[int, int]]] = {}
    for name, a, b in trained:
        by_folder.setdefault(name, []).append((a, b))
    for name, spans in by_folder.items():  # each folder's runs follow on from one another
        assert [a for a, _ in spans] == [0, *[b for _, b in spans[:-1]]], (name, spans)
    straight = run(tmp_path / "s", best, "residual=standard,block", "seed=0")[2]
    assert {g["label"]: g["chosen"] for g in state["groups"]} == {g["label"]: g["chosen"] for g in straight["groups"]}
    assert sum(b - a for _, a, b in trained) == sum(g["trained_steps"] for g in straight["groups"])
    # the finished sweep resumed runs nothing
    _, idle, _ = run(tmp_path, best, "residual=standard,block", "seed=0", "resume=true")
    assert idle.trained == []


def search_steps(launcher: StepSurfaceLauncher) -> int:
    return sum(b - a for name, a, b in launcher.trained if name.startswith("tuning/"))


def test_the_start_line_counts_the_pruned_steps(tmp_path, capsys):
    run(tmp_path, {"standard": 0.0}, "residual=standard", "seed=0")
    out = capsys.readouterr().out
    assert "10 runs (10 per arm), pruned by successive halving at steps 2, 4 of 8 keeping 0.5 of the points" in out
    assert "the training steps of 6.0 full runs per arm (60% of the unpruned grid)" in out


@pytest.mark.parametrize(("prune", "named"), [
    ({"rungs": [0.5, 0.25]}, "hydra.sweeper.prune.rungs=[0.5,0.25] must be fractions of trainer.max_steps"),
    ({"rungs": [0.0, 0.5]}, "hydra.sweeper.prune.rungs=[0.0,0.5] must be"),
    ({"rungs": [0.5, 1.0]}, "hydra.sweeper.prune.rungs=[0.5,1.0] must be"),
    ({"rungs": [0.5], "keep": 1.0}, "hydra.sweeper.prune.keep=1.0 must be a fraction between 0 and 1"),
    ({"rungs": [0.1, 0.12]}, "pause at steps [1,1]: each rung needs a step of its own"),
], ids=["decreasing", "zero", "one", "keep-all", "same-step"])
def test_bad_prune_settings_are_refused_in_one_line_writing_nothing(tmp_path, capsys, prune, named):
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path, {"standard": 0.0}, "residual=standard", "seed=0", prune={"keep": 0.5, **prune})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert named in err and len([x for x in err.splitlines() if x.startswith("attnres-run: error:")]) == 1
    assert not (tmp_path / "sweep" / "tuning").exists()


def test_pruning_an_optuna_study_is_refused(tmp_path, capsys):
    sweeper = make_sweeper(tmp_path, method="optuna", prune=PRUNE)
    with pytest.raises(SystemExit):
        sweeper.launcher = StepSurfaceLauncher(sweeper, {"standard": 0.0})
        sweeper.sweep(["tune=optuna", "residual=standard", "seed=0"])
    assert "hydra.sweeper.prune works with method=grid" in capsys.readouterr().err


# -- the command line: a real pruned sweep, and the replay of an unpruned one ----------------------------
@pytest.mark.slow
def test_the_replay_of_an_unpruned_sweep_is_what_the_pruned_sweep_did(tmp_path):
    from tests.helpers import load_experiment, run_cli, tiny

    # 3 lrs of one arm, 8 steps validated every 2: rungs at steps 2 and 4, then 8
    base = ["-m", "tune=lr", *tiny(steps=8, val_every=2, logger=True, progress_bar=False),
            "optim.schedule.warmup_steps=1", "residual=standard", "seed=0", "hydra.sweeper.grid.points=3",
            "hydra.sweeper.grid.max_extend=0", "hydra.sweeper.tuning_seeds=[5]", "hydra.launcher.cpu_jobs=2"]
    for folder, extra in (("u", []), ("p", ["hydra.sweeper.prune.rungs=[0.25,0.5]"])):
        result = run_cli(*base, *extra, f"hydra.sweep.dir={folder}", cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    replay = load_experiment("halving_replay")
    (row,) = replay.replay(tmp_path / "u", [0.25, 0.5], 0.5)
    (group,) = tuning.read_state(tmp_path / "p")["groups"]
    assert row["pruned"] == group["chosen"] and row["steps"] == group["rung_steps"] == [2, 4, 8]
    assert row["pruned_steps"] == group["trained_steps"] == 3 * 2 + 2 * 2 + 1 * 4
    # each rung value of the pruned sweep is the unpruned trial's validation at that step (pause + resume exact)
    curves = replay._values(tmp_path / "u", tuning.read_state(tmp_path / "u")["groups"][0], [2, 4, 8], "val/loss")
    for trial in group["trials"]:
        for step, value in trial["rungs"].items():
            assert value == pytest.approx(curves[(trial["point"], trial["seed"])][int(step)], rel=1e-6)
