"""The new verdict columns and words in a sweep's summaries: summary.csv's margin, verdict, power and
cost-interval columns; `attnres-summarize --margin` judging the same runs at another margin (a bad
value refused in one line, nothing written); a tuned sweep's shared-lr rows with their `diff` and its
summary.png with both verdicts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnres.results import summarize, verdict
from attnres.results.summary import write_sweep_summary


def _job(folder: Path, residual: str, seed: int, bpb: float, tps: float, margin: str | None = None) -> None:
    (folder / ".hydra").mkdir(parents=True)
    cfg = {"seed": seed, "num_blocks": 2, "model": {"n_layer": 2},
           "residual": {"_target_": f"attnres.{residual}", **({"num_blocks": 2} if residual == "block" else {})}}
    if margin is not None:
        cfg["verdict"] = {"margin": margin, "margin_points": 1}
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"residual": residual}}}}),
                   folder / ".hydra" / "hydra.yaml")
    (folder / ".hydra" / "overrides.yaml").write_text(f"- residual={residual}\n- seed={seed}\n")
    (folder / "metrics.json").write_text(json.dumps(
        {"status": "finished", "metrics": {"val/bpb": bpb}, "tokens_per_sec_after_warmup": tps,
         "peak_memory_bytes": 2**30 * (1.2 if residual == "block" else 1.0),
         "machine_load": {"cpu_count": 2, "mean_1min": 1.0, "max_1min": 6.5, "samples_1min": [[0.0, 6.5]]}}))


def sweep(root: Path, margin: str | None = None) -> Path:
    """Block 0.3% below standard on 4 seeds, steady: better by at least a 0.1% margin, by less than 0.5%."""
    for seed in range(4):
        base = 2.0 + 0.05 * seed
        _job(root / f"standard-{seed}", "standard", seed, base, 1000.0 + seed, margin)
        _job(root / f"block-{seed}", "block", seed, base * (1 - 0.003) + 0.0001 * (-1) ** seed, 800.0 + 10 * seed,
             margin)
    return root


def test_summary_csv_and_md_carry_the_margin_power_and_cost_intervals(tmp_path):
    rows = write_sweep_summary(sweep(tmp_path / "s"))
    with open(tmp_path / "s" / "summary.csv") as f:
        table = [r for r in csv.DictReader(f) if r["residual"] == "block"]
    assert len(table) == 4
    row = table[0]
    assert row["verdict"] == verdict.BETTER_WITHIN  # the default margin, 0.5% of the baseline
    assert float(row["margin"]) == pytest.approx(0.005 * 2.075, rel=1e-3)
    for key in ("detectable", "seeds_needed", "sd", "tokens_per_sec_ci_low", "tokens_per_sec_ci_high",
                "peak_memory_ci_low", "level"):
        assert row[key], key
    low, ratio, high = (float(row[f"tokens_per_sec_{k}"]) for k in ("ci_low", "ratio", "ci_high"))
    assert low < ratio < high
    assert row["load"].startswith("tokens/s measured under heavy load (1-minute load up to 6.5 on 2 cores)")
    text = (tmp_path / "s" / "summary.md").read_text()
    assert "judged against the margin (0.5% of the baseline" in text
    assert f"- block vs standard: {verdict.BETTER_WITHIN}, " in text
    assert all(r.get("diff") is not None for r in rows if r["residual"] == "block")


def test_the_runs_own_margin_and_the_flag_decide_and_a_bad_flag_writes_nothing(tmp_path, capsys):
    folder = sweep(tmp_path / "s", margin="0.1%")
    assert summarize.main([str(folder)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("verdict: "))
    assert line.startswith(f"verdict: block vs standard: {verdict.BETTER_BY_MARGIN}, ") and "0.1% of the baseline" \
        in line, line
    assert summarize.main([str(folder), "--margin", "1%"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("verdict: "))
    assert line.startswith(f"verdict: block vs standard: {verdict.BETTER_WITHIN}, ") and "1% of the baseline" in line
    before = {p: p.stat().st_mtime_ns for p in folder.glob("summary.*")}
    assert summarize.main([str(folder), "--margin", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(": error: --margin 1 is not a share; write a share of the baseline's "
                                             "mean with a percent sign above 0 and below 100, e.g. --margin 0.5%"), err
    assert {p: p.stat().st_mtime_ns for p in folder.glob("summary.*")} == before


@pytest.mark.slow
def test_a_tuned_sweep_shows_the_shared_lr_verdict_in_its_table_and_figure(tmp_path, monkeypatch):
    from attnres.results import summary_figure
    from attnres.results.tuned_summary import write_tuned_summary
    from tests.sweep.test_tuned import GRID, run_sweeper

    drawn = {}
    original = summary_figure.tuned_verdicts_figure

    def spy(tuned, shared, *args, **kwargs):
        drawn["tuned"], drawn["shared"] = list(tuned), list(shared)
        return original(tuned, shared, *args, **kwargs)

    monkeypatch.setattr(summary_figure, "tuned_verdicts_figure", spy)
    run_sweeper(tmp_path, {"standard": 0.0, "block": 1.0}, "residual=standard,block", "seed=0,1,2", grid=GRID,
                tuning_seeds=[7, 8], untuned=True)
    rows, lines = write_tuned_summary(tmp_path / "sweep")
    configured = [r for r in rows if r["stage"] == "configured" and r["arm"] == "block"]
    assert len(configured) == 3 and all(isinstance(r["diff"], float) for r in configured)
    text = (tmp_path / "sweep" / "summary.md").read_text().split("## Verdict runs")[1]
    for r in configured:  # the shared-lr rows' diff column is filled: the shared-lr verdict can be checked
        cells = next(line for line in text.splitlines() if line.startswith(f"| configured | block | {r['job']} "))
        assert f"| {r['diff']:.4g} |" in cells, cells
    assert [c.label for c in drawn["tuned"]] == ["block"] and [c.label for c in drawn["shared"]] == ["block"]
    assert (tmp_path / "sweep" / "summary.png").stat().st_size > 20_000
    assert any(line.startswith("beside it, every arm at the configured values: block vs standard: ") for line in lines)
