"""Verdicts on downstream tasks (eval.tasks): one per strategy and task metric, paired by seed, the
direction right (accuracy up, bits per byte down), and the task columns in the sweep's summary."""

from __future__ import annotations

import csv
import json
import math

import pytest

from attnres.results import task_verdicts, verdict
from attnres.results.summary import terminal_table

T_975_DF2 = 4.302652729749464  # Student t 97.5% quantile, 2 degrees of freedom (tables)
ACC = {0: (0.50, 0.60), 1: (0.40, 0.52), 2: (0.45, 0.56)}  # seed: (standard, block) accuracy
BPB = {0: (2.00, 2.10), 1: (2.02, 2.11), 2: (2.01, 2.12)}  # block worse on bits per byte


def job(tmp_path, residual, seed, acc, bpb):
    """A run folder holding what attnres-run writes after eval.tasks, and its summary row."""
    folder = tmp_path / f"residual={residual},seed={seed}"
    folder.mkdir()
    tasks = {"attnres_pointer/acc": acc, "attnres_bpb/bits_per_byte": bpb}
    metrics = {"status": "finished", "metrics": {"val/accuracy": 0.5, **tasks},
               "tasks": {"metrics": tasks, "lm_eval_version": "0.4.x", "seconds": 1.0}}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return {"job": folder.name, "path": folder, "config": residual, "seed": seed, "status": "finished",
            "is_baseline": residual == "standard", "exact": (), "match": (), "val/accuracy": 0.5,
            "wall_time_s": 1.0, "tokens_per_sec": 100.0}


@pytest.fixture
def rows(tmp_path):
    return [job(tmp_path, name, seed, ACC[seed][i], BPB[seed][i])
            for seed in ACC for i, name in enumerate(("standard", "block"))]


def test_task_accuracy_is_higher_is_better_and_bits_per_byte_lower():
    assert verdict.higher_is_better("attnres_pointer/acc") and verdict.higher_is_better("hellaswag/acc_norm")
    assert verdict.higher_is_better("gsm8k/exact_match_strict-match") and verdict.higher_is_better("val/accuracy")
    assert not verdict.higher_is_better("attnres_bpb/bits_per_byte")
    assert not verdict.higher_is_better("wikitext/word_perplexity") and not verdict.higher_is_better("val/bpb")
    assert not verdict.higher_is_better("val/loss") and not verdict.higher_is_better("train/acc")


def test_one_verdict_per_strategy_and_task_metric_paired_by_seed(rows):
    keys = task_verdicts.attach(rows)
    assert keys == ["attnres_pointer/acc", "attnres_bpb/bits_per_byte"]
    found = {c.metric: c for c in task_verdicts.comparisons(rows, keys)}
    acc = found["attnres_pointer/acc"]
    d = [ACC[s][1] - ACC[s][0] for s in ACC]  # 0.10, 0.12, 0.11
    half = T_975_DF2 * 0.01 / math.sqrt(3)
    assert acc.method == "paired t" and acc.n == 3 and acc.mean == pytest.approx(sum(d) / 3)
    assert acc.ci == pytest.approx((0.11 - half, 0.11 + half), abs=1e-9)
    assert acc.verdict == "better by at least the margin" and (acc.wins, acc.losses) == (3, 0)
    line = acc.sentence()
    assert line.startswith("block vs standard: better by at least the margin, +0.1100 attnres_pointer/acc "
                           "[+0.0852, +0.1348]"), line
    assert "margin 0.0100 = 1 point" in line  # verdict.margin_points: 1 point of a 0-1 accuracy
    assert "higher is better" in line and "3/3 seeds favour block" in line
    bpb = found["attnres_bpb/bits_per_byte"]
    assert bpb.verdict == "worse by at least the margin" and bpb.losses == 3 and "lower is better" in bpb.sentence()
    assert task_verdicts.lines(rows) == [acc.sentence(), bpb.sentence()]


def test_the_summary_gets_the_task_columns_and_verdicts(rows, tmp_path):
    from attnres.results import summary

    sweep = tmp_path
    table = terminal_table(rows)
    assert "attnres_pointer/acc" in table.splitlines()[0] and "0.52" in table
    for r in rows:  # what write_sweep_summary reads, faked: the rows as collect_rows made them
        r.pop("attnres_pointer/acc", None)
    original = summary.collect_rows
    summary.collect_rows = lambda *a, **k: rows
    try:
        summary.write_sweep_summary(sweep)
    finally:
        summary.collect_rows = original
    text = (sweep / "summary.md").read_text()
    assert "- block vs standard: better by at least the margin, +0.1100 attnres_pointer/acc" in text
    assert "attnres_bpb/bits_per_byte |" in text.split("## Jobs")[1].splitlines()[-2 - len(rows)]  # the header
    with open(sweep / "summary.csv") as f:
        got = list(csv.DictReader(f))
    assert {r["attnres_pointer/acc"] for r in got} == {"0.5", "0.6", "0.4", "0.52", "0.45", "0.56"}
