"""A recorded forward under bf16 autocast (what a bf16-mixed run's dashboards and probes see): the
float32 embedding and the bfloat16 sublayer outputs are mixed in their promoted dtype, as the fast
path mixes them, instead of being refused ("all sources must share dtype")."""

from __future__ import annotations

import functools

import pytest
import torch

import attnres


@pytest.mark.parametrize("strategy", ["block", "full", "block-ablated"])
def test_a_recorded_forward_runs_under_bf16_autocast(strategy):
    torch.manual_seed(0)
    residual = {"block": functools.partial(attnres.BlockAttentionResidual, num_blocks=2),
                "full": attnres.FullAttentionResidual,
                "block-ablated": functools.partial(attnres.BlockAttentionResidual, num_blocks=2, query="input")}
    model = attnres.Transformer(vocab_size=64, n_layer=2, n_embd=32, n_head=2, residual=residual[strategy])
    x = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = model(x)["logits"]
        model.residual.record_next()
        recorded = model(x)["logits"]
    assert torch.allclose(recorded.float(), fast.float(), atol=5e-2), (recorded - fast).abs().max()
    weights = model.residual.recorded.weights
    assert len(weights) == model.residual.num_layers + 1  # every sublayer's and the output's
    for w in weights.values():
        assert torch.allclose(w.float().sum(0), torch.ones(()), atol=1e-2)
