"""Compute equivalence (attnres/results/scaling.py, experiments/scaling.py): the FLOPs formula,
the power-law fit on synthetic points with known parameters, the multiplier and its bootstrap,
and the script on a real sweep over three sizes."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from attnres.results.scaling import (
    Cell,
    PowerLaw,
    bootstrap_multipliers,
    fit_power_law,
    multipliers,
    training_flops,
)
from tests.helpers import run_cli, run_script, tiny

TRUE = dict(a=3.0, b=0.3, c=1.5)  # L = 3 (C / 1e14)^-0.3 + 1.5


def truth(compute):
    return TRUE["a"] * (np.asarray(compute) / 1e14) ** (-TRUE["b"]) + TRUE["c"]


def test_training_flops_is_six_n_d_plus_attention():
    assert training_flops(1e6, 2e6, n_layer=4, seq_len=128, width=64) == 6 * 1e6 * 2e6 + 6 * 4 * 128 * 64 * 2e6


@pytest.mark.parametrize("noise", [0.0, 1e-3], ids=["exact", "noisy"])
def test_the_fit_recovers_known_parameters(noise):
    compute = np.geomspace(1e12, 1e16, 7)
    loss = truth(compute) * (1 + noise * np.random.default_rng(0).standard_normal(len(compute)))
    fit = fit_power_law(compute, loss)
    tol = 1e-6 if noise == 0 else 0.05
    assert fit.b == pytest.approx(TRUE["b"], rel=tol)
    assert fit.c == pytest.approx(TRUE["c"], rel=tol)
    assert fit.a * (fit.c0 / 1e14) ** (-fit.b) == pytest.approx(TRUE["a"], rel=tol * 2)  # a in units of 1e14
    assert np.allclose(fit(compute), truth(compute), rtol=max(3 * noise, 1e-9))


def test_the_fit_needs_three_sizes():
    with pytest.raises(ValueError, match="at least 3 distinct"):
        fit_power_law([1e12, 1e12, 1e13], [3.0, 3.1, 2.5])


def test_inverse_and_its_floor():
    fit = PowerLaw(a=3.0, b=0.3, c=1.5, c0=1e14)
    assert fit.inverse(float(truth(5e13))) == pytest.approx(5e13, rel=1e-12)
    assert fit.inverse(1.5) is None and fit.inverse(1.2) is None  # at or below the irreducible loss


def _cells(strategy, computes, losses_per_seed):
    return [Cell(strategy, f"s{i}", int(c / 1e6), {s: c for s in range(len(ls))}, dict(enumerate(ls)))
            for i, (c, ls) in enumerate(zip(computes, losses_per_seed, strict=True))]


def test_a_strategy_as_good_as_a_quarter_more_compute_gets_1_25x():
    computes = np.geomspace(1e12, 1e15, 4)
    baseline = _cells("standard", computes, [[float(truth(c))] for c in computes])
    better = _cells("block", computes, [[float(truth(1.25 * c))] for c in computes])
    fit, found = multipliers(baseline, better)
    assert fit.b == pytest.approx(TRUE["b"], rel=1e-6)
    assert all(m == pytest.approx(1.25, rel=1e-6) for m in found.values()), found


def test_the_bootstrap_interval_covers_the_true_multiplier():
    rng = np.random.default_rng(1)
    computes = np.geomspace(1e12, 1e15, 4)

    def seeds(c, factor):
        return [float(truth(factor * c)) + 0.002 * rng.standard_normal() for _ in range(3)]

    baseline = _cells("standard", computes, [seeds(c, 1.0) for c in computes])
    better = _cells("block", computes, [seeds(c, 1.25) for c in computes])
    intervals = bootstrap_multipliers(baseline, better, samples=300)
    low, high = intervals["block"]
    assert low < 1.25 < high and high - low < 0.5, (low, high)
    assert all(intervals[("block", f"s{i}")] is not None for i in range(4))


@pytest.mark.slow
def test_the_script_on_a_real_sweep_over_three_sizes(tmp_path):
    small = tiny("data.max_files=40", "data.block_size=32", f"data.cache_dir={tmp_path / 'cache'}", "callbacks=none",
                 "hydra.launcher.cpu_jobs=2", "num_blocks=2", data="stdlib", val_batches=2, steps=8, val_every=8,
                 width=False)
    sweep = run_cli("-m", *small, "model.n_embd=16,32,64", "residual=standard,block", "hydra.sweep.dir=sweep",
                    cwd=tmp_path, timeout=600)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    script = ["experiments/scaling.py", "sweep", "--samples", "200"]
    result = run_script(*script, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("block vs standard: "), result.stdout
    with open(tmp_path / "sweep" / "scaling.csv") as f:
        table = list(csv.DictReader(f))
    assert sorted((r["strategy"], r["size"]) for r in table) == sorted(
        (s, f"2x{d}") for s in ("block", "standard") for d in (16, 32, 64))
    computes = {r["size"]: float(r["compute"]) for r in table if r["strategy"] == "standard"}
    assert computes["2x16"] < computes["2x32"] < computes["2x64"]
    assert (tmp_path / "sweep" / "scaling.png").stat().st_size > 20_000
    assert "| strategy | a | b | c (irreducible) | C0 |" in (tmp_path / "sweep" / "scaling.md").read_text()
    # two sizes are not enough: one line, exit 2
    for d in (tmp_path / "sweep").iterdir():
        if "n_embd=64" in d.name:
            (d / "metrics.json").unlink()
    short = run_script(*script, cwd=tmp_path, timeout=300)
    assert short.returncode == 2 and len(short.stderr.strip().splitlines()) == 1, short.stderr
    assert "needs at least 3" in short.stderr
