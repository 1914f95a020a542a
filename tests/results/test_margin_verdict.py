"""The verdicts' decision rule (docs/sweeps.md#verdicts, issue 49): the categories at each boundary in
both directions, equivalence against statsmodels' TOST, power and seeds-needed against statsmodels'
own power function, Holm across arms against multipletests, and two pairs never naming a winner."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import ttost_paired

from attnres.results import verdict
from attnres.results.verdict import (
    BETTER_BY_MARGIN,
    BETTER_UNSURE,
    BETTER_WITHIN,
    EQUIVALENT,
    NOT_RESOLVED,
    RESOLVED,
    WORSE_BY_MARGIN,
    WORSE_UNSURE,
    WORSE_WITHIN,
    margin_verdict,
)

M = 1.0
#: (low, high) for lower-is-better with margin 1, and the words; each boundary on both sides of it
CASES = [
    ((-3.0, -1.5), BETTER_BY_MARGIN), ((-3.0, -1.0), BETTER_UNSURE),  # high < -m strictly
    ((-1.0, -0.5), BETTER_WITHIN), ((-1.0001, -0.5), BETTER_UNSURE),  # low >= -m
    ((-0.9, -0.0001), BETTER_WITHIN), ((-0.9, 0.0), EQUIVALENT),  # high < 0 strictly, else 0 is inside
    ((-0.9, 0.9), EQUIVALENT), ((-1.0, 0.5), NOT_RESOLVED), ((-0.5, 1.0), NOT_RESOLVED),  # (-m, +m) open
    ((-2.0, 2.0), NOT_RESOLVED), ((-1.5, 0.5), NOT_RESOLVED),
    ((0.5, 1.0), WORSE_WITHIN), ((0.5, 1.0001), WORSE_UNSURE), ((0.0, 0.9), EQUIVALENT), ((0.0001, 0.9), WORSE_WITHIN),
    ((1.0, 3.0), WORSE_UNSURE), ((1.0001, 3.0), WORSE_BY_MARGIN),
]


@pytest.mark.parametrize(("interval", "words"), CASES, ids=[f"{lo:+g},{hi:+g}" for (lo, hi), _ in CASES])
def test_each_category_at_its_boundaries_both_directions(interval, words):
    low, high = interval
    assert margin_verdict(low, high, M, lower_is_better=True) == words
    # higher is better: the same interval mirrored is the same verdict
    assert margin_verdict(-high, -low, M, lower_is_better=False) == words


def test_resolved_is_what_answers_the_question():
    assert RESOLVED == {BETTER_BY_MARGIN, BETTER_WITHIN, WORSE_BY_MARGIN, WORSE_WITHIN, EQUIVALENT}
    with pytest.raises(ValueError):
        margin_verdict(-1.0, 1.0, 0.0, True)


def rows(values, seeds=None, metric="val/bpb", tps=None, mem=None, load=None):
    seeds = list(range(len(values))) if seeds is None else seeds
    return [{"seed": s, "status": "finished", metric: float(v), "tokens_per_sec_after_warmup": tps and tps[i],
             "peak_memory_gib": mem and mem[i], "machine_load": load and load[i]} for i, (s, v) in
            enumerate(zip(seeds, values, strict=True))]


def test_the_equivalence_verdict_is_statsmodels_tost_at_half_alpha():
    """The interval at 95% inside (-m, +m) is TOST at 2.5% a side: over many random sweeps the words
    say "equivalent" exactly when ttost_paired's p is below 0.025, and both happen."""
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(300):
        n = int(rng.integers(3, 9))
        base = 2.0 + rng.normal(0, 0.05, n)
        cand = base + rng.normal(rng.uniform(-0.012, 0.012), rng.uniform(0.001, 0.01), n)
        c = verdict.compare(rows(cand), rows(base), "val/bpb", "block", "standard")
        p = ttost_paired(cand, base, -c.margin, c.margin)[0]
        assert c.tost_p == pytest.approx(p, rel=1e-9)
        equivalent = c.verdict == EQUIVALENT
        inside_zero = c.ci[0] <= 0 <= c.ci[1]
        assert equivalent == (p < 0.025 and inside_zero), (c.ci, c.margin, p)
        if inside_zero:
            seen[equivalent] += 1
    assert seen[True] > 10 and seen[False] > 10, seen


def test_power_and_seeds_needed_match_statsmodels_power_function():
    rng = np.random.default_rng(1)
    base = 2.0 + rng.normal(0, 0.05, 6)
    cand = base + rng.normal(-0.004, 0.03, 6)
    c = verdict.compare(rows(cand), rows(base), "val/bpb", "block", "standard")
    sd = float(np.std(cand - base, ddof=1))
    assert c.sd == pytest.approx(sd, rel=1e-12)
    solver = TTestPower()
    # the smallest detectable difference is the one statsmodels gives 80% power to, at these 6 seeds
    assert solver.power(c.detectable / sd, 6, 0.05, alternative="two-sided") == pytest.approx(0.8, abs=1e-4)
    # the seeds needed: the first count with 80% power at a margin-sized difference
    need = c.seeds_needed
    assert need > 6
    assert solver.power(c.margin / sd, need, 0.05, alternative="two-sided") >= 0.8
    assert solver.power(c.margin / sd, need - 1, 0.05, alternative="two-sided") < 0.8
    line = c.sentence()
    assert f"80% power at {c.detectable:.4f} with 6 seeds, the margin needs {need}" in line, line


