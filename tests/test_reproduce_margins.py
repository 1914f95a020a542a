"""The reproduction report's margin verdicts (experiments/reproduce/verdicts.py): the runner's words
and power (attnres.results.verdict, power) beside each loss comparison, from per-seed values or
from a printed mean, 95% interval and seed count (the same code path); and the per-seed records
the report's builder keeps (experiments/reproduce/records.py)."""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import sys
from pathlib import Path

import pytest
from scipy import stats

from attnres.results import tuning
from attnres.results.verdict import compare
from tests.helpers import REPO

HERE = REPO / "experiments" / "reproduce"
sys.path.insert(0, str(HERE))
report = pytest.importorskip("report")  # experiments/reproduce/report.py (and the modules beside it)
import blocksize_part  # noqa: E402
import ordering_part  # noqa: E402
import records  # noqa: E402
import shapes_part  # noqa: E402
import study  # noqa: E402
import tuned_part  # noqa: E402
import verdicts  # noqa: E402

MarginVerdict = verdicts.MarginVerdict


def _printed(values):
    """An Effect's mean and 95% interval as REPORT.md prints them (two decimals)."""
    effect = study.Effect(dict(enumerate(values)))
    return effect, (round(effect.mean, 2), round(effect.ci[0], 2), round(effect.ci[1], 2))


@pytest.mark.parametrize("n", [3, 5, 8])
def test_the_sd_recovered_from_a_printed_interval_reproduces_it(n):
    rng = random.Random(n)
    for _ in range(50):
        values = [rng.gauss(-1.0, rng.uniform(0.1, 1.5)) for _ in range(n)]
        effect, (mean, low, high) = _printed(values)
        found = MarginVerdict.from_printed(mean, low, high, n)
        half = stats.t.ppf(0.975, n - 1) * found.sd / math.sqrt(n)
        # the recovered sd, around the unrounded mean, gives the printed bounds back (to their rounding)
        assert abs(effect.mean - half - low) <= 0.005 + 1e-9 and abs(effect.mean + half - high) <= 0.005 + 1e-9
        true_half = (effect.ci[1] - effect.ci[0]) / 2
        assert found.sd == pytest.approx(statistics.stdev(values), rel=0.005 / true_half + 1e-9)


def test_the_reports_task_interval_gives_the_sd_of_its_per_seed_table():
    """REPORT.md section 8 prints both the interval (+28.72 pt [-3.16, +60.60], 5 seeds) and the
    per-seed accuracies; the sd recovered from the one is the other's."""
    standard, block = [0.684, 0.294, 0.326, 0.760, 0.348], [0.604, 0.628, 0.778, 0.916, 0.922]
    diffs = [100 * (b - s) for b, s in zip(block, standard, strict=True)]
    found = MarginVerdict.from_printed(28.72, -3.16, 60.60, 5, verdicts.ACCURACY)
    assert found.sd == pytest.approx(statistics.stdev(diffs), rel=1e-3)


# per-seed gaps (% of the baseline) -> the runner's words at a 0.5% margin
CASES = {
    "better-by-margin": [-1.3, -1.1, -1.2, -1.0, -1.25],
    "better-within": [-0.2, -0.25, -0.3, -0.22, -0.28],
    "better-unsure": [-0.9, -0.1, -0.5, -0.3, -0.7],
    "equivalent": [0.05, -0.1, 0.02, -0.04, 0.08, -0.01],
    "worse-by-margin": [1.2, 1.0, 1.3, 1.1, 0.9],
    "not-resolved": [1.5, -1.4, 0.3, -0.9, 1.1],
    "two-seeds": [-1.2, -1.0],
}


@pytest.mark.parametrize("gaps", CASES.values(), ids=CASES.keys())
def test_the_margin_verdict_is_the_runners_for_the_same_comparison(gaps):
    """The runner's `compare` on losses whose baseline is 100 and whose arm is 100 + gap (so that a gap
    in percent is its difference, and 0.5% of the baseline is 0.5) says what MarginVerdict says."""
    found = MarginVerdict.from_effect(study.Effect(dict(enumerate(gaps))))
    rows = [{"seed": s, "status": "finished", "val/loss": 100.0 + g} for s, g in enumerate(gaps)]
    base = [{"seed": s, "status": "finished", "val/loss": 100.0} for s in range(len(gaps))]
    runner = compare(rows, base, "val/loss", "block", "standard")
    assert runner.margin == pytest.approx(found.margin) == pytest.approx(0.5)
    assert found.words == runner.verdict
    assert (found.comparison().detectable, found.comparison().seeds_needed) == \
        (pytest.approx(runner.detectable, rel=1e-6), runner.seeds_needed)
    assert found.words.split(",")[0].split(";")[0] in found.text()


