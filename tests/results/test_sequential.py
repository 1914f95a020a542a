"""Seeds on demand's design (attnres.results.sequential): the critical values against the tabulated
ones, and the false-positive rate under optional stopping by simulation, against the naive rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from attnres.results import sequential
from attnres.results.verdict import Comparison

# Lan-DeMets O'Brien-Fleming-type spending, two-sided alpha 0.05 (0.025 a side), 5 equally spaced looks:
# the boundaries tabulated by Reboussin, DeMets, Kim & Lan (2000, Controlled Clinical Trials 21:190; the
# ldbounds program) and reproduced by R's gsDesign (sfLDOF)
TABULATED_OBF_5_LOOKS = (4.877, 3.357, 2.680, 2.290, 2.031)
STUDIES = 4000


def test_critical_values_match_the_tabulated_obrien_fleming_type_boundaries():
    found = sequential.critical_values([2, 4, 6, 8, 10], 10, 0.05)
    assert found == pytest.approx(TABULATED_OBF_5_LOOKS, abs=2e-3)
    assert sequential.spent(1.0, 0.05) == pytest.approx(0.05, abs=1e-15)


def _false_positives(sizes, multipliers, seed):
    """Of STUDIES simulated studies with no effect (Gaussian paired differences), those where some
    look's interval mean +- multiplier * se excludes 0."""
    rng = np.random.default_rng(seed)
    d = rng.normal(0.3, 0.7, size=(STUDIES, sizes[-1])) - 0.3  # a scale and a shift that cancel: no effect
    rejected = np.zeros(STUDIES, dtype=bool)
    for n, q in zip(sizes, multipliers, strict=True):
        x = d[:, :n]
        se = x.std(axis=1, ddof=1) / math.sqrt(n)
        rejected |= np.abs(x.mean(axis=1)) > q * se
    return int(rejected.sum())


@pytest.mark.parametrize("sizes", [[3, 5, 7, 9, 10], [3, 4, 7, 9, 10]], ids=["planned", "a-failed-job"])
def test_the_sequential_rule_keeps_its_error_rate_where_the_naive_rule_exceeds_it(sizes):
    """Looks at 3, 5, 7, 9 and 10 seeds (start 3, batch 2, maximum 10), or a second look one pair short
    (a failed job: spent at its actual fraction). The naive rule: a fixed-n 95% t interval after
    every batch. 99% Clopper-Pearson intervals on the rates allow the Monte-Carlo error."""
    sequential_q = sequential.t_multipliers(sizes, 10, 0.05, final=True)
    naive_q = [stats.t.isf(0.025, n - 1) for n in sizes]
    seq, naive = _false_positives(sizes, sequential_q, seed=1), _false_positives(sizes, naive_q, seed=1)
    seq_ci = stats.binomtest(seq, STUDIES).proportion_ci(0.99)
    naive_ci = stats.binomtest(naive, STUDIES).proportion_ci(0.99)
    print(f"{sizes}: sequential {seq / STUDIES:.4f} [{seq_ci.low:.4f}, {seq_ci.high:.4f}], "
          f"naive {naive / STUDIES:.4f} [{naive_ci.low:.4f}, {naive_ci.high:.4f}] over {STUDIES} studies")
    assert seq_ci.low <= 0.05  # at or below the nominal level, up to Monte-Carlo error
    assert seq_ci.high >= 0.05 * 0.7  # and not bought by a far more conservative rule
    assert naive_ci.low > 0.05  # the naive rule's excess is beyond Monte-Carlo error


def test_the_last_look_is_wider_than_a_fixed_n_interval_and_earlier_looks_wider_still():
    q = sequential.t_multipliers([3, 5, 7, 9, 10], 10, 0.05, final=True)
    assert all(a > b for a, b in zip(q, q[1:], strict=False))
    assert stats.t.isf(0.025, 9) < q[-1] < stats.t.isf(0.025 / 5, 9)  # between fixed-n and Bonferroni over 5 looks


def test_look_sizes_skip_looks_without_a_new_pair_or_a_spread():
    looks = [[0, 1, 2], [3, 4], [5, 6]]
    assert sequential.look_sizes({0: 1.0, 1: 2.0, 2: 3.0, 3: 0.5, 5: 0.1}, looks) == [3, 4, 5]
    assert sequential.look_sizes({0: 1.0, 3: 2.0, 4: 1.0}, looks) == [3]  # one pair at the first look: no interval
    assert sequential.look_sizes({0: 1.0}, looks) == []


def test_apply_replaces_the_interval_with_the_repeated_one_and_says_so():
    diffs = {0: -0.03, 1: -0.02, 2: -0.025, 3: -0.028, 4: -0.022}
    record = {"design": {"first": 0, "start": 3, "batch": 2, "max": 10, "alpha": 0.05},
              "looks": [[0, 1, 2], [3, 4]], "final": False}
    c = Comparison(label="block", baseline="standard", metric="val/loss", method="paired t", n=5,
                   mean=float(np.mean(list(diffs.values()))), ci=(-1.0, 1.0), p_value=0.01, tost_p=0.02, diffs=diffs)
    sequential.apply([c], record)
    values = list(diffs.values())
    half = sequential.t_multipliers([3, 5], 10, 0.05)[-1] * np.std(values, ddof=1) / math.sqrt(5)
    assert c.ci == pytest.approx((np.mean(values) - half, np.mean(values) + half), rel=1e-12)
    assert "repeated 95% interval of the sequential design at look 2" in c.sentence()
    assert c.p_value is None and c.tost_p is None  # a fixed-n test's p is not valid after looks
    untouched = Comparison(label="full", baseline="standard", metric="val/loss", method="one pair", n=1,
                           mean=0.1, diffs={0: 0.1})
    sequential.apply([untouched], record)
    assert untouched.ci is None and not untouched.notes


def test_a_look_that_spends_nothing_gives_an_unbounded_interval_even_when_the_pairs_agree():
    """2 of 17 seeds: O'Brien-Fleming spends (to float precision) none of alpha there, so the t multiplier is
    infinite; identical pairs (sd 0) must not turn inf x 0 into a NaN interval."""
    assert math.isinf(sequential.t_multipliers([2], 17, 0.05, False)[-1])
    assert sequential.repeated_interval({0: 0.25, 1: 0.25}, [[0, 1]], 17, 0.05, False) == (-math.inf, math.inf)
    assert sequential.repeated_interval({0: 0.2, 1: 0.3}, [[0, 1]], 17, 0.05, False) == (-math.inf, math.inf)
    low, high = sequential.repeated_interval({s: 0.25 + 0.01 * s for s in range(17)}, [list(range(17))], 17,
                                             0.05, True)
    assert math.isfinite(low) and low < 0.33 < high  # a look that spends gives a finite one
