"""The Lightning module (attnres/training/lit.py): FLOPs per token by hand and no MFU on CPU,
parameter groups with the queries' learning-rate scale, and per-step seeds."""

from __future__ import annotations

import torch


def test_flops_per_token_by_hand_and_no_mfu_on_cpu():
    from attnres.model import Transformer
    from attnres.training.lit import flops_per_token, peak_flops

    m = Transformer(vocab_size=300, n_layer=3, n_head=2, n_embd=32, block_size=64)
    per_layer = 3 * 32 * 32 + 32 * 32 + 2 * 4 * 32 * 32 + 2 * 32  # qkv, proj, MLP up and down, two norm gains
    non_embedding = 3 * per_layer + 32  # and the final norm
    assert m.num_parameters(exclude_embedding=True) == non_embedding
    assert flops_per_token(m, 64) == 6 * (non_embedding + 300 * 32) + 12 * 3 * 64 * 32
    assert peak_flops(torch.device("cpu")) is None
