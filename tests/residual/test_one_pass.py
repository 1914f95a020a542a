"""The AttnRes strategies' one-pass route (attnres/residual/base.py, `run_one_pass`): a pass
without gradients over a few tokens, each step of KV-cached decoding, mixes each sublayer's
sources in one kernel call. It gives the reference path's function (float64, to rounding), it is
what a decoding step takes (one call per site, no two-phase call), and it is not taken where the
two-phase path is what a pass needs (gradients, many tokens, autocast, recording)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import attnres
from attnres.model import KVCache, Transformer
from attnres.ops import cpu_fused, torch_fused
from tests.helpers import mixed_sublayers

pytestmark = pytest.mark.usefixtures("torch_single_thread")

STRATEGIES = {
    "block-N2": functools.partial(attnres.BlockAttentionResidual, num_blocks=2),
    "block-unequal": functools.partial(attnres.BlockAttentionResidual, block_sizes=[3, 1, 4]),
    "block-kimi": functools.partial(attnres.BlockAttentionResidual, block_size_layers=3, eps=1e-5),
    "full": attnres.FullAttentionResidual,
    "full-no-aggregation": functools.partial(attnres.FullAttentionResidual, output_aggregation=False),
}
KERNELS = [pytest.param("torch", id="torch"),
           pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not cpu_fused.available(),
                                                                   reason="the C++ kernel does not build here"))]


def strategy(name: str, kernel: str, d: int = 16, L: int = 8):  # noqa: N803
    residual = STRATEGIES[name](d_model=d, num_layers=L, kernel=kernel).double()
    with torch.no_grad():  # off the initial values: zero queries read a uniform mean
        for p in residual.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    return residual


def calls(monkeypatch, module) -> list[int]:
    """Counts `module.mix_one`'s calls (the sources of each), still computing them."""
    seen, real = [], module.mix_one

    def counting(sources, queries, row, eps):
        seen.append(len(sources))
        return real(sources, queries, row, eps)

    monkeypatch.setattr(module, "mix_one", counting)
    return seen


@pytest.mark.parametrize("tokens", [(1, 1), (4, 1), (2, 64)], ids=["one-token", "batch-4", "128-tokens"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", STRATEGIES)
def test_one_pass_gives_the_reference_function(name, kernel, tokens, monkeypatch):
    residual = strategy(name, kernel)
    sublayers = mixed_sublayers(8, 16)
    x = torch.randn(*tokens, 16, dtype=torch.float64)
    seen = calls(monkeypatch, cpu_fused if kernel == "cpu" else torch_fused)
    with torch.no_grad():
        fast = residual(x, sublayers)
        residual.kernel = "naive"
        reference = residual(x, sublayers)
    assert len(seen) == 8 + residual.output_aggregation  # the one-pass route ran, one call per site
    torch.testing.assert_close(fast, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["block-N2", "block-kimi", "full"])
def test_a_decoding_step_makes_one_kernel_call_per_site_and_nothing_two_phase(name, kernel, monkeypatch):
    """What made Block decode slower than Full at batch 1: per token, its two-phase pass ran a
    phase-1 call per block, a merge per later sublayer and the plumbing around each; one call
    per site, over at most N + 1 sources (Block) or l + 1 (Full), is all a token needs."""
    torch.manual_seed(0)
    model = Transformer(vocab_size=11, n_layer=4, n_head=2, n_embd=16, block_size=12,
                        residual=functools.partial(STRATEGIES[name], kernel=kernel)).double().eval()
    prompt = torch.randint(0, 11, (1, 5))
    cache = KVCache(model.block_size)
    with torch.no_grad():
        model(prompt, kv_cache=cache)
        seen = calls(monkeypatch, cpu_fused if kernel == "cpu" else torch_fused)
        for phase in ("completed_attention", "merge_partial", "merge_completed"):
            for module in (attnres.residual.block, attnres.residual.full):
                if hasattr(module, phase):
                    monkeypatch.setattr(module, phase, lambda *a, **k: pytest.fail("a two-phase call while decoding"))
        model(prompt[:, -1:], kv_cache=cache)
    residual = model.residual
    if name == "full":
        assert seen == [*range(1, 9), 9]  # sublayer l mixes l + 1 sources; the output all 9
    else:
        starts = set(residual._starts)
        expected, done, partial = [], 1, False
        for index in range(8):
            if partial and index in starts:
                done, partial = done + 1, False
            expected.append(done + partial)
            partial = True
        assert seen == [*expected, done + 1]
        assert max(seen) <= residual.num_blocks + 1


def test_cached_greedy_decoding_with_the_one_pass_route_equals_the_full_forward():
    torch.manual_seed(0)
    model = Transformer(vocab_size=37, n_layer=2, n_head=2, n_embd=16, block_size=24,
                        residual=STRATEGIES["block-N2"]).double().eval()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.3 * torch.randn_like(p))
    idx = torch.randint(0, 37, (3, 20), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.block_size)
    with torch.no_grad():
        full = model(idx)["logits"]
        steps = [model(idx[:, :7], kv_cache=cache)["logits"]]
        steps += [model(idx[:, t : t + 1], kv_cache=cache)["logits"] for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("when", ["grad", "many-tokens", "recording", "autocast"])
def test_passes_that_need_the_two_phase_path_keep_it(when, monkeypatch):
    residual = strategy("block-N2", "torch").float()
    sublayers = mixed_sublayers(8, 16).float()
    tokens = (1, residual.one_pass_tokens + 1) if when == "many-tokens" else (1, 1)
    x = torch.randn(*tokens, 16)
    seen = calls(monkeypatch, torch_fused)
    if when == "recording":
        residual.record_next()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad() if when == "grad" else torch.no_grad())
        if when == "autocast":
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        residual(x, sublayers)
    assert seen == []


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_pass_takes_sublayer_outputs_that_are_views(kernel):
    """A sublayer may return a non-contiguous view; the one-pass kernels read it as it is."""
    residual = strategy("block-N2", kernel)
    linear = torch.nn.Linear(16, 16).double()

    def transposed(h):  # (B, T, D), its memory laid out (T, B, D)
        return torch.tanh(linear(h)).transpose(0, 1).contiguous().transpose(0, 1)

    x = torch.randn(3, 2, 16, dtype=torch.float64)
    with torch.no_grad():
        out = residual(x, [transposed] * 8)
        residual.kernel = "naive"
        torch.testing.assert_close(out, residual(x, [transposed] * 8), rtol=1e-12, atol=1e-12)