def test_held_together_is_the_runners_interval_for_arms_sharing_a_baseline():
    """compare_arms holds K arms against one baseline at 1 - 0.05 / K: held_with(K) gives its interval and words."""
    from attnres.results.verdict import compare_arms

    arms = {"block": [-1.3, -0.7, -1.0, -1.6, -0.9], "full": [-1.9, -1.2, -1.5, -1.1, -1.8]}
    base = [{"seed": s, "status": "finished", "val/loss": 100.0} for s in range(5)]
    runner = compare_arms([([{"seed": s, "status": "finished", "val/loss": 100.0 + g} for s, g in enumerate(gaps)],
                            base, name, "standard") for name, gaps in arms.items()], "val/loss")
    for found, gaps in zip(runner, arms.values(), strict=True):
        held = MarginVerdict.from_effect(study.Effect(dict(enumerate(gaps)))).held_with(2)
        assert found.arms == 2 and held.ci == pytest.approx(found.ci, abs=1e-9) and held.words == found.verdict
    line = verdicts.held_together([(name, MarginVerdict.from_effect(study.Effect(dict(enumerate(g)))))
                                   for name, g in arms.items()])
    assert line.startswith("Held together, as a sweep's verdicts hold the 2 comparisons that share one baseline "
                           "(97.5% intervals, Bonferroni): block: ")


def test_the_accuracy_margin_is_one_point_and_the_runners():
    standard, block = [0.40, 0.50, 0.30, 0.45], [0.46, 0.55, 0.37, 0.47]
    gaps = {s: 100 * (b - a) for s, (a, b) in enumerate(zip(standard, block, strict=True))}
    found = MarginVerdict.from_effect(study.Effect(gaps), verdicts.ACCURACY)
    runner = compare([{"seed": s, "status": "finished", verdicts.ACCURACY: v} for s, v in enumerate(block)],
                     [{"seed": s, "status": "finished", verdicts.ACCURACY: v} for s, v in enumerate(standard)],
                     verdicts.ACCURACY, "block", "standard")
    assert found.margin == 1.0 and found.words == runner.verdict == "better by at least the margin"
    assert found.comparison().detectable == pytest.approx(100 * runner.detectable, rel=1e-6)
    assert found.comparison().seeds_needed == runner.seeds_needed
    assert " pt with 4 seeds" in found.text()


def test_per_seed_values_and_their_printed_interval_give_the_same_words():
    rng = random.Random(7)
    for _ in range(40):
        values = [rng.gauss(rng.uniform(-1.5, 1.5), rng.uniform(0.05, 1.0)) for _ in range(5)]
        effect, printed = _printed(values)
        runs, seen = MarginVerdict.from_effect(effect), MarginVerdict.from_printed(*printed, 5)
        if len(verdicts.rounding_effect(seen)[0]) == 1:  # no bound within the rounding of a margin or 0
            assert runs.words == seen.words
        assert abs(runs.comparison().seeds_needed - seen.comparison().seeds_needed) <= \
            max(1, 0.02 * runs.comparison().seeds_needed)


def _without_margins(text):
    """A report as it was before the margin verdicts: each addition of margins_from_printed taken out."""
    lines, out, strip = text.split("\n"), [], False
    if verdicts.MARGIN_DEFINITION in lines:  # a blank line, the paragraph, a blank line and the note
        at = lines.index(verdicts.MARGIN_DEFINITION)
        assert lines[at + 2].startswith("*In this copy the margin verdicts")
        del lines[at - 1:at + 3]
    lines = [line for i, line in enumerate(lines) if not line.startswith("Held together")
             and not (line == "" and i + 1 < len(lines) and lines[i + 1].startswith("Held together"))]
    for line in lines:
        if line.startswith("|") and line.endswith(f" {verdicts.MARGIN_COLUMN} |"):
            line, strip = line[: -len(f" {verdicts.MARGIN_COLUMN} |")], True
        elif strip and line.startswith("|---"):
            line = line[:-4]
        elif strip and line.startswith("|"):
            line = line[: line[:-2].rindex(" |") + 2]
        else:
            strip = False
        out.append(line.split(" Margin verdict")[0])
    return "\n".join(out)


