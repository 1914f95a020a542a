"""Second-order gradients (create_graph=True) through every depth-attention implementation:
the public ops (`depth_attention`, `full_attn_res`, `block_attn_res`, the two-phase API) under
torch.autograd.gradgradcheck, in float64 on the CPU paths and float32 (looser) on Triton, which
runs in its CPU interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1); and the
strategies' own passes, which either give the reference path's second-order gradients or refuse
in one line naming the kernel to use. Before this, the C++ kernel's double backward was silently
wrong (only a PyTorch warning) and the torch and Triton paths raised an internal error."""

# Arguments use DESIGN.md's shape names (S sources, D, K queries).
# ruff: noqa: N803

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from attnres import BlockAttentionResidual, FullAttentionResidual
from attnres.functional import (
    block_attn_res,
    completed_attention,
    depth_attention,
    full_attn_res,
    key_inv_rms,
    merge_completed,
    merge_partial,
)
from attnres.ops.dispatch import triton_available

pytestmark = [
    pytest.mark.usefixtures("torch_single_thread"),
    # Triton's cases are float32 on purpose (its kernels take no float64): gradcheck's advice is moot
    pytest.mark.filterwarnings("ignore:Input #\\d+ requires gradient and is not a double:UserWarning"),
]

HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not triton_available() or (not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton (CUDA, or its CPU interpreter with TRITON_INTERPRET=1)",
)
needs_cpu_kernel = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                                      reason="needs a C++ compiler (the fused CPU kernel)")
# (kernel, device, dtype): the CPU paths in float64, Triton in float32 (its only full-precision dtype)
KERNELS = [
    pytest.param("naive", "cpu", torch.float64, id="naive"),
    pytest.param("torch", "cpu", torch.float64, id="torch"),
    pytest.param("cpu", "cpu", torch.float64, id="cpu", marks=needs_cpu_kernel),
    pytest.param("triton", "cuda" if HAS_CUDA else "cpu", torch.float32, id="triton", marks=needs_triton),
]
FAST = KERNELS[1:]  # the two-phase API has no naive implementation of its own


def interpreted_triton_slow(params: list) -> list:
    """`params` with Triton's case marked slow where it runs in the CPU interpreter (7 to 19 s a
    test there); the depth-attention checks, the smallest, keep it in the quick tier."""
    if HAS_CUDA:
        return params
    return [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow]) if p.id == "triton" else p
            for p in params]


def check(fn, inputs, dtype):
    """gradcheck and gradgradcheck of `fn` at `inputs`: float64 as tight as torch's defaults,
    every element; float32 (Triton) with a wider step and tolerances that a wrong second
    derivative still misses by orders of magnitude, and in fast mode (random projections of the
    Jacobians: a few calls, where the interpreter takes seconds per call)."""
    kw = {} if dtype == torch.float64 else {"eps": 1e-3, "atol": 5e-3, "rtol": 2e-2, "nondet_tol": 1e-5,
                                            "fast_mode": True}
    assert gradcheck(fn, inputs, **kw)
    assert gradgradcheck(fn, inputs, **kw)


def leaves(gen, dtype, device, *shapes, scale=1.0, shift=0.0):
    return [(shift + scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(device, dtype).requires_grad_()
            for s in shapes]


def op_inputs(S, lead, D, dtype, device, seed):
    """S sources (*lead, D) of different magnitudes, a query with O(1) logits and a gain."""
    gen = torch.Generator().manual_seed(seed)
    srcs = [s * (0.5 + i) for i, s in enumerate(leaves(gen, torch.float64, "cpu", *[(*lead, D)] * S))]
    srcs = [s.detach().to(device, dtype).requires_grad_() for s in srcs]
    q, = leaves(gen, dtype, device, (D,), scale=2.0 / D**0.5)
    g, = leaves(gen, dtype, device, (D,), scale=0.5, shift=1.0)
    return srcs, q, g


@pytest.mark.parametrize("kernel,device,dtype", KERNELS)
def test_issue_reproducer_matches_naive(kernel, device, dtype, rel_err):
    """The issue's reproducer: gq = d sum(h^2) / dq with create_graph, then d sum(gq^2) / dg,
    against the reference path on the same inputs (the C++ kernel gave other numbers)."""

    def second(kern, srcs, q, g):
        h, _ = depth_attention(srcs, q, g, 1e-6, kernel=kern)
        gq, = torch.autograd.grad(h.pow(2).sum(), q, create_graph=True)
        return torch.autograd.grad(gq.pow(2).sum(), [g, *srcs])

    srcs, q, g = op_inputs(3, (2, 4), 8, dtype, device, seed=0)
    got = second(kernel, srcs, q, g)
    want = second("naive", *[[x.detach().double().cpu().requires_grad_() for x in srcs]],
                  *(x.detach().double().cpu().requires_grad_() for x in (q, g)))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a.cpu(), b) < tol, i


