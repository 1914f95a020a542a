"""The next sublayer's pre-norm fused into the two-phase depth mix (`output_norm_weight=` on
`completed_attention`, `merge_completed`, `merge_partial`; the C++ and Triton kernels fuse it (Triton
in its CPU interpreter without a GPU: tests/conftest.py), the other paths compose it) and the
strategies' `fuse_prenorm`, against the unfused reference: the mix, then RMSNorm with the norm's own
eps, in value and gradient."""

# Arguments use DESIGN.md's shape names (S sources, D, K queries).
# ruff: noqa: N803

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from attnres import BlockAttentionResidual, FullAttentionResidual, Transformer, functional
from attnres.functional import completed_attention, merge_completed, merge_partial
from attnres.ops import cpu_fused, naive_depth_attention
from attnres.ops.dispatch import triton_available

pytestmark = [
    pytest.mark.usefixtures("torch_single_thread"),
    pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="needs a C++ compiler"),
]

TRITON = triton_available() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not TRITON, reason="needs triton (CUDA, or its interpreter: TRITON_INTERPRET=1)")
# (kernel, dtype): the C++ kernel at float64 and float32, Triton at float32 (its widest), the composed path at both
KERNEL_DTYPES = [pytest.param(k, dt, id=f"{k}-f{dt.itemsize * 8}")
                 for k in ("cpu", "torch") for dt in (torch.float64, torch.float32)]
KERNEL_DTYPES.append(pytest.param("triton", torch.float32, id="triton-f32", marks=needs_triton))
D = 12
EPS, NORM_EPS = 1e-6, 1e-3  # the norm's own eps, unlike the mix's: the fused op must take it apart
# (value, gradient) tolerances against the float64 reference
TOLERANCE = {torch.float64: (1e-12, 1e-11), torch.float32: (1e-5, 1e-4)}


def _fused_in_the_kernel(kernel, monkeypatch):
    """On the kernels that fuse the norm (C++, Triton), a norm composed after the mix is an error."""
    if kernel == "cpu":
        assert cpu_fused.available(), cpu_fused.load_error()
    if kernel in ("cpu", "triton"):
        def composed(*args):
            raise AssertionError(f"the pre-norm was composed after the mix on kernel={kernel!r}, not fused")
        monkeypatch.setattr(functional, "_prenorm", composed)


def _rms_norm64(h, w, eps):
    return h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps) * w


def _case(S, K, seed):
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randn(2, 5, D, generator=gen, dtype=torch.float64) * (1 + i) for i in range(S)]
    q = torch.randn(K, D, generator=gen, dtype=torch.float64)  # far from uniform weights
    w = 1 + 0.3 * torch.randn(D, generator=gen, dtype=torch.float64)
    cots = [torch.randn(2, 5, D, generator=gen, dtype=torch.float64) for _ in range(K)]
    return src, q, w, cots


def _reference(src, q, w, cots):
    """The K outputs (output 0 normed) and the gradients of sum_k <out_k, cot_k> in float64."""
    leaves = [t.clone().requires_grad_() for t in (*src, q, w)]
    *s, qq, ww = leaves
    outs = [naive_depth_attention(s, qq[k], None, EPS)[0] for k in range(len(qq))]
    outs[0] = _rms_norm64(outs[0], ww, NORM_EPS)
    loss = sum((o * c).sum() for o, c in zip(outs, cots, strict=True))
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves)


def _check(outs, leaves, src, q, w, cots, dtype, rel_err):
    want_outs, want_grads = _reference(src, q, w, cots)
    tol_value, tol_grad = TOLERANCE[dtype]
    for got, want in zip(outs, want_outs, strict=True):
        assert got.dtype == dtype
        assert rel_err(got.double(), want) < tol_value
    loss = sum((o * c.to(dtype)).sum() for o, c in zip(outs, cots, strict=True))
    for got, want in zip(torch.autograd.grad(loss, leaves), want_grads, strict=True):
        assert rel_err(got.double(), want) < tol_grad


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("K", [1, 3, 6])
@pytest.mark.parametrize("S", range(1, 10), ids=lambda s: f"S{s}")
def test_phase1_norms_output_zero(S, K, kernel, dtype, rel_err, monkeypatch):
    """Phase 1 over S sources with K queries: output 0 is RMSNorm(h_0) w (the norm's eps, not
    the mix's), the others untouched; gradients of sources, queries and w."""
    _fused_in_the_kernel(kernel, monkeypatch)
    src, q, w, cots = _case(S, K, seed=S * 10 + K)
    leaves = [t.to(dtype).requires_grad_() for t in (*src, q, w)]
    outs, lse = completed_attention(leaves[:S], None, leaves[S], EPS, kernel, output_norm_weight=leaves[S + 1],
                                    output_norm_eps=NORM_EPS)
    _check(outs, leaves, src, q, w, cots, dtype, rel_err)