def test_the_committed_report_is_margins_from_printed_of_its_own_numbers():
    """REPORT.md's margin verdicts are the function's output on its printed numbers, not hand-edited,
    and a second pass adds nothing."""
    committed = (HERE / "REPORT.md").read_text()
    assert verdicts.MARGIN_DEFINITION in committed and committed.count("Margin verdict") >= 9
    rebuilt, found = verdicts.margins_from_printed(_without_margins(committed), report.PRINTED_SEEDS)
    date, today = (text.split("were computed on ")[1][:10] for text in (committed, rebuilt))
    # only the stamp's date differs; another date in the report (a section's "Added on") stays as committed
    assert rebuilt.replace(f"were computed on {today}", f"were computed on {date}") == committed
    assert len(found) == 21  # 9 claim lines, 9 table rows, the tuned and task paragraphs (1 and 2)
    assert verdicts.margins_from_printed(committed, report.PRINTED_SEEDS) == (committed, [])


def _runs(gaps, shape="deep"):
    """A shape's runs: standard at 3.1 + a seed's offset, each other strategy `gaps` % off it."""
    runs = []
    for seed in range(5):
        base = 3.1 + 0.01 * seed
        for strategy, gap in (("standard", [0.0] * 5), *gaps.items()):
            loss = base * (1 + gap[seed] / 100)
            runs.append(study.Run("ordering", shape, strategy, seed, "finished", loss, loss / 1.69, 18000.0,
                                  4_915_200, 196_000, 154_000, Path(f"/nowhere/{shape}/{strategy}/{seed}")))
    return runs


DEEP = {"block N=4": [-1.3, -0.7, -1.0, -1.6, -0.9], "full": [-1.9, -1.2, -1.5, -1.1, -1.8],
        "block N=8": [-0.2, -0.6, -0.3, -0.5, -0.4], "block N=2": [-0.8, 0.1, -0.4, -1.2, 0.3]}
SHALLOW = {"block N=2": [0.2, -0.1, 0.15, 0.05, -0.05]}
SECTIONS = {  # section -> (its table rows with a margin verdict, its claims with one, arms held together, builder)
    "1-ordering": (3, 3, 2, lambda runs, figs: ordering_part.part_ordering(runs)),
    "2-blocksize": (4, 1, 4, lambda runs, figs: blocksize_part.part_blocksize(runs, figs)),
    "3-depth": (2, 2, 0, lambda runs, figs: shapes_part.part_depth(runs)),  # two baselines: deep and shallow
}


@pytest.mark.parametrize("name", SECTIONS)
def test_a_rebuild_from_runs_and_the_printed_path_write_the_same_lines(name, tmp_path):
    """A section from per-seed runs carries margin verdicts; take them out and margins_from_printed puts
    the same ones back from the printed numbers."""
    rows, noted, held_arms, build = SECTIONS[name]
    text, claims = build(_runs(DEEP) + _runs(SHALLOW, "shallow"), tmp_path)
    section = "\n".join(claims + [""] + text)
    assert sum(line.startswith("| ") and "; the margin needs" in line for line in text) == rows
    assert sum(" Margin verdict (0.5% of the baseline): " in line for line in claims) == noted
    printed = verdicts.margins_from_printed(_without_margins(section), 5)[0]
    power = r"80% power at ([\d.]+)% with 5 seeds; the margin needs (\d+) seeds"
    held = r"\[([-+][\d.]+), ([-+][\d.]+)\]\.?(?=;|$)"  # the held-together intervals, around the printed mean
    assert re.sub(held, "HELD", re.sub(power, "POWER", printed), flags=re.M) == \
        re.sub(held, "HELD", re.sub(power, "POWER", section), flags=re.M)  # all but the power figures
    for (seen, seen_k), (exact, exact_k) in zip(re.findall(power, printed), re.findall(power, section), strict=True):
        assert abs(float(seen) - float(exact)) <= 0.011 and abs(int(seen_k) - int(exact_k)) <= 1  # the rounding
    assert section.count("Held together") == (held_arms > 0)
    assert f"Held together, as a sweep's verdicts hold the {held_arms} comparisons" in section or not held_arms
    for seen, exact in zip(re.findall(held, printed, re.M), re.findall(held, section, re.M), strict=True):
        assert all(abs(float(a) - float(b)) <= 0.021 for a, b in zip(seen, exact, strict=True))


