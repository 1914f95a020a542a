"""Synthetic pointer chasing (attnres/data/synthetic.py): every answer follows from the
inputs, no answer leaks into them, errors name the fix, and exact match counts whole answers."""

from __future__ import annotations

import pytest
import torch

from attnres.config.errors import ConfigError
from attnres.data import SyntheticDataModule, exact_match
from tests.data.conftest import synthetic_module


def follow_chains(inputs: list[int], dm: SyntheticDataModule) -> list[int]:
    """Recompute every answer from the input tokens alone (keys are s, values S + s)."""
    S, P, H = dm.num_symbols, dm.num_pairs, dm.num_hops
    f = dict(zip(inputs[1 : 2 * P : 2], inputs[0 : 2 * P : 2], strict=True))  # listed as "f(k) k"
    assert len(f) == P and all(k < S <= v < 2 * S for k, v in f.items())
    answers = []
    for q in range(dm.num_queries):
        at = 2 * P + q * (1 + H)
        assert inputs[at] == 2 * S + 1 and inputs[at + 2 : at + 1 + H] == [2 * S + 2] * (H - 1)  # QUERY x_0 ANS..
        x = inputs[at + 1]
        for _ in range(H):
            answers.append(f[x])
            x = f[x] - S
    return answers


@pytest.mark.parametrize(
    ("num_symbols", "num_pairs", "num_queries", "num_hops"),
    [(8, None, 4, 2), (16, 16, 1, 3), (12, 6, 6, 1), (5, 5, 2, 7)],
    ids=["S8-P8-Q4-H2", "S16-P16-Q1-H3", "S12-P6-Q6-H1", "S5-P5-Q2-H7-wraps"],
)
def test_synthetic_answers_follow_from_inputs(num_symbols, num_pairs, num_queries, num_hops):
    P = num_pairs or num_symbols
    dm = synthetic_module(num_symbols=num_symbols, num_pairs=num_pairs, num_queries=num_queries, num_hops=num_hops,
                          block_size=2 * P + num_queries * (1 + num_hops) + 3)
    assert dm.vocab_size == 2 * num_symbols + 3
    inputs, targets = next(iter(dm.train_dataloader()))
    for x, y in zip(inputs.tolist(), targets.tolist(), strict=True):
        assert [t for t in y if t != -100] == follow_chains(x, dm)
        scored = [k for k, t in enumerate(y) if t != -100]
        assert not set(scored) & set(range(2 * P))  # nothing scored inside the pairs
        assert x[-3:] == [2 * num_symbols] * 3  # PAD to block_size
        assert max(x) < dm.vocab_size


def test_synthetic_answers_are_not_in_the_inputs_after_the_pairs():
    dm = synthetic_module()
    inputs, targets = dm.val_dataset()[0]
    after = inputs[2 * dm.num_pairs :]
    assert not ((after >= dm.num_symbols) & (after < 2 * dm.num_symbols)).any()  # no value token: no teacher forcing
    assert (targets != -100).sum() == dm.num_queries * dm.num_hops


def test_synthetic_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"set data.block_size>=40"):
        SyntheticDataModule(block_size=39, batch_size=4)
    with pytest.raises(ConfigError, match="num_pairs"):
        SyntheticDataModule(block_size=64, batch_size=4, num_symbols=8, num_pairs=9)
    with pytest.raises(ConfigError, match="num_queries"):
        SyntheticDataModule(block_size=64, batch_size=4, num_symbols=4, num_queries=5)
    assert SyntheticDataModule().block_size == 40 and SyntheticDataModule().num_queries == 8


def test_exact_match_counts_whole_answers():
    # row 0: answers [1:3) right and [4:5) wrong; row 1: [0:2) right; row 2: nothing scored
    targets = torch.tensor([[-100, 2, 1, -100, 0], [1, 1, -100, -100, -100], [-100] * 5])
    predicted = torch.tensor([[0, 2, 1, 0, 2], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    logits = torch.nn.functional.one_hot(predicted, 3).float()
    assert exact_match(logits, targets).item() == pytest.approx(2 / 3)
    assert exact_match(logits[:1, 1:3], targets[:1, 1:3]).item() == 1.0
    assert exact_match(logits[2:], targets[2:]).isnan()
    assert SyntheticDataModule.exact_match is exact_match


def test_exact_match_on_a_perfect_and_a_blind_model():
    dm = synthetic_module(num_hops=3, block_size=48)
    inputs, targets = next(iter(dm.val_dataloader()))
    perfect = torch.nn.functional.one_hot(targets.clamp(min=0), dm.vocab_size).float()
    assert exact_match(perfect, targets).item() == 1.0
    blind = torch.zeros(*targets.shape, dm.vocab_size)
    blind[..., dm.num_symbols] = 1.0  # always the same value token
    assert exact_match(blind, targets).item() < 0.05
