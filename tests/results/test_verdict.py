"""Paired verdicts (DESIGN.md section 6) against hand-computed values, and on a real sweep."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnres.results import verdict
from attnres.results.summary import config_keys
from tests.helpers import run_script

T_975_DF2 = 4.302652729749464  # Student t 97.5% quantile, 2 degrees of freedom (tables)
T_975_DF1 = 12.706204736174705  # ... 1 degree of freedom


def run(seed, value, status="finished", tps=1000.0, mem=None, metric="val/bpb"):
    """A row as summary.collect_rows makes it; `tps` is the run's tokens/s after warm-up (None: a run too
    short to measure it), its tokens/s over every step is ten times lower (what warm-up costs a short run)."""
    return {"seed": seed, "status": status, metric: value, "tokens_per_sec_after_warmup": tps,
            "tokens_per_sec": tps / 10 if tps else 50.0, "peak_memory_gib": mem}


def test_paired_t_interval_matches_the_hand_computed_one():
    base = [run(0, 2.00, tps=1000.0, mem=1.0), run(1, 2.10, tps=1000.0, mem=1.0), run(2, 2.05, tps=1000.0, mem=1.0)]
    cand = [run(0, 1.98, tps=900.0, mem=1.2), run(1, 2.09, tps=950.0, mem=1.2), run(2, 2.02, tps=920.0, mem=1.2)]
    c = verdict.compare(cand, base, "val/bpb", "block N=4", "standard")
    # d = -0.02, -0.01, -0.03: mean -0.02, sample sd 0.01, se 0.01 / sqrt(3)
    half = T_975_DF2 * 0.01 / math.sqrt(3)
    assert c.method == "paired t" and c.n == 3
    assert c.mean == pytest.approx(-0.02, abs=1e-12)
    assert c.ci == pytest.approx((-0.02 - half, -0.02 + half), abs=1e-9)
    assert (c.wins, c.losses) == (3, 0)
    # the interval [-0.045, 0.005] reaches past the margin (0.5% of 2.05) and across 0
    assert c.margin == pytest.approx(0.005 * 2.05) and c.verdict == "not resolved"
    assert c.tokens_per_sec_ratio == pytest.approx((0.9 * 0.95 * 0.92) ** (1 / 3))  # the geometric mean
    assert c.peak_memory_ratio == pytest.approx(1.2)
    line = c.sentence()
    assert line.startswith("block N=4 vs standard: not resolved, -0.0200 val/bpb [-0.0448, +0.0048]"), line
    assert "3/3 seeds favour block N=4" in line and "lower is better" in line and "0.92x tokens/s" in line


def test_the_tokens_per_sec_ratio_is_after_warm_up_and_absent_for_runs_too_short_to_measure():
    base = [run(s, 2.0 + 0.1 * s, tps=1000.0, mem=1.0) for s in range(3)]
    cand = [run(s, 1.9 + 0.1 * s, tps=800.0, mem=1.2) for s in range(3)]
    for r in cand:
        r["tokens_per_sec"] = 1000.0  # over every step the candidate looks faster: its warm-up was shorter
    c = verdict.compare(cand, base, "val/bpb", "block", "standard")
    assert c.tokens_per_sec_ratio == pytest.approx(0.8) and "0.80x tokens/s" in c.sentence()
    assert c.tokens_per_sec_note is None
    short = [run(s, 2.0 + 0.1 * s, tps=None, mem=1.0) for s in range(3)]  # every run shorter than its warm-up
    short_cand = [run(s, 1.9 + 0.1 * s, tps=None, mem=1.2) for s in range(3)]
    c = verdict.compare(short_cand, short, "val/bpb", "block", "standard")
    line = c.sentence()
    assert c.tokens_per_sec_ratio is None and "x tokens/s" not in line, line
    assert line.endswith("; 1.20x peak memory [1.20, 1.20], " + verdict.NO_TOKENS_PER_SEC), line
    assert c.columns()["tokens_per_sec_ratio"] is None
    mixed = verdict.compare([*cand[:2], short_cand[2]], base, "val/bpb", "block", "standard")
    assert mixed.tokens_per_sec_ratio == pytest.approx(0.8) and "leaves out 1 run(s) too short" in mixed.sentence()
    welch = verdict.compare([run(s, 1.0 + 0.1 * s, tps=None) for s in (5, 6)], short[:2], "val/bpb", "b", "standard")
    assert welch.method == "Welch (unpaired)" and verdict.NO_TOKENS_PER_SEC in welch.sentence()


def test_a_clear_difference_is_better_or_worse_by_the_metric_direction():
    base = [run(s, 2.0 + 0.1 * s) for s in range(3)]
    cand = [run(s, 2.0 + 0.1 * s - 0.05 - 0.001 * s) for s in range(3)]
    assert verdict.compare(cand, base, "val/bpb", "a", "standard").verdict == "better by at least the margin"
    acc = [run(s, r["val/bpb"], metric="val/accuracy") for s, r in enumerate(base)]
    acc_cand = [run(s, r["val/bpb"], metric="val/accuracy") for s, r in enumerate(cand)]
    c = verdict.compare(acc_cand, acc, "val/accuracy", "a", "standard")
    assert c.verdict == "worse by at least the margin" and (c.wins, c.losses) == (0, 3)
    assert "higher is better" in c.sentence()


def test_one_seed_gives_no_interval():
    c = verdict.compare([run(0, 1.9)], [run(0, 2.0)], "val/bpb", "full", "standard")
    assert c.method == "one pair" and c.ci is None and c.mean == pytest.approx(-0.1)
    assert c.verdict == "not resolved: 1 seed gives no interval"
    assert c.sentence().startswith("full vs standard: not resolved: 1 seed gives no interval, -0.1000 val/bpb on "
                                   "seed 0 (lower is better; margin 0.0100 = 0.5% of the baseline)"), c.sentence()


def test_no_baseline_is_said():
    c = verdict.compare([run(0, 1.9), run(1, 2.0)], [], "val/bpb", "full", None)
    assert c.method == "no baseline" and "no baseline in this sweep" in c.sentence()


def test_failed_jobs_are_left_out_and_counted():
    base = [run(0, 2.0), run(1, 2.1), run(2, 2.2)]
    cand = [run(0, 1.9), run(1, 2.0), run(2, None, status="failed")]
    c = verdict.compare(cand, base, "val/bpb", "block", "standard")
    assert c.method == "paired t" and c.n == 2 and c.mean == pytest.approx(-0.1)
    half = T_975_DF1 * 0.0 / math.sqrt(2)  # identical differences: the interval is the point
    assert c.ci == pytest.approx((-0.1 - half, -0.1 + half))
    assert "1 failed job left out" in c.sentence() and "seed 2 on one side only" in c.sentence()


def test_unequal_seed_sets_pair_on_the_common_seeds():
    base = [run(0, 2.00), run(1, 2.10)]
    cand = [run(0, 1.95), run(1, 2.07), run(5, 1.0)]
    c = verdict.compare(cand, base, "val/bpb", "block", "standard")
    diffs = [-0.05, -0.03]
    sd = math.sqrt(sum((d - (-0.04)) ** 2 for d in diffs))  # n - 1 = 1
    half = T_975_DF1 * sd / math.sqrt(2)
    assert c.n == 2 and c.diffs == pytest.approx({0: -0.05, 1: -0.03})
    assert c.ci == pytest.approx((-0.04 - half, -0.04 + half), abs=1e-9)
    assert "seed 5 on one side only, left out" in c.sentence()


def test_no_common_seeds_fall_back_to_welch_unpaired():
    # equal variances and sizes: Welch's degrees of freedom are 2 (n1 + n2 - 2), its se sqrt(s1^2/2 + s2^2/2)
    cand, base = [run(0, 1.0), run(1, 1.2)], [run(2, 1.3), run(3, 1.5)]
    c = verdict.compare(cand, base, "val/bpb", "block", "standard")
    half = T_975_DF2 * math.sqrt(0.02 / 2 + 0.02 / 2)
    assert c.method == "Welch (unpaired)" and c.mean == pytest.approx(-0.3)
    assert c.ci == pytest.approx((-0.3 - half, -0.3 + half), abs=1e-9)
    assert "Welch, unpaired" in c.sentence() and "no common seeds" in c.sentence()


def test_one_run_each_on_different_seeds_compares_nothing():
    c = verdict.compare([run(0, 1.0)], [run(1, 1.1)], "val/bpb", "block", "standard")
    assert c.mean is None and "no seed in common" in c.sentence()


def _cfg(**over):
    base = {"seed": 0, "num_blocks": 4, "residual": {"_target_": "attnres.StandardResidual"},
            "model": {"n_layer": 4}, "optim": {"query_lr_scale": 0.1, "lr": 3e-3}, "trainer": {"max_steps": 10},
            "callbacks": {"x": 1}}
    for key, value in over.items():
        node = base
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return OmegaConf.create(base)


def test_baselines_match_on_everything_but_the_strategy_and_ignored_keys():
    standard = config_keys(_cfg())
    block = config_keys(_cfg(**{"residual._target_": "attnres.BlockAttentionResidual", "num_blocks": 2, "seed": 3,
                                "callbacks.x": 2}))
    assert block == standard  # strategy keys, seed and callbacks do not count
    other_lr = config_keys(_cfg(**{"optim.query_lr_scale": 0.3}))
    assert other_lr[0] != standard[0] and other_lr[1] == standard[1]  # matches, not exactly
    assert config_keys(_cfg(**{"model.n_layer": 8}))[1] != standard[1]
    assert config_keys(_cfg(**{"trainer.max_steps": 20}))[1] != standard[1]


def test_comparisons_pick_the_exact_baseline_first():
    def rows(config, baseline, exact, match, values):
        return [{**run(s, v), "config": config, "is_baseline": baseline, "exact": exact, "match": match}
                for s, v in enumerate(values)]

    table = (rows("standard q=0.03", True, "e1", "m", [2.0, 2.1]) + rows("standard q=0.3", True, "e2", "m", [3.0, 3.1])
             + rows("block q=0.3", False, "e2", "m", [2.9, 3.0]) + rows("block q=1", False, "e3", "m", [1.9, 2.0])
             + rows("block wide", False, "e4", "other", [1.0, 1.0]))
    found = {c.label: c for c in verdict.comparisons(table, "val/bpb")}
    assert found["block q=0.3"].baseline == "standard q=0.3" and found["block q=0.3"].mean == pytest.approx(-0.1)
    assert found["block q=1"].baseline == "standard q=0.03"  # no exact one: the first that matches
    assert found["block wide"].method == "no baseline"


@pytest.mark.slow
def test_a_real_sweep_ends_with_verdicts_a_csv_and_a_plot(shared_sweep):
    """The shared sweep (tests/helpers.py): standard and Block N=2, seeds 0 and 1, stdlib bytes."""
    result, sweep = shared_sweep, shared_sweep.dir
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith("verdict: block vs standard: "), result.stdout
    # 6 steps each: too short to measure tokens/s after warm-up, so no ratio, and the line says why
    assert "paired t, 2 seeds" in verdicts[0] and "x peak memory" in verdicts[0]
    # two seeds: never a winner, whatever the interval
    assert verdicts[0].startswith("verdict: block vs standard: not resolved: 2 seeds barely estimate the spread")
    for job in (d for d in sweep.iterdir() if (d / "metrics.json").is_file()):  # each run's load while it trained
        load = json.loads((job / "metrics.json").read_text())["machine_load"]
        assert load["cpu_count"] == os.cpu_count() and len(load["samples_1min"]) >= 2, load
        assert load["max_1min"] == max(v for _, v in load["samples_1min"])
    assert verdicts[0].endswith(verdict.NO_TOKENS_PER_SEC) and "x tokens/s" not in verdicts[0]
    summary = (sweep / "summary.md").read_text()
    assert "## Verdicts" in summary and verdicts[0].removeprefix("verdict: ") in summary
    with open(sweep / "summary.csv") as f:
        table = list(csv.DictReader(f))
    blocks = [r for r in table if r["residual"] == "block"]
    assert len(table) == 4 and len(blocks) == 2
    for r in blocks:  # each run's own difference, and its configuration's interval
        base = next(b for b in table if b["residual"] == "standard" and b["seed"] == r["seed"])
        assert float(r["diff"]) == pytest.approx(float(r["val/bpb"]) - float(base["val/bpb"]), abs=1e-3)
        assert r["method"] == "paired t" and float(r["ci_low"]) <= float(r["mean_diff"]) <= float(r["ci_high"])
    png = sweep / "summary.png"
    assert png.stat().st_size > 20_000  # two panels with curves, not an empty canvas
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[1] > pixels.shape[0] and pixels[..., :3].std() > 0.05


def _job(folder: Path, residual: str, seed: int, bpb: float, extra: tuple[str, ...] = (), num_blocks: int = 4):
    (folder / ".hydra").mkdir(parents=True)
    uses_n = residual == "block"
    cfg = {"seed": seed, "num_blocks": num_blocks, "model": {"n_layer": 2},
           "residual": {"_target_": f"attnres.{residual}", **({"num_blocks": num_blocks} if uses_n else {})}}
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"residual": residual}}}}),
                   folder / ".hydra" / "hydra.yaml")
    overrides = [f"residual={residual}", f"seed={seed}", f"num_blocks={num_blocks}", *extra]
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (folder / "metrics.json").write_text(
        f'{{"status": "finished", "metrics": {{"val/bpb": {bpb}}}, "tokens_per_sec": 100.0}}')


def test_summarize_pairs_runs_of_several_sweeps(tmp_path):
    for seed, bpb in enumerate((2.0, 2.1, 2.2)):
        _job(tmp_path / "base" / f"s{seed}", "standard", seed, bpb, num_blocks=2)
        _job(tmp_path / "variants" / f"b{seed}", "block", seed, bpb - 0.05 - 0.01 * seed)
    script = ["experiments/summarize.py", "base", "variants"]
    refused = run_script(*script, cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and "--out" in refused.stderr
    result = run_script(*script, "--out", "both", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("verdict: "))
    # the standard runs do not read num_blocks, so N is no part of their label
    assert line.startswith("verdict: block N=4 vs standard: better by at least the margin, -0.0600 val/bpb"), line
    assert "3/3 seeds favour block N=4" in line and (tmp_path / "both" / "summary.png").stat().st_size > 10_000