def test_two_pairs_never_name_a_winner():
    """The issue's case: a 0.01% effect from two seeds whose interval excludes 0 printed "better"."""
    base = rows([6.1890, 6.1990])
    cand = rows([6.1884, 6.1983])  # -0.0006, -0.0007: the interval excludes 0, t at 1 degree of freedom
    c = verdict.compare(cand, base, "val/bpb", "block", "standard")
    assert c.ci[1] < 0
    assert c.verdict == "not resolved: 2 seeds barely estimate the spread (1 degree of freedom)"
    assert c.verdict not in RESOLVED and "better" not in c.sentence().split(" [")[0]
    welch = verdict.compare(rows([1.0, 1.1], seeds=[5, 6]), rows([2.0, 2.1]), "val/bpb", "block", "standard")
    assert welch.method == "Welch (unpaired)" and welch.verdict.startswith("not resolved: 2 runs a side barely")


def test_an_effect_inside_the_margin_is_never_plain_better():
    base = 2.0 + np.arange(5) * 0.1
    cand = base - 0.0004 + np.array([0.0, 0.0001, -0.0001, 0.00005, 0.0])  # -0.02% of the loss, very steady
    c = verdict.compare(rows(cand), rows(base), "val/bpb", "block", "standard")
    assert c.ci[1] < 0 and c.verdict == BETTER_WITHIN
    assert c.sentence().startswith("block vs standard: better, by less than the margin, -0.0004 val/bpb")


def test_the_margin_is_a_share_of_the_baseline_for_losses_and_points_for_accuracies():
    c = verdict.compare(rows([1.9, 2.0, 2.1]), rows([2.0, 2.1, 2.2]), "val/bpb", "b", "standard",
                        margin=verdict.Margin(share=0.01, points=2))
    assert c.margin == pytest.approx(0.01 * 2.1) and "margin 0.0210 = 1% of the baseline" in c.sentence()
    acc = verdict.compare(rows([0.5, 0.6, 0.7], metric="val/accuracy"), rows([0.4, 0.5, 0.6], metric="val/accuracy"),
                          "val/accuracy", "b", "standard", margin=verdict.Margin(share=0.01, points=2))
    assert acc.margin == pytest.approx(0.02) and "margin 0.0200 = 2 points" in acc.sentence()
    bleu = verdict.Margin(points=2).in_units("wmt16/bleu", 30.0)
    assert bleu == 2.0  # lm-eval's BLEU is on 0-100


def test_holm_over_arms_sharing_a_baseline_matches_multipletests():
    rng = np.random.default_rng(2)
    base = 2.0 + rng.normal(0, 0.05, 5)
    arms = {"block": -0.02, "full": -0.01, "hc": 0.003}
    table = [{**r, "config": "standard", "is_baseline": True, "exact": "e", "match": "m"} for r in rows(base)]
    cands = {}
    for name, shift in arms.items():
        cands[name] = base + shift + rng.normal(0, 0.006, 5)
        table += [{**r, "config": name, "is_baseline": False, "exact": "e", "match": "m"} for r in rows(cands[name])]
    found = {c.label: c for c in verdict.comparisons(table, "val/bpb")}
    raw = [stats.ttest_1samp(cands[name] - base, 0.0).pvalue for name in arms]
    holm = multipletests(raw, alpha=0.05, method="holm")[1]
    level = 1 - 0.05 / 3
    for (name, _), p_raw, p_holm in zip(arms.items(), raw, holm, strict=True):
        c = found[name]
        assert c.arms == 3 and c.p_value == pytest.approx(p_raw) and c.p_holm == pytest.approx(p_holm)
        low, high = stats.ttest_1samp(cands[name] - base, 0.0).confidence_interval(level)
        assert c.ci == pytest.approx((low, high), rel=1e-12)  # the interval the words come from
        assert c.verdict == margin_verdict(low, high, c.margin, True)
        assert f"98.33% interval: Holm over 3 arms, adjusted p {p_holm:.3g}" in c.sentence()
        assert c.columns()["level"] == pytest.approx(level)
    alone = verdict.compare(rows(cands["block"]), rows(base), "val/bpb", "block", "standard")
    assert alone.arms == 1 and alone.p_holm is None and "Holm" not in alone.sentence()
    assert alone.ci[1] - alone.ci[0] < found["block"].ci[1] - found["block"].ci[0]
