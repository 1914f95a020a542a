"""`hydra.sweeper.method=given` (attnres/sweep/tuned_given.py): each arm at values chosen before, no
search; the verdict (once, or with seeds on demand) as after a search. Issue 49 item 7 runs REPORT.md
section 7's extension this way, at the lrs its search chose.

The sweeper runs in this process over test_tuned.py's launcher, which trains nothing: it writes each
job's metrics.json from a known loss surface (the loss is lowest at each arm's `best`)."""

from __future__ import annotations

import pytest

from attnres.results import sequential, tuning
from attnres.results.tuned_summary import write_tuned_summary
from tests.sweep.test_tuned import make_sweeper, run_sweeper

GIVEN = {"standard": {"optim.optimizer.lr": 0.024}, "block": {"optim.optimizer.lr": 0.012}}
ARMS = "residual=standard,block"


def test_no_search_runs_and_each_arm_runs_its_verdict_at_its_given_values(tmp_path):
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 3.0, "block": 2.0}, ARMS, "seed=0,1,2",
                                    method="given", given=GIVEN)
    assert len(launcher.batches) == 1  # the verdict alone: no trial ran
    verdict = launcher.batches[0]
    assert not any("tuning/" in o for job in verdict for o in job)
    lrs = {(job[1], job[-1]) for job in verdict}
    assert lrs == {(f"residual={arm}", f"seed={s}") for arm in ("standard", "block") for s in (0, 1, 2)}
    at = {job[1]: next(o for o in job if o.startswith("optim.optimizer.lr=")) for job in verdict}
    assert at == {"residual=standard": "optim.optimizer.lr=0.024", "residual=block": "optim.optimizer.lr=0.012"}
    state = tuning.read_state(tmp_path / "sweep")
    assert state["stage"] == "done" and state["signature"]["given"] == GIVEN
    groups = {g["label"]: g for g in state["groups"]}
    assert groups["block"]["chosen_values"] == {"optim.optimizer.lr": 0.012} and groups["block"]["trials"] == []
    assert groups["standard"]["centre_ratio"] == {"optim.optimizer.lr": pytest.approx(8.0)}


def test_the_summary_says_the_values_were_given_and_no_search_ran(tmp_path):
    # the surface's best lies at each arm's given lr (log2(0.024/0.003) = 3, log2(0.012/0.003) = 2): equal losses
    run_sweeper(tmp_path, {"standard": 3.0, "block": 2.0}, ARMS, "seed=0,1,2", method="given", given=GIVEN)
    rows, lines = write_tuned_summary(tmp_path / "sweep")
    chosen = [line for line in lines if line.startswith("chosen: ")]
    assert chosen == ["chosen: standard: optim.optimizer.lr=0.024 (8x the configured 0.003), given "
                      "(hydra.sweeper.given): no search ran",
                      "chosen: block: optim.optimizer.lr=0.012 (4x the configured 0.003), given "
                      "(hydra.sweeper.given): no search ran"]
    assert "search budget: no search ran: each arm at its given values" in "\n".join(lines)
    assert lines[0].startswith("verdict, each arm at its own best: block vs standard:")
    assert {r["stage"] for r in rows} == {"tuned"} and len(rows) == 6
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "no search ran" in summary
    assert "The search:" not in summary and "## The search" not in summary  # it read "None trials of ;"


def test_the_start_line_names_each_arms_values_and_the_designs_seeds(tmp_path, capsys):
    sweeper = make_sweeper(tmp_path, "seeds.on_demand=true", "seeds.start=5", "seeds.batch=3", "seeds.max=17",
                           method="given", given=GIVEN)
    jobs = sweeper.jobs_of(["tune=lr", ARMS, "seeds.on_demand=true"])
    sweeper.check(jobs)
    sweeper.start_state(tmp_path / "sweep", jobs)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tuned sweep: "))
    assert line == ("tuned sweep: 2 arms; no search (hydra.sweeper.method=given): standard at "
                    "optim.optimizer.lr=0.024, block at optim.optimizer.lr=0.012; verdict: seeds on demand, "
                    "10 runs on seeds 0, 1, 2, 3, 4 first, then 3 seeds a look while a verdict is not resolved, "
                    "up to 34 runs on seeds 0-16")


