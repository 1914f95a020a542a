"""Part tuned_seeds of the CPU study (experiments/reproduce/tuned_seeds_part.py; issue 49 item 7): section
7's comparison extended by seeds on demand. The section is built from a real tuned sweep with
`hydra.sweeper.method=given` and seeds on demand, run in this process over test_tuned.py's launcher (which
trains nothing: each job's val/loss comes from a known surface), so the per-seed gaps are known."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys

import pytest

from attnres.results import sequential
from tests.helpers import REPO
from tests.sweep.test_tuned import run_sweeper

sys.path.insert(0, str(REPO / "experiments" / "reproduce"))
part = pytest.importorskip("tuned_seeds_part")  # experiments/reproduce/tuned_seeds_part.py
GIVEN = {"standard": {"optim.optimizer.lr": 0.024}, "block": {"optim.optimizer.lr": 0.012}}


def _study(tmp_path, block_best=2.05):
    """runs/tuned_seeds: standard at its surface's best (loss 1 + 0.01 sin(seed)), block 0.05 factors of 2
    off its best (0.0025 higher): block minus standard = 0.25 / mean(1 + 0.01 sin(seed)) percent."""
    run_sweeper(tmp_path, {"standard": 3.0, "block": block_best}, "residual=standard,block", "seeds.on_demand=true",
                "verdict.margin=1.06%", method="given", given=GIVEN)
    out = tmp_path / "runs"
    out.mkdir()
    (tmp_path / "sweep").rename(out / part.FOLDER)
    return out


def test_no_runs_say_what_to_run(tmp_path):
    text, claims = part.section(tmp_path / "runs", tmp_path / "figs")
    assert text == ["Not run yet: `python experiments/reproduce/run.py --parts tuned_seeds`."] and claims == []


@pytest.mark.slow
def test_the_section_pairs_the_seeds_gives_the_designs_interval_and_the_answer(tmp_path):
    out = _study(tmp_path)
    text, claims = part.section(out, tmp_path / "figs")
    body = "\n".join(text)
    design = sequential.read_record(out / part.FOLDER)
    seeds = [s for look in design["looks"] for s in look]
    assert seeds == [0, 1, 2] and design["stopped"].startswith("stopped at 3 seeds (look 1)")
    base = statistics.fmean(1 + 0.01 * math.sin(s) for s in seeds)
    gaps = {s: 100 * 0.0025 / base for s in seeds}  # the surface, by hand
    for s in seeds:
        std, blk = 1 + 0.01 * math.sin(s), 1.0025 + 0.01 * math.sin(s)
        assert f"| {s} | {std:.4f} | {blk:.4f} | {gaps[s]:+.2f}% |" in text
    mean = statistics.fmean(gaps.values())
    assert f"**{mean:+.2f}% [" in body and "the design's repeated 95% interval at look 1" in body
    assert "infinite because" not in body  # a finite interval says nothing of it
    # +0.25% with a spread of rounding: above 0, below the 1.06% margin, as the sweep's own line says
    assert "Verdict at the 1.06% margin: **worse, by less than the margin**" in body
    assert "**The answer**: Block AttnRes is worse once both are tuned, by less than the margin (1.06%), " \
           "from 3 seeds." in body
    assert "Where it stopped: stopped at 3 seeds (look 1): every comparison resolved (look 1: seeds 0-2)." in body
    assert "```text\nverdict, each arm at its own best: block vs standard: worse, by less than the margin" in body
    assert claims == []


@pytest.mark.slow
def test_the_section_is_rebuilt_from_its_record_without_the_runs(tmp_path):
    out = _study(tmp_path)
    kept = tmp_path / "results"
    first, _ = part.section(out, tmp_path / "figs", record=kept)
    shutil.rmtree(out / part.FOLDER)
    again, _ = part.section(out, tmp_path / "figs", record=kept)
    assert again[0].startswith(first[0]) and "Built from results/tuned_seeds.json" in again[0]
    assert again[1:] == first[1:]


@pytest.mark.slow
def test_the_part_splices_its_section_after_section_7_once(tmp_path, monkeypatch):
    report = pytest.importorskip("report")  # experiments/reproduce/report.py
    out = _study(tmp_path)
    shutil.copy(report.HERE / "REPORT.md", tmp_path / "REPORT.md")
    monkeypatch.setattr(report, "HERE", tmp_path)
    for _ in range(2):  # twice: replaced where it stands, never added again
        written, kept = report.update_report(out, ["tuned_seeds"])
    text = written.read_text()
    assert "section(s) of part(s) tuned_seeds updated" in kept
    assert text.count(f"## {part.TITLE}") == 1 and text.count("| tuned_seeds |") == 1
    assert text.index(f"## {report.TUNED_TITLE}") < text.index(f"## {part.TITLE}") < \
        text.index(f"## {report.TASKS_TITLE}")
    assert (tmp_path / "results" / "tuned_seeds.json").is_file()


@pytest.mark.slow
def test_a_study_paused_by_a_signal_says_it_is_not_finished_and_gives_no_answer(tmp_path):
    """A SIGTERM's stop is recorded as `stopped by SIGTERM during look 1`: not where the design stopped."""
    run_sweeper(tmp_path, {"standard": 3.0, "block": 2.05}, "residual=standard,block", "seeds.on_demand=true",
                "verdict.margin=1.06%", stop_after=0, stop_at_job=5, method="given", given=GIVEN)
    out = tmp_path / "runs"
    out.mkdir()
    (tmp_path / "sweep").rename(out / part.FOLDER)
    assert sequential.read_record(out / part.FOLDER)["stopped"].startswith("stopped by SIGTERM during look 1")
    body = "\n".join(part.section(out, tmp_path / "figs")[0])
    assert "Not finished: look 1: seeds 0-2, 2 of its seeds with both arms so far; " \
           "`python experiments/reproduce/run.py --parts tuned_seeds` continues it (resume)." in body
    assert "Where it stopped" not in body and "not resolved yet at 2 seeds" in body
    assert "[-inf, +inf]** (2 seeds; the design's repeated 95% interval at look 1, valid whichever look it " \
           "stopped at; infinite because the design spends almost none of its 5% at the early looks" in body
    # the same pause once run.py's clock says the part's budget is spent: where and why it stopped, for good
    (out / "state.json").write_text(json.dumps({"tuned_seeds": {"wall_s": part.BUDGET_H * 3600 + 5}}))
    kept = tmp_path / "results"
    first = part.section(out, tmp_path / "figs", record=kept)[0]
    body = "\n".join(first)
    assert "Where it stopped: the part's budget of 3 hours (3.00 h of wall time over its runs, on a machine " \
           "other work shared for part of it) was spent during look 1 (look 1: seeds 0-2), with 2 seeds with " \
           "both arms." in body and "Not finished" not in body
    assert "**The answer**: not resolved within the 3-hour budget, at 2 seeds; resolving a margin of 1.06%" in body
    shutil.rmtree(out / part.FOLDER)  # the record alone says the same
    assert part.section(out, tmp_path / "figs", record=kept)[0][1:] == first[1:]