@pytest.mark.parametrize("kernel,dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("K", [1, 5])
@pytest.mark.parametrize("S", range(2, 10), ids=lambda s: f"S{s}")
def test_merge_norms_output_zero(S, K, kernel, dtype, rel_err, monkeypatch):
    """Phase 1 over the first sources, then the rest merged in with the pre-norm on output 0:
    `merge_partial` (K = 1, Full's phase 2 and Block's partial sum) and `merge_completed` (K
    queries over a prefix: Block's block-early pass; Triton takes one query a call, the norm in
    the first), every split of S sources."""
    _fused_in_the_kernel(kernel, monkeypatch)
    for first in range(1, S):
        src, q, w, cots = _case(S, K, seed=100 * S + 10 * K + first)
        leaves = [t.to(dtype).requires_grad_() for t in (*src, q, w)]
        sources, queries, weight = leaves[:S], leaves[S], leaves[S + 1]
        accs, lse = completed_attention(sources[:first], None, queries, EPS, kernel)
        if K == 1:
            outs = [merge_partial(accs[0], lse[0], sources[first:], None, queries[0], EPS, kernel,
                                  output_norm_weight=weight, output_norm_eps=NORM_EPS)]
        else:
            outs, _ = merge_completed(accs, lse, sources[first:], None, queries, EPS, kernel,
                                      output_norm_weight=weight, output_norm_eps=NORM_EPS)
        _check(outs, leaves, src, q, w, cots, dtype, rel_err)


def _model(strategy, kernel, fuse, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    m = Transformer(vocab_size=40, n_layer=3, n_head=2, n_embd=16, block_size=8, norm_eps=1e-5,
                    residual=functools.partial(strategy, kernel=kernel, **kw)).double()
    with torch.no_grad():
        m.residual.pseudo_query.normal_(0.0, 0.5)  # weights far from uniform
        for sub in m.sublayers:  # norm gains away from 1, so a dropped or doubled gain shows
            sub.norm.weight.normal_(1.0, 0.3)
    m.residual.fuse_prenorm = fuse
    return m.to(dtype)  # the same weights at every dtype


def _loss_and_grads(model, idx, create_graph=False):
    loss = model(idx, targets=idx)["loss"]
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(loss, params, create_graph=create_graph)
    return loss, dict(zip([n for n, _ in model.named_parameters()], grads, strict=True))


STRATEGIES = [(BlockAttentionResidual, {"num_blocks": 3}), (BlockAttentionResidual, {"block_sizes": [1, 3, 2]}),
              (BlockAttentionResidual, {"num_blocks": 6, "output_aggregation": False}),
              (BlockAttentionResidual, {"num_blocks": 1}), (FullAttentionResidual, {})]
IDS = ["block3", "block-uneven-1-3-2", "block6-noagg", "block1", "full"]


@pytest.mark.parametrize("strategy,kw", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("kernel,dtype,tol", [("cpu", torch.float64, 1e-12), ("cpu", torch.float32, 1e-4),
                                              ("torch", torch.bfloat16, 3e-2),
                                              pytest.param("triton", torch.float32, 1e-4, marks=needs_triton)],
                         ids=["cpu-f64", "cpu-f32", "torch-bf16", "triton-f32"])
def test_strategy_with_fused_prenorm_matches_the_reference(strategy, kw, kernel, dtype, tol, rel_err, monkeypatch):
    """A model whose strategy fuses each sublayer's pre-norm into its mix gives the reference
    path's loss and every parameter's gradient (float64 reference; float32 on the C++ and Triton
    kernels, bfloat16 on the composed plain-PyTorch path at their tolerances)."""
    idx = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(_model(strategy, "naive", False, **kw), idx)
    _fused_in_the_kernel(kernel, monkeypatch)
    fused = _model(strategy, kernel, True, dtype, **kw)
    calls = []
    for sub in fused.sublayers:  # every sublayer is handed its normed input
        sub.forward_normed = functools.partial(lambda f, *a, **k: calls.append(1) or f(*a, **k), sub.forward_normed)
    got_loss, got = _loss_and_grads(fused, idx)
    assert len(calls) == len(fused.sublayers)
    assert rel_err(got_loss.double(), want_loss) < tol
    for name in want:
        assert rel_err(got[name].double(), want[name]) < tol, name


@pytest.mark.parametrize("strategy,kw", STRATEGIES[:1] + STRATEGIES[-1:], ids=["block3", "full"])
def test_hooked_sublayer_keeps_its_own_norm(strategy, kw):
    """A hook on a sublayer's norm sees the mix h, as without fusing: that sublayer is not fused."""
    seen = []
    model = _model(strategy, "cpu", True, **kw)
    model.sublayers[1].norm.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    model(torch.zeros(1, 8, dtype=torch.long))
    assert len(seen) == 1 and seen[0].shape == (1, 8, 16)


@pytest.mark.parametrize("kernel,dtype", [pytest.param("cpu", torch.float64, id="cpu"),
                                          pytest.param("triton", torch.float32, id="triton", marks=needs_triton)])
@pytest.mark.parametrize("strategy,kw", STRATEGIES[:1] + STRATEGIES[-1:], ids=["block3", "full"])
def test_double_backward_through_a_fused_merge_is_refused_in_one_line(strategy, kw, kernel, dtype):
    """A merge's h needs the prefix's value, which the fused op does not keep: a backward with
    create_graph=True through it stops with one line naming the fix."""
    idx = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match=r"^attnres: a second-order gradient .* set fuse_prenorm=False[^\n]*$"):
        _loss_and_grads(_model(strategy, kernel, True, dtype, **kw), idx, create_graph=True)


def test_double_backward_through_a_fused_phase1_is_right():
    """Phase 1 with the norm on output 0 and no prefix: its second-order gradients are autograd's
    (gradgradcheck in float64 on the C++ kernel)."""
    assert cpu_fused.available(), cpu_fused.load_error()
    src, q, w, _ = _case(3, 2, seed=7)
    leaves = [t.clone().requires_grad_() for t in (*src, q, w)]

    def f(*xs):
        outs, _ = completed_attention(list(xs[:3]), None, xs[3], EPS, "cpu", output_norm_weight=xs[4],
                                      output_norm_eps=NORM_EPS)
        return tuple(outs)

    assert torch.autograd.gradgradcheck(f, leaves, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,kw", [(BlockAttentionResidual, {"num_blocks": 2}), (FullAttentionResidual, {})],
                         ids=["block2", "full"])
def test_fused_prenorm_under_torch_compile_matches_eager(strategy, kw, rel_err):
    """torch.compile(fullgraph=True) traces the fused calls (the C++ ops' fake shapes, the hook
    checks) and gives eager's loss and gradients."""
    assert cpu_fused.available(), cpu_fused.load_error()
    torch.manual_seed(0)
    model = Transformer(vocab_size=40, n_layer=2, n_head=2, n_embd=16, block_size=8,
                        residual=functools.partial(strategy, kernel="auto", **kw))
    with torch.no_grad():
        model.residual.pseudo_query.normal_(0.0, 0.5)
    model.residual.fuse_prenorm = True
    idx = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    want = model(idx, targets=idx)["loss"]
    want_grads = torch.autograd.grad(want, params)
    got = torch.compile(model, fullgraph=True)(idx, targets=idx)["loss"]
    assert rel_err(got.detach(), want.detach()) < 1e-5
    for g, w in zip(torch.autograd.grad(got, params), want_grads, strict=True):
        assert rel_err(g, w) < 1e-4
