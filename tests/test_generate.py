"""KV-cached decoding equals full forwards, for every residual strategy.

A new token's depth sources are its own earlier sublayer outputs, computed in the same pass, so
no strategy needs a cache of its own: only attention reads other positions. The checks run in
float64 with every strategy's parameters moved off their (symmetric) initial values, so the depth
weights are not uniform and a strategy that mixed positions would show.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import attnres
from attnres.model import KVCache, Transformer

STRATEGIES = {
    "standard": attnres.StandardResidual,
    "block": partial(attnres.BlockAttentionResidual, num_blocks=2),
    "full": attnres.FullAttentionResidual,
    "denseformer": attnres.DenseFormerResidual,
    "hc": attnres.HyperConnectionResidual,
    "mhc": attnres.ManifoldHyperConnectionResidual,
}


def model(strategy: str, block_size: int = 24, mlp: str = "gelu") -> Transformer:
    torch.manual_seed(0)
    m = Transformer(vocab_size=37, n_layer=2, n_head=2, n_embd=16, block_size=block_size, mlp=mlp,
                    residual=STRATEGIES[strategy]).double().eval()
    with torch.no_grad():
        for p in m.residual.parameters():  # off their initial values (zero queries read a uniform mean)
            p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cached_logits_equal_the_full_forward(strategy):
    m = model(strategy)
    idx = torch.randint(0, 37, (3, 20), generator=torch.Generator().manual_seed(1))
    full = m(idx)["logits"]  # (B, T, V)
    cache = KVCache(m.block_size)
    prefill = m(idx[:, :7], kv_cache=cache)["logits"]  # a prompt of 7, then 3 at once, then one by one
    chunk = m(idx[:, 7:10], kv_cache=cache)["logits"]
    steps = [m(idx[:, t : t + 1], kv_cache=cache)["logits"] for t in range(10, 20)]
    cached = torch.cat([prefill, chunk, *steps], dim=1)
    assert cache.pos == 20
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cached_greedy_generation_equals_full_forward_greedy(strategy):
    m = model(strategy, block_size=16)
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(2))
    # 20 new tokens: past block_size=16, so the window slides and the cache is rebuilt
    cached = m.generate(prompt, 20, temperature=0, use_cache=True)
    reference = prompt
    for _ in range(20):  # greedy decoding by full forwards over the last block_size tokens
        logits = m(reference[:, -m.block_size :])["logits"][:, -1]
        reference = torch.cat((reference, logits.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(cached, reference)


def test_sampling_is_reproducible_and_top_k_bounds_it():
    m = model("block")
    prompt = torch.zeros(4, 1, dtype=torch.long)
    a = m.generate(prompt, 12, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    b = m.generate(prompt, 12, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (4, 13)
    one = m.generate(prompt, 6, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one, m.generate(prompt, 6, temperature=0))  # top_k=1 is greedy


def test_generation_errors():
    m = model("standard")
    with pytest.raises(ValueError, match="temperature"):
        m.generate(torch.zeros(1, 1, dtype=torch.long), 2, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        m.generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=0)
    cache = KVCache(4)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        m(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
