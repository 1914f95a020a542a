"""Learning-rate schedules (attnres/training/schedules.py), as multipliers of the base rate at
chosen steps, and their errors."""

from __future__ import annotations

import math

import pytest

from attnres.training.schedules import constant, warmup_cosine, warmup_stable_decay


def test_warmup_cosine():
    lr = [warmup_cosine(s, total_steps=110, warmup_steps=10, min_lr_ratio=0.1) for s in range(111)]
    assert lr[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # linear warmup to 1
    assert lr[10] == pytest.approx(1.0) and lr[60] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway down the cosine
    assert lr[110] == pytest.approx(0.1) and warmup_cosine(500, total_steps=110, warmup_steps=10) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[10:], lr[11:], strict=False))
    quarter = warmup_cosine(35, total_steps=110, warmup_steps=10)  # a quarter of the way down
    assert quarter == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))


def test_warmup_stable_decay():
    lr = [warmup_stable_decay(s, total_steps=100, warmup_steps=10, decay_fraction=0.2) for s in range(101)]
    assert lr[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert set(lr[10:80]) == {1.0}  # stable until the last 20 %
    assert lr[90] == pytest.approx(0.5) and lr[100] == pytest.approx(0.0)  # linear decay to min_lr_ratio
    assert warmup_stable_decay(100, total_steps=100, warmup_steps=0, min_lr_ratio=0.25) == pytest.approx(0.25)


def test_constant_and_errors():
    assert [constant(s, total_steps=10, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert constant(0, total_steps=1) == 1.0
    with pytest.raises(ValueError, match="total_steps >= 1 .*trainer.max_steps"):
        warmup_cosine(0, total_steps=0)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        constant(0, total_steps=5, warmup_steps=-1)
    with pytest.raises(ValueError, match=r"decay_fraction must be in \[0, 1\]"):
        warmup_stable_decay(0, total_steps=5, decay_fraction=1.5)