@pytest.mark.slow
def test_seeds_on_demand_run_their_looks_at_the_given_values(tmp_path):
    """Equal losses at each arm's given lr and the same seed noise in both arms: every paired
    difference is 0, equivalent within the margin at the first look."""
    sweeper, launcher = run_sweeper(tmp_path, {"standard": 3.0, "block": 2.0}, ARMS, "seeds.on_demand=true",
                                    method="given", given=GIVEN)
    assert [sorted({int(o[-1].split("=")[1]) for o in b}) for b in launcher.batches] == [[0, 1, 2]]
    record = sequential.read_record(tmp_path / "sweep")
    assert record["stopped"] == "stopped at 3 seeds (look 1): every comparison resolved"


@pytest.mark.parametrize("settings, extra, words", [
    ({"method": "given"}, (), "hydra.sweeper.method=given needs each arm's values in hydra.sweeper.given"),
    ({"method": "given", "given": {"standard": {"optim.optimizer.lr": 0}, "block": {"optim.optimizer.lr": 1e-3}}},
     (), "hydra.sweeper.given.standard.optim.optimizer.lr=0 must be a number above 0"),
    ({"method": "given", "given": {"standard": {"optim.optimizer.lr": 1e-3}}}, (),
     "hydra.sweeper.given has no values for the arm block; give every arm its values (the arms: standard, block)"),
    ({"method": "given", "given": {**GIVEN, "blok": {"optim.optimizer.lr": 1e-3}}}, (),
     "hydra.sweeper.given names blok, which is no arm of this sweep (did you mean block?)"),
    ({"method": "given", "given": {"standard": {"optim.optimizer.lr": 1e-3},
                                   "block": {"optim.optimizer.lr": 1e-3, "optim.optimizer.weight_decay": 0.1}}},
     (), "hydra.sweeper.given.standard lacks optim.optimizer.weight_decay, which another arm sets"),
    ({"method": "given", "given": GIVEN, "prune": {"rungs": [0.5], "keep": 0.5}}, (),
     "hydra.sweeper.prune works with method=grid"),
    ({"method": "given", "given": GIVEN}, ("optim.optimizer.lr=0.01",), "optim.optimizer.lr is both searched"),
    ({"method": "gridd"}, (), "hydra.sweeper.method=gridd is not a search method; use grid or optuna (or given"),
    ({"given": GIVEN}, (), "hydra.sweeper.given is set, but hydra.sweeper.method=grid searches; add "
                           "hydra.sweeper.method=given"),
])
def test_bad_given_settings_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, settings, extra,
                                                                              words):
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, {"standard": 0.0, "block": 0.0}, ARMS, *extra, "seed=0", **settings)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not tuning.state_path(tmp_path / "sweep").exists()


def test_a_resume_with_other_given_values_is_refused(tmp_path, capsys):
    run_sweeper(tmp_path, {"standard": 3.0, "block": 2.0}, ARMS, "seed=0", method="given", given=GIVEN)
    other = {**GIVEN, "block": {"optim.optimizer.lr": 0.006}}
    with pytest.raises(SystemExit) as exit_:
        run_sweeper(tmp_path, {"standard": 3.0, "block": 2.0}, ARMS, "seed=0", "resume=true", method="given",
                    given=other)
    assert exit_.value.code == 2
    assert "the search changed since this tuned sweep started" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["given", "grid"])
def test_a_priced_sweep_with_seeds_on_demand_prices_the_first_look_and_the_maximum(tmp_path, capsys, method):
    """The verdict's GPU-hours were priced on one seed per arm (the configured seed, which seeds on
    demand never runs): 1/3 of the first look's, 1/10 of the most the design may run."""
    import re

    paper = ["experiment=paper_scaling", "data=tokens", "data.path=data", "trainer.accelerator=gpu"]
    params = {"size": "194m", "residual": "standard,block"}

    def priced(*extra, seeds=()):
        settings = {"method": "given", "given": GIVEN} if method == "given" else {}
        sweeper = make_sweeper(tmp_path, *paper, *extra, params=params, **settings)
        jobs = sweeper.jobs_of(["tune=lr", *paper, *extra, *seeds])
        sweeper.start_state(tmp_path / "sweep", jobs)
        return capsys.readouterr().out

    on_demand = priced("seeds.on_demand=true", "seeds.start=3", "seeds.max=10")
    first, most = (float(x.replace(",", "")) for x in re.search(
        r"([0-9,.]+) GPU-hours for the first look, up to ([0-9,.]+) GPU-hours at seeds.max of verdict runs",
        on_demand).groups())
    fixed = float(re.search(r"([0-9,.]+) GPU-hours of verdict runs", priced(seeds=["seed=0,1,2"]))
                  .group(1).replace(",", ""))
    assert first == pytest.approx(fixed, rel=0.01) and most == pytest.approx(fixed * 10 / 3, rel=0.01)
    assert fixed > 0