def _fake_tasks(out, values):
    targets = {"standard": "attnres.residual.standard.StandardResidual",
               "block": "attnres.residual.block.BlockAttentionResidual"}
    for seed, arms in values.items():
        for arm, (acc, loss) in arms.items():
            job = out / "tasks" / f"residual={arm},seed={seed}"
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nresidual:\n  _target_: {targets[arm]}\n")
            (job / "metrics.json").write_text(json.dumps({
                "status": "finished", "wall_time_s": 60.0, "tasks": {"seconds": 2.0},
                "metrics": {"attnres_pointer/acc": acc, "val/loss": loss, "val/accuracy": 0.5}}))


def test_the_report_keeps_a_per_seed_record_of_the_runs_it_has(tmp_path, monkeypatch):
    import shutil

    values = {0: {"standard": (0.40, 1.00), "block": (0.46, 0.98)},
              1: {"standard": (0.50, 1.10), "block": (0.55, 1.05)},
              2: {"standard": (0.30, 0.90), "block": (0.37, 0.90)}}
    _fake_tasks(tmp_path / "runs", values)
    shutil.copy(HERE / "REPORT.md", tmp_path / "REPORT.md")
    monkeypatch.setattr(report, "HERE", tmp_path)
    written, _ = report.update_report(tmp_path / "runs", ["tasks"])
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["tasks.json"]  # only the part it has
    kept = records.read_record(tmp_path / "results", "tasks")
    acc = {arm: records.per_seed(kept, verdicts.ACCURACY, arm=arm) for arm in ("standard", "block")}
    assert acc == {arm: {s: v[arm][0] for s, v in values.items()} for arm in ("standard", "block")}
    # the record alone gives the margin verdict the section printed from the runs
    gaps = study.Effect({s: 100 * (acc["block"][s] - acc["standard"][s]) for s in values})
    assert f"accuracy (1 point): {MarginVerdict.from_effect(gaps, verdicts.ACCURACY).text()}" in written.read_text()


def test_a_refused_rebuild_writes_no_record(tmp_path, monkeypatch, capsys):
    import run

    monkeypatch.setattr(report, "HERE", tmp_path)
    (tmp_path / "empty").mkdir()
    assert run.main(["--report-only", "--out", str(tmp_path / "empty")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_the_tuned_record_holds_each_arms_verdict_runs(tmp_path):
    sweep = tmp_path / "runs" / tuned_part.FOLDER
    arms = []
    for arm, lr in (("standard", 0.024), ("block", 0.012)):
        jobs = {}
        for seed, loss in enumerate((3.0, 3.1)):
            job = f"residual={arm},seed={seed}"
            (sweep / job).mkdir(parents=True)
            (sweep / job / "metrics.json").write_text(json.dumps({"status": "finished",
                                                                  "metrics": {"val/loss": loss + lr}}))
            jobs[str(seed)] = job
        arms.append({"label": arm, "group": arm, "jobs": jobs, "overrides": [f"residual={arm}"]})
    groups = [{"label": a["label"], "chosen_values": {"optim.optimizer.lr": lr}} for a, lr in zip(arms, (0.024, 0.012),
                                                                                                  strict=True)]
    tuning.write_state(sweep, {"arms": arms, "groups": groups, "stage": "done"})
    runs = tuned_part.verdict_runs(tmp_path / "runs")
    assert records.per_seed(runs, "val/loss", arm="block", stage="tuned") == {0: 3.012, 1: 3.112}
    assert {r["chosen"]["optim.optimizer.lr"] for r in runs if r["arm"] == "standard"} == {0.024}
    with pytest.raises(ValueError, match="seed 0 recorded twice"):
        records.per_seed(runs + runs[:1], "val/loss", arm=runs[0]["arm"], stage="tuned")


def test_a_report_from_no_runs_states_the_margin(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "HERE", tmp_path)
    text = report.write_report(tmp_path / "runs").read_text()
    assert f"{verdicts.DEFINITIONS}\n\n{verdicts.MARGIN_DEFINITION}\n" in text
    assert "`verdict.margin` = 0.5% of the baseline's loss" in text and "In this copy" not in text
    assert not (tmp_path / "results").exists()  # no runs, no record