@pytest.mark.parametrize("kernel,device,dtype", KERNELS)
@pytest.mark.parametrize("variant", ["gain", "no-gain", "output-norm"])
def test_depth_attention_gradgradcheck(kernel, device, dtype, variant):
    """Both results (h and the weights), every input: sources, query, gain, output-norm weight."""
    S, lead, D = (3, (2, 2), 6) if kernel != "triton" else (2, (3,), 4)
    srcs, q, g = op_inputs(S, lead, D, dtype, device, seed=1)
    gen = torch.Generator().manual_seed(2)
    w, = leaves(gen, dtype, device, (D,), scale=0.3, shift=1.0)

    def fn(q, g, w, *srcs):
        return depth_attention(list(srcs), q, None if variant == "no-gain" else g, 1e-6, kernel,
                               w if variant == "output-norm" else None)

    check(fn, (q, g, w, *srcs), dtype)


@pytest.mark.parametrize("kernel,device,dtype", interpreted_triton_slow(KERNELS))
def test_full_and_block_attn_res_gradgradcheck(kernel, device, dtype):
    srcs, q, g = op_inputs(3, (1, 3), 4, dtype, device, seed=3)

    def full(q, emb, *prev):
        return full_attn_res(emb, list(prev), q, kernel=kernel)["retrieved_representation"]

    def block(q, g, *blocks):
        return block_attn_res(list(blocks[:-1]), blocks[-1], q, g, return_weights=True, kernel=kernel)

    check(full, (q, *srcs), dtype)
    check(block, (q, g, *srcs), dtype)


@pytest.mark.parametrize("kernel,device,dtype", interpreted_triton_slow(FAST))
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-rms"])
def test_two_phase_gradgradcheck(kernel, device, dtype, cached):
    """Phase 1 (K queries, the log-sum-exp too), its extension by more sources with prefixes
    (`merge_completed`) and phase 2 with one source (Block's partial sum: `merge_one` on the
    torch path) and with two (Full's chunks). A cached key statistic is recomputed from the
    perturbed sources inside `fn`, as a strategy computes it from the sources it holds."""
    D, lead = 4, (3,)
    gen = torch.Generator().manual_seed(4)
    srcs = leaves(gen, dtype, device, *[(*lead, D)] * 3)
    queries, = leaves(gen, dtype, device, (2, D), scale=0.7)
    accs = leaves(gen, dtype, device, *[(*lead, D)] * 2)
    lse, = leaves(gen, dtype, device, (2, *lead))

    def rms(sources):
        return torch.stack([key_inv_rms(s, kernel=kernel) for s in sources]) if cached else None

    def phase1(queries, *srcs):
        outs, lse = completed_attention(list(srcs), rms(srcs), queries, kernel=kernel)
        return (*outs, lse)

    def extend(queries, lse, a0, a1, *srcs):
        outs, merged = merge_completed([a0, a1], lse, list(srcs), rms(srcs), queries, kernel=kernel)
        return (*outs, merged)

    def phase2(query, lse, acc, *srcs):
        return merge_partial(acc, lse, list(srcs), rms(srcs), query, kernel=kernel)

    check(phase1, (queries, *srcs), dtype)
    check(extend, (queries, lse, *accs, *srcs[:2]), dtype)
    check(phase2, (queries[0], lse[0], accs[0], srcs[0]), dtype)
    check(phase2, (queries[1], lse[1], accs[1], *srcs[1:]), dtype)


def _strategy_case(strategy, kernel, **kw):
    """A strategy over 4 sublayers (tanh of a linear map each; the Transformer's CPU attention has
    no double backward of its own), its parameters far from their zero start, and an embedding."""
    torch.manual_seed(0)
    res = strategy(8, 4, kernel=kernel, **kw).double()
    with torch.no_grad():
        res.pseudo_query.normal_(0.0, 0.5)  # weights far from uniform
        res.key_norm_weight.uniform_(0.5, 1.5)
    maps = [torch.nn.Linear(8, 8).double() for _ in range(4)]
    emb = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    return res, maps, emb


def _penalty_grads(res, maps, emb):
    """A gradient penalty: d |d loss / d (params, embedding)|^2 / d (params, embedding)."""
    params = [*res.parameters(), *(p for m in maps for p in m.parameters()), emb]
    loss = res(emb, [lambda h, m=m: torch.tanh(m(h)) for m in maps]).pow(2).sum()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return torch.autograd.grad(sum(g.pow(2).sum() for g in grads), params)


@pytest.mark.parametrize("strategy,kw", [(BlockAttentionResidual, {"num_blocks": 2}), (FullAttentionResidual, {})],
                         ids=["block", "full"])
@pytest.mark.parametrize("kernel", [pytest.param("cpu", marks=needs_cpu_kernel), "torch"])
def test_strategy_second_order_matches_reference_or_refuses(strategy, kw, kernel, rel_err):
    """The strategies' two-phase passes: the C++ kernel (its gradient sink bypassed) gives the
    reference path's second-order gradients. The torch path reads its completed sources from the
    pass's buffer and keeps no reference to the sources themselves (that is what saves their
    memory), so it cannot differentiate its backward again: one line naming the kernel to use."""
    want = _penalty_grads(*_strategy_case(strategy, "naive", **kw))
    if kernel == "torch":
        with pytest.raises(RuntimeError, match=r"kernel='naive'") as err:
            _penalty_grads(*_strategy_case(strategy, kernel, **kw))
        assert "\n" not in str(err.value)
        return
    got = _penalty_grads(*_strategy_case(strategy, kernel, **kw))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a, b) < 1e-10, i
