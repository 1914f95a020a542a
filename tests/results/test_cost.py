"""The cost beside a verdict (attnres/results/cost.py): tokens/s and peak-memory ratios paired by seed
with a t interval on the log ratios, against a float64 computation, and the load that makes a speed
ratio unreliable said in the line."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from attnres.results import cost, verdict


def run(seed, bpb, tps, mem, load=None):
    return {"seed": seed, "status": "finished", "val/bpb": bpb, "tokens_per_sec_after_warmup": tps,
            "peak_memory_gib": mem, "machine_load": load}


def quiet(cores=16, mean=2.0):
    return {"cpu_count": cores, "mean_1min": mean, "max_1min": mean + 0.5, "samples_1min": [[0.0, mean]]}


def test_the_ratio_interval_is_a_t_interval_on_log_ratios_against_float64():
    cand_tps, base_tps = [930.0, 870.0, 905.0, 990.0], [1000.0, 1010.0, 960.0, 1040.0]
    cand_mem, base_mem = [1.21, 1.19, 1.22, 1.20], [1.0, 1.0, 1.01, 0.99]
    base = [run(s, 2.0, t, m) for s, (t, m) in enumerate(zip(base_tps, base_mem, strict=True))]
    cand = [run(s, 1.99, t, m) for s, (t, m) in enumerate(zip(cand_tps, cand_mem, strict=True))]
    c = verdict.compare(cand, base, "val/bpb", "block", "standard")
    for got, interval, a, b in ((c.tokens_per_sec_ratio, c.tokens_per_sec_ci, cand_tps, base_tps),
                                (c.peak_memory_ratio, c.peak_memory_ci, cand_mem, base_mem)):
        logs = np.log(np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64))
        half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
        assert got == pytest.approx(math.exp(logs.mean()), rel=1e-12)  # the geometric mean, not the mean
        assert interval == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)), rel=1e-12)
    line = c.sentence()
    low, high = c.tokens_per_sec_ci
    assert f"{c.tokens_per_sec_ratio:.2f}x tokens/s [{low:.2f}, {high:.2f}]" in line, line
    assert "x peak memory [" in line and "load" not in line
    one = verdict.compare(cand[:1], base[:1], "val/bpb", "block", "standard")
    assert one.tokens_per_sec_ratio == pytest.approx(0.93) and one.tokens_per_sec_ci is None
    assert cost.ratio_interval([]) is None and cost.ratio_interval([(1.0, 0.0), (None, 1.0)]) is None


def test_a_speed_ratio_under_heavy_or_uneven_load_says_so():
    base = [run(s, 2.0, 1000.0, 1.0, quiet()) for s in range(3)]
    cand = [run(s, 1.99, 600.0, 1.1, quiet()) for s in range(3)]
    assert verdict.compare(cand, base, "val/bpb", "block", "standard").load_note is None
    heavy = [run(s, 1.99, 600.0, 1.1, {**quiet(cores=2), "max_1min": 7.3}) for s in range(3)]
    c = verdict.compare(heavy, base, "val/bpb", "block", "standard")
    assert c.load_note == ("tokens/s measured under heavy load (1-minute load up to 7.3 on 2 cores): "
                           "not a reliable speed comparison")
    assert "0.60x tokens/s [0.60, 0.60], tokens/s measured under heavy load" in c.sentence()
    uneven = [run(0, 1.99, 600.0, 1.1, quiet(mean=7.0))] + cand[1:]  # 7.0 against 2.0 on 16 cores: more than 4
    c = verdict.compare(uneven, base, "val/bpb", "block", "standard")
    assert c.load_note == "tokens/s measured under uneven load between the paired runs in 1 of 3 seeds: " \
                          "not a reliable speed comparison"
    even = [run(0, 1.99, 600.0, 1.1, quiet(mean=5.9))] + cand[1:]  # 3.9 apart: within a quarter of 16 cores
    assert verdict.compare(even, base, "val/bpb", "block", "standard").load_note is None
    unrecorded = [run(s, 1.99, 600.0, 1.1) for s in range(3)]  # runs older than the record: not judged
    assert verdict.compare(unrecorded, base, "val/bpb", "block", "standard").load_note is None
