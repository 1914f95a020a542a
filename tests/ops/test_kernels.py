"""The fast depth-attention paths (`attnres/ops/torch_fused.py`, `attnres/ops/cpu_fused.py`,
`attnres/ops/triton_fused.py`) against the reference (`naive.py`) and the independent float64
reference of tests/conftest.py:
the op, the two-phase API the strategies use, the strategies themselves, dispatch and
torch.compile. Forward and every gradient go through the one `rel_err` helper.

Triton runs on CUDA when a GPU is present (`gpu` marker), and otherwise in Triton's CPU
interpreter when triton is installed: TRITON_INTERPRET=1 is set below, before anything
imports the kernels (triton reads it when a kernel is defined). Interpreted shapes are tiny.
"""

# Arguments use DESIGN.md's shape names (S sources, B, T, D, L sublayers, N blocks, K queries).
# ruff: noqa: N803

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
from torch import nn

from attnres import BlockAttentionResidual, FullAttentionResidual
from attnres.functional import (
    completed_attention,
    depth_attention,
    fold_queries,
    key_inv_rms,
    merge_completed,
    merge_partial,
)
from attnres.ops import cpu_fused, naive_depth_attention
from attnres.ops.dispatch import triton_available

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = triton_available()  # finds triton (>= 3.2) without importing it
if HAS_TRITON and not HAS_CUDA:  # before attnres.ops.triton_fused, hence triton.jit, is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton (CUDA, or its CPU interpreter with TRITON_INTERPRET=1)",
)
# the C++ kernel builds on first use wherever a compiler is: there, a failed build fails the tests
HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
needs_cpu_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="needs a C++ compiler (the fused CPU kernel)")
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device and triton")

DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# relative error allowed per input dtype (as tests/test_functional.py)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def impl_params(dtypes_torch, dtypes_triton):
    """(kernel, device, dtype) cases: the torch path on CPU, the C++ kernel on CPU (its dtypes
    among `dtypes_torch`), Triton interpreted or on CUDA."""
    params = [pytest.param("torch", "cpu", dt, id=f"torch-{DTYPE_NAMES[dt]}") for dt in dtypes_torch]
    params += [
        pytest.param("cpu", "cpu", dt, id=f"cpu-{DTYPE_NAMES[dt]}", marks=needs_cpu_kernel)
        for dt in dtypes_torch if dt in cpu_fused.DTYPES
    ]
    params += [
        pytest.param("triton", TRITON_DEVICE, dt, id=f"triton-{DTYPE_NAMES[dt]}", marks=needs_triton)
        for dt in dtypes_triton
    ]
    return params


IMPLS = impl_params([torch.float64, torch.float32, torch.bfloat16], [torch.float32, torch.bfloat16, torch.float16])

# (S sources, B, T, D): one source, non-powers of two (48, 97), B*T from 1 to 34
OP_CASES = [
    pytest.param(1, 2, 3, 8, id="S1-BT6-D8"),
    pytest.param(3, 1, 1, 48, id="S3-BT1-D48"),
    pytest.param(5, 2, 17, 97, id="S5-BT34-D97"),
    pytest.param(9, 1, 5, 64, id="S9-BT5-D64"),
]
#: the shape on which Triton's half dtypes run (several sources, several token blocks, masked D)
HALF_TRITON_CASE = "S5-BT34-D97"


def op_params():
    """IMPLS x OP_CASES, but Triton's bfloat16 and float16 on HALF_TRITON_CASE only: its launch shape
    (`triton_fused._launch_shape`: BLOCK_D, BLOCK_M, warps) and its control flow depend on S, the
    tokens and D, never on the dtype, which enters only where the kernels load a source (converted
    to float32) and store a result (rounded once), the same instructions on every shape. So Triton
    runs every shape in float32 and each half dtype once; the CPU paths keep the full grid."""
    params = []
    for impl in IMPLS:
        kernel, device, dtype = impl.values
        for case in OP_CASES:
            if kernel == "triton" and dtype != torch.float32 and case.id != HALF_TRITON_CASE:
                continue
            params.append(pytest.param(kernel, device, dtype, *case.values, id=f"{impl.id}-{case.id}",
                                       marks=[*impl.marks, *case.marks]))
    return params


def sources_and_params(S, B, T, D, dtype, device, seed, lead=None):
    """Leaf sources (B, T, D), or (*lead, D), of different magnitudes, a nonzero query (O(1)
    logits) and a gain."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(S, generator=gen, dtype=torch.float64)).tolist()
    shape = (B, T, D) if lead is None else (*lead, D)
    srcs = [(torch.randn(shape, generator=gen, dtype=torch.float64) * s) for s in scales]
    q = torch.randn(D, generator=gen, dtype=torch.float64) * 2.0 / D**0.5
    g = 1.0 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64)
    leaf = functools.partial(_leaf, dtype=dtype, device=device)
    return [leaf(s) for s in srcs], leaf(q, dtype=torch.float32 if dtype != torch.float64 else dtype), leaf(g)


def _leaf(x, dtype, device):
    return x.to(device=device, dtype=dtype).requires_grad_()


def upcast(xs):
    return [x.detach().cpu().to(torch.float64).requires_grad_() for x in xs]


def grads_of(outputs, cotangents, inputs):
    """d(sum_k <output_k, cotangent_k>)/d inputs; cotangents are float64 CPU tensors."""
    total = sum((o.to(torch.float64).cpu() * c).sum() for o, c in zip(outputs, cotangents, strict=True))
    return torch.autograd.grad(total, inputs, allow_unused=True)


def cotangents_for(tensors, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in tensors]


def assert_close(rel_err, got, want, tol, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = rel_err(a.cpu(), b)
        assert err < tol, f"{what}[{i}]: relative error {err:.2e} >= {tol:.0e}"


# ------------------------------------------------------------------------------------------------
# the op: fast paths against the reference, forward and every gradient
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,device,dtype,S,B,T,D", op_params())
def test_op_matches_reference(kernel, device, dtype, S, B, T, D, rel_err, ref_depth_attention, rounded_once):
    srcs, q, g = sources_and_params(S, B, T, D, dtype, device, seed=S * 100 + D)
    h, w = depth_attention(srcs, q, g, kernel=kernel)
    assert h.dtype == dtype and h.shape == (B, T, D) and h.device.type == device
    assert w.dtype == dtype and w.shape == (S, B, T)
    inputs = [*srcs, q, g]
    cot = cotangents_for([h, w], seed=S)
    grads = grads_of([h, w], cot, inputs)

    ref_inputs = upcast(inputs)
    ref_h, ref_w = ref_depth_attention(ref_inputs[:S], ref_inputs[S], ref_inputs[S + 1])
    ref_grads = grads_of([ref_h, ref_w], cot, ref_inputs)
    tol = TOL[dtype]
    assert_close(rel_err, [h, w], [ref_h, ref_w], tol, "forward")
    rounded_once(w, ref_w, dtype)  # float32 statistics, the weights rounded once to the input dtype
    assert_close(rel_err, grads, ref_grads, tol, "grad")

    # and the same as the naive implementation on the same inputs
    nh, nw = naive_depth_attention(srcs, q, g)
    assert_close(rel_err, [h, w], [nh.to(torch.float64), nw.to(torch.float64)], tol, "vs naive")


@pytest.mark.parametrize("kernel,device,dtype,S,B,T,D", op_params())
def test_op_output_norm_matches_reference(kernel, device, dtype, S, B, T, D, rel_err, ref_depth_attention):
    """The fused output RMSNorm over several token blocks (the Triton backward sums the norm
    weight's gradient over programs): forward and every gradient against the float64 op and
    RMSNorm, and the same as the naive implementation."""
    srcs, q, g = sources_and_params(S, B, T, D, dtype, device, seed=S * 100 + D + 1)
    gen = torch.Generator().manual_seed(D)
    w = _leaf(1 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64), dtype, device)
    y, a = depth_attention(srcs, q, g, kernel=kernel, output_norm_weight=w)
    inputs = [*srcs, q, g, w]
    cot = cotangents_for([y, a], seed=S + 1)
    grads = grads_of([y, a], cot, inputs)
    ref_inputs = upcast(inputs)
    ref_h, ref_a = ref_depth_attention(ref_inputs[:S], ref_inputs[S], ref_inputs[S + 1])
    ref_y = ref_h / torch.sqrt(ref_h.pow(2).mean(-1, keepdim=True) + 1e-6) * ref_inputs[S + 2]
    ref_grads = grads_of([ref_y, ref_a], cot, ref_inputs)
    tol = TOL[dtype]
    assert_close(rel_err, [y, a], [ref_y, ref_a], tol, "forward")
    assert_close(rel_err, grads, ref_grads, tol, "grad")
    ny, na = naive_depth_attention(srcs, q, g, output_norm_weight=w)
    assert_close(rel_err, [y, a], [ny.to(torch.float64), na.to(torch.float64)], tol, "vs naive")


@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float32], [torch.float32, torch.bfloat16]))
@pytest.mark.parametrize("magnitude", [1e30, 1e-30], ids=["1e30", "1e-30"])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_op_extreme_magnitudes(kernel, device, dtype, magnitude, rel_err, ref_depth_attention, rounded_once):
    """Squares of 1e30 overflow float32: the statistics rescale rows (naive.py always does; the
    Triton kernels when the sum of squares comes out infinite, which the interpreter warns of).
    The gradients too: r^2 (and the output norm's n^3) under- or overflow there, so the backward
    must form its products in an order whose factors stay in range."""
    srcs, q, g = sources_and_params(3, 1, 4, 16, torch.float64, "cpu", seed=4)
    srcs = [(s.detach() * magnitude).to(device=device, dtype=dtype).requires_grad_() for s in srcs]
    q, g = q.detach().float().to(device), g.detach().float().to(device)
    h, w = depth_attention(srcs, q, g, kernel=kernel)
    ref_srcs = upcast(srcs)
    ref_h, ref_w = ref_depth_attention(ref_srcs, q.double().cpu(), g.double().cpu())
    assert torch.isfinite(h).all()
    rounded_once(w, ref_w, dtype)
    assert rel_err(h.cpu(), ref_h) < TOL[dtype]
    (cot,) = cotangents_for([ref_h], seed=5)
    got = grads_of([h], [cot / magnitude], srcs)  # gradients of order 1
    want = grads_of([ref_h], [cot / magnitude], ref_srcs)
    assert_close(rel_err, got, want, 10 * TOL[dtype], "source gradients")
    # the fused output norm's backward has n^3 = 1 / rms(h)^3, which underflows float32 from
    # |h| ~ 1e13 while h^2 is still finite (past ~1e19 the forward's statistic overflows, as a
    # plain float32 RMSNorm's does)
    srcs = [(s.detach().double() * (1e15 / magnitude)).to(dtype).requires_grad_() for s in srcs]
    ref_srcs = upcast(srcs)
    wn = torch.linspace(0.5, 1.5, 16, device=device)
    y, _ = depth_attention(srcs, q, g, kernel=kernel, output_norm_weight=wn)
    ref_h, _ = ref_depth_attention(ref_srcs, q.double().cpu(), g.double().cpu())
    ref_y = ref_h * torch.rsqrt(ref_h.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * wn.double().cpu()
    got = grads_of([y], [cot], srcs)
    want = grads_of([ref_y], [cot], ref_srcs)
    assert rel_err(y.cpu(), ref_y) < 10 * TOL[dtype]
    assert_close(rel_err, got, want, 10 * TOL[dtype], "source gradients with the output norm")


# Gaps below each token's largest logit (about 134, where a float32 ulp is 1.5e-5), one kind per
# token in turn: near saturation twice (the top weight 6e-6 .. 9e-5 below 1, where a rounded
# log-sum-exp, off by up to 7.6e-6, decides whether recomputed weights sum to 1), then saturated
# (the top weight 1 to float64 precision, the others underflow to 0 in float32).
SATURATION_GAPS = ((10.0, 12.0), (10.0, 12.0), (100.0, 120.0))
# The query and gain gradients of such tokens hinge on the 1e-5 by which the top weight falls short
# of 1, which float32 resolves to about 6e-8 / 1e-5: on these inputs (20 seeds) the naive reference
# errs by up to 1.2e-2, the fused paths by up to 1.4e-2, and by 2.4e-2 .. 1.2 with the weights
# recomputed as exp(z - lse) unnormalised (their source gradients by 5e-5 .. 1e-3).
NEAR_SATURATION_TOL = {torch.float64: 1e-9, torch.float32: 2e-2, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def saturating_inputs(S, B, T, D, dtype, device, seed, top=134.0):
    """Sources, a query and a gain (leaves, as `sources_and_params` makes them) whose logits
    are set: each token's largest is about `top`, the others lie below it by gaps of the kinds
    above. Built from angles: (q * g) . RMSNorm(v) = lam sqrt(D) cos(u, v) for q * g = lam u
    with |u| = 1 (up to eps)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = {"generator": gen, "dtype": torch.float64}
    u = torch.randn(D, **f64)
    u = u / u.norm()
    g = torch.exp(0.3 * torch.randn(D, **f64))  # positive, so q = lam u / g stays finite
    c_top = 0.9
    lam = top / (c_top * D**0.5)
    M = B * T
    kinds = torch.arange(M) % len(SATURATION_GAPS)
    lo, hi = (torch.tensor([SATURATION_GAPS[k][j] for k in kinds], dtype=torch.float64) for j in (0, 1))
    z = torch.full((S, M), top, dtype=torch.float64)
    z[1:] -= lo + (hi - lo) * torch.rand(S - 1, M, **f64)
    z = torch.gather(z, 0, torch.argsort(torch.rand(S, M, generator=gen), dim=0))  # the top at any depth
    cos = c_top * z / top
    p = torch.randn(S, M, D, **f64)  # unit directions orthogonal to u
    p = p - (p @ u).unsqueeze(-1) * u
    p = p / p.norm(dim=-1, keepdim=True)
    scale = torch.exp(torch.randn(S, M, 1, **f64)) * D**0.5  # RMS about exp(N(0, 1))
    v = (cos.unsqueeze(-1) * u + (1 - cos.square()).sqrt().unsqueeze(-1) * p) * scale  # (S, M, D)
    leaf = functools.partial(_leaf, dtype=dtype, device=device)
    q_dtype = torch.float32 if dtype != torch.float64 else dtype
    return [leaf(x.view(B, T, D)) for x in v], leaf(lam * u / g, dtype=q_dtype), leaf(g)


def assert_saturation(ref_w):
    """The float64 weights (S, B, T) show the kinds of SATURATION_GAPS, token by token."""
    short = 1 - ref_w.detach().amax(dim=0).flatten()  # how far the top weight falls short of 1
    kinds = len(SATURATION_GAPS)
    assert (short[kinds - 1 :: kinds] == 0).all(), "saturated tokens"
    for k in range(kinds - 1):
        assert ((short[k::kinds] > 1e-6) & (short[k::kinds] < 1e-3)).all(), "near-saturated tokens"


@pytest.mark.parametrize("kernel,device,dtype", IMPLS)
def test_op_saturated_softmax(kernel, device, dtype, rel_err, ref_depth_attention):
    """Logits of ~134, the softmax near saturation or saturated: the forward and the source
    gradients as exact as the dtype allows, the query and gain gradients as float32 resolves
    them. The backward recomputes the weights from the saved logits and log-sum-exp; before it
    renormalised them, the source gradients were 5e-5 .. 9e-5 off (float32, 20 seeds; after,
    and the naive reference: under 2.1e-6), the query and gain gradients 2.4e-2 .. 5e-1."""
    S, B, T, D = 3, 2, 32, 16
    srcs, q, g = saturating_inputs(S, B, T, D, dtype, device, seed=0)
    h, w = depth_attention(srcs, q, g, kernel=kernel)
    inputs = [*srcs, q, g]
    cot = cotangents_for([h, w], seed=1)
    grads = grads_of([h, w], cot, inputs)
    ref_inputs = upcast(inputs)
    ref_h, ref_w = ref_depth_attention(ref_inputs[:S], ref_inputs[S], ref_inputs[S + 1])
    assert_saturation(ref_w)
    ref_grads = grads_of([ref_h, ref_w], cot, ref_inputs)
    tol = TOL[dtype]
    assert_close(rel_err, [h, w], [ref_h, ref_w], tol, "forward")
    assert_close(rel_err, grads[:S], ref_grads[:S], tol, "source grad")
    assert_close(rel_err, grads[S:], ref_grads[S:], NEAR_SATURATION_TOL[dtype], "query and gain grad")


# ------------------------------------------------------------------------------------------------
# the two-phase API: phase 1 (K queries, cached statistics) and phase 2 (merge)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,K,extra,cached,D,lead",
    [
        pytest.param(1, 1, 1, True, 24, (2, 3), id="n1-K1-extra1-cached-D24"),
        pytest.param(3, 3, 1, False, 24, (2, 3), id="n3-K3-extra1-D24"),
        pytest.param(2, 6, 2, True, 24, (2, 3), id="n2-K6-extra2-cached-D24"),  # K > 4: Triton splits the queries
        pytest.param(4, 2, 3, False, 24, (2, 3), id="n4-K2-extra3-D24"),
        pytest.param(5, 3, 2, False, 2100, (2, 3), id="n5-K3-extra2-D2100"),  # wide rows: 2 queries per launch
        pytest.param(2, 2, 1, True, 24, (), id="n2-K2-extra1-cached-D24-one-token"),  # sources (D,)
        pytest.param(2, 3, 2, False, 24, (2, 1, 3, 2), id="n2-K3-extra2-D24-5d"),  # sources (2, 1, 3, 2, D)
    ],
)
@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float64], [torch.float32]))
def test_two_phase_matches_reference(kernel, device, dtype, n, K, extra, cached, D, lead, rel_err, ref_depth_attention):
    """K queries meet n completed sources in one phase-1 pass; query k then merges `extra`
    newer sources: the result is depth attention over all n + extra sources, for sources
    (*lead, D) of any leading shape."""
    eps = 1e-6
    srcs, _, _ = sources_and_params(n + extra, 0, 0, D, dtype, device, seed=7 * n + K, lead=lead)
    gen = torch.Generator().manual_seed(K)
    Q = (torch.randn(K, D, generator=gen, dtype=torch.float64) * 2 / D**0.5).to(device, dtype).requires_grad_()
    G = (1 + 0.5 * torch.randn(K, D, generator=gen, dtype=torch.float64)).to(device, dtype).requires_grad_()
    queries = fold_queries(Q, G, dtype)
    completed, newer = srcs[:n], srcs[n:]
    r_done = torch.stack([key_inv_rms(v, eps, kernel) for v in completed]) if cached else None
    r_new = torch.stack([key_inv_rms(v, eps, kernel) for v in newer]) if cached else None
    accs, lse = completed_attention(completed, r_done, queries, eps, kernel)
    assert len(accs) == K and lse.shape == (K, *lead) and accs[0].shape == (*lead, D)
    hs = [merge_partial(accs[k], lse[k], newer, r_new, queries[k], eps, kernel) for k in range(K)]
    outputs = [*hs, *accs, lse]
    cot = cotangents_for(outputs, seed=n)
    inputs = [*srcs, Q, G]
    grads = grads_of(outputs, cot, inputs)

    ref_inputs = upcast(inputs)
    ref_outputs = ref_two_phase(ref_depth_attention, ref_inputs[: n + extra], n, ref_inputs[-2], ref_inputs[-1], eps)
    ref_grads = grads_of(ref_outputs, cot, ref_inputs)
    tol = TOL[dtype]
    assert_close(rel_err, outputs, ref_outputs, tol, "forward")
    assert_close(rel_err, grads, ref_grads, tol, "grad")


@pytest.mark.parametrize("n,K,extra", [(3, 2, 1), (2, 6, 1), (4, 3, 2)],
                         ids=["n3-K2-extra1", "n2-K6-extra1", "n4-K3-extra2"])
@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float64], [torch.float32]))
def test_merge_completed_extends_phase_one(kernel, device, dtype, n, K, extra, rel_err, ref_depth_attention):
    """Phase 1 over n sources, then `merge_completed` by `extra` sources completed since for
    all K queries (Block AttnRes's phase 1 run a block early), then phase 2 by one more source
    from the merged log-sum-exp: attention over n + extra and over all sources, and the merged
    log-sum-exp, forward and every gradient, against the float64 reference."""
    eps, D, lead = 1e-6, 24, (2, 3)
    srcs, _, _ = sources_and_params(n + extra + 1, 0, 0, D, dtype, device, seed=5 * n + K, lead=lead)
    gen = torch.Generator().manual_seed(K)
    Q = (torch.randn(K, D, generator=gen, dtype=torch.float64) * 2 / D**0.5).to(device, dtype).requires_grad_()
    G = (1 + 0.5 * torch.randn(K, D, generator=gen, dtype=torch.float64)).to(device, dtype).requires_grad_()
    queries = fold_queries(Q, G, dtype)
    early, lse0 = completed_attention(srcs[:n], None, queries, eps, kernel)
    accs, lse = merge_completed(early, lse0, srcs[n : n + extra], None, queries, eps, kernel)
    assert len(accs) == K and lse.shape == (K, *lead)
    hs = [merge_partial(accs[k], lse[k], srcs[-1:], None, queries[k], eps, kernel) for k in range(K)]
    outputs = [*hs, *accs, lse]
    cot = cotangents_for(outputs, seed=n)
    inputs = [*srcs, Q, G]
    grads = grads_of(outputs, cot, inputs)
    ref_inputs = upcast(inputs)
    ref_outputs = ref_two_phase(ref_depth_attention, ref_inputs[: n + extra + 1], n + extra, ref_inputs[-2],
                                ref_inputs[-1], eps)
    ref_grads = grads_of(ref_outputs, cot, ref_inputs)
    assert_close(rel_err, outputs, ref_outputs, TOL[dtype], "forward")
    assert_close(rel_err, grads, ref_grads, TOL[dtype], "grad")


@pytest.mark.parametrize("n,K,extra", [(1, 2, 1), (4, 2, 1), (3, 3, 2), (5, 1, 3)],
                         ids=["n1-K2-merge1", "n4-K2-merge1", "n3-K3-merge2", "n5-K1-merge3"])
def test_two_phase_reads_a_source_stack_as_the_list(n, K, extra, rel_err, ref_depth_attention):
    """The strategies' way in (`SourceStack`: values copied into one buffer, read as one
    (n, ...) tensor by both phases) gives what the list of sources gives, forward and every
    gradient, against the float64 reference; the buffer holds copies, so gradients still
    reach the source tensors, and it is never differentiated itself."""
    from attnres.functional import SourceStack

    eps, D, lead = 1e-6, 16, (2, 3)
    srcs, _, _ = sources_and_params(n + extra, 0, 0, D, torch.float64, "cpu", seed=11 * n + K, lead=lead)
    gen = torch.Generator().manual_seed(K)
    Q = (torch.randn(K, D, generator=gen, dtype=torch.float64) * 2 / D**0.5).requires_grad_()
    G = (1 + 0.5 * torch.randn(K, D, generator=gen, dtype=torch.float64)).requires_grad_()
    queries = fold_queries(Q, G, torch.float64)
    stack = SourceStack(srcs[0], n + extra, eps, "torch")
    for v in srcs[1:]:
        stack.append(v)
    done, r_done, stacked = stack.take(0, n)
    assert stacked is not None and stacked.shape == (n, *lead, D) and not stacked.requires_grad
    assert torch.equal(stacked, torch.stack(srcs[:n]).detach()) and done == srcs[:n]
    accs, lse = completed_attention(done, r_done, queries, eps, "torch", stacked)
    newer, r_new, newer_stacked = stack.take(n, n + extra)
    hs = [merge_partial(accs[k], lse[k], newer, r_new, queries[k], eps, "torch", newer_stacked) for k in range(K)]
    outputs = [*hs, *accs, lse]
    cot = cotangents_for(outputs, seed=n)
    inputs = [*srcs, Q, G]
    grads = grads_of(outputs, cot, inputs)
    ref_inputs = upcast(inputs)
    ref_outputs = ref_two_phase(ref_depth_attention, ref_inputs[: n + extra], n, ref_inputs[-2], ref_inputs[-1], eps)
    ref_grads = grads_of(ref_outputs, cot, ref_inputs)
    assert_close(rel_err, outputs, ref_outputs, TOL[torch.float64], "forward")
    assert_close(rel_err, grads, ref_grads, TOL[torch.float64], "grad")


def ref_two_phase(ref_depth_attention, srcs, n, Q, G, eps):
    """float64 reference of the two-phase outputs: K results over all sources, K over the first
    n, and the (K, B, T) log-sum-exp of the logits over the first n."""
    hs, accs, lses = [], [], []
    for k in range(Q.shape[0]):
        hs.append(ref_depth_attention(srcs, Q[k], G[k], eps)[0])
        accs.append(ref_depth_attention(srcs[:n], Q[k], G[k], eps)[0])
        keys = torch.stack([v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) for v in srcs[:n]])
        lses.append(torch.logsumexp((keys * G[k] * Q[k]).sum(-1), dim=0))
    return [*hs, *accs, torch.stack(lses)]


@pytest.mark.parametrize("K", [1, 2], ids=["K1", "K2"])
@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float64, torch.float32], [torch.float32]))
def test_two_phase_saturated_softmax(kernel, device, dtype, K, rel_err, ref_depth_attention):
    """The saturating inputs of `test_op_saturated_softmax` through phase 1 (2 completed
    sources, K queries: the saturating one and, for K = 2, half of it) and phase 2 (one more
    source merged in, as a strategy's sublayer does; the backward with a prefix renormalises over
    the prefix and the sources). Cotangents on the merged results only, as in a model: a
    cotangent on the log-sum-exp itself would swamp the near-saturated part of the gradients.
    The completed sources' gradients pass through two softmax backwards, the merge's
    log-sum-exp gradient being a difference of nearly equal terms: up to 2.8e-5 off in float32
    (20 seeds), hence 4x the dtype's tolerance; unnormalised, 5e-5 .. 1e-3 and the query and gain
    gradients (K = 1) 5e-2 .. 4.7e-1."""
    eps, n = 1e-6, 2
    srcs, q, g = saturating_inputs(n + 1, 2, 32, 16, dtype, device, seed=2)
    Q = torch.stack([q.detach() * (1 - 0.5 * k) for k in range(K)]).requires_grad_()
    G = torch.stack([g.detach()] * K).requires_grad_()
    queries = fold_queries(Q, G, dtype)
    accs, lse = completed_attention(srcs[:n], None, queries, eps, kernel)
    hs = [merge_partial(accs[k], lse[k], srcs[n:], None, queries[k], eps, kernel) for k in range(K)]
    cot = cotangents_for(hs, seed=3)
    inputs = [*srcs, Q, G]
    grads = grads_of(hs, cot, inputs)
    ref_inputs = upcast(inputs)
    ref_outputs = ref_two_phase(ref_depth_attention, ref_inputs[: n + 1], n, ref_inputs[-2], ref_inputs[-1], eps)
    ref_grads = grads_of(ref_outputs[:K], cot, ref_inputs)
    tol = TOL[dtype]
    assert_close(rel_err, [*hs, *accs, lse], ref_outputs, tol, "forward")
    assert_close(rel_err, grads[: n + 1], ref_grads[: n + 1], 4 * tol, "source grad")
    assert_close(rel_err, grads[n + 1 :], ref_grads[n + 1 :], NEAR_SATURATION_TOL[dtype], "query and gain grad")


# ------------------------------------------------------------------------------------------------
# the strategies: fast path against the reference path (kernel="naive"), forward and gradients
# ------------------------------------------------------------------------------------------------

# (kind, L, N, key_norm_gain, output_aggregation)
STRATEGY_CASES = [
    ("block", 4, 2, True, True),
    ("block", 6, 3, True, True),
    ("block", 6, 1, True, True),  # S = 6 > 4 queries in one phase-1 pass
    ("block", 4, 4, True, True),  # N = L: Full AttnRes
    ("block", 6, 2, False, False),
    ("block", 6, (4, 2), True, True),  # block_sizes: a shorter last block
    ("block", 7, (3, 3, 1), True, True),  # an odd stack
    ("block", 7, (2, 3, 2), True, True),  # the middle block the longest
    ("block", 7, (1, 6), False, False),  # a block of 6 > 4 queries after one of 1
    ("block", 16, 8, True, True),  # the default: blocks 3-4, 5-6, 7-8 share a phase-1 pass (`ahead_blocks`)
    ("block", 15, (3, 3, 3, 3, 3), True, True),  # two shared passes of 6 > 4 queries
    ("full", 3, None, True, True),
    ("full", 9, None, True, True),  # chunks of C = 3 sublayers
    ("full", 5, None, False, False),
]


def strategy_id(kind, L, N, gain, agg):
    blocks = "" if not N else f"-N{N}" if isinstance(N, int) else "-sizes" + "_".join(map(str, N))
    return f"{kind}-L{L}" + blocks + ("" if gain else "-nogain") + ("" if agg else "-noagg")


def make_strategy(kind, L, N, gain, agg, kernel, d):
    """N: the number of equal blocks, or a tuple of block sizes."""
    if kind == "full":
        s = FullAttentionResidual(d, L, key_norm_gain=gain, output_aggregation=agg, kernel=kernel)
    else:
        blocks = {"num_blocks": N} if isinstance(N, int) else {"block_sizes": N}
        s = BlockAttentionResidual(d, L, **blocks, key_norm_gain=gain, output_aggregation=agg, kernel=kernel)
    gen = torch.Generator().manual_seed(L)
    with torch.no_grad():  # random nonzero queries and gains: weights far from uniform
        s.pseudo_query.copy_(torch.randn(s.pseudo_query.shape, generator=gen) * 2 / d**0.5)
        if s.key_norm_weight is not None:
            s.key_norm_weight.copy_(1 + 0.5 * torch.randn(s.key_norm_weight.shape, generator=gen))
    return s


def make_sublayers(L, d, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(
        nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh()) if i % 2 == 0 else nn.Linear(d, d)
        for i in range(L)
    )


@pytest.mark.parametrize(
    "kind,L,N,gain,agg", [pytest.param(*c, id=strategy_id(*c)) for c in STRATEGY_CASES]
)
@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float64, torch.float32], [torch.float32]))
def test_strategy_fast_path_matches_reference_path(kernel, device, dtype, kind, L, N, gain, agg, rel_err):
    d = 16
    fast = make_strategy(kind, L, N, gain, agg, kernel, d).to(device, dtype)
    ref = make_strategy(kind, L, N, gain, agg, "naive", d).to(device, dtype)
    sublayers = make_sublayers(L, d).to(device, dtype)
    e = torch.randn(2, 5, d, dtype=torch.float64).to(device, dtype).requires_grad_()
    params = [p for p in fast.parameters()]
    ref_params = [p for p in ref.parameters()]
    cot = torch.randn(2, 5, d, dtype=torch.float64).to(device, dtype)

    out = fast(e, sublayers)
    grads = torch.autograd.grad(out, [e, *params, *sublayers.parameters()], cot)
    ref_out = ref(e, sublayers)
    ref_grads = torch.autograd.grad(ref_out, [e, *ref_params, *sublayers.parameters()], cot)
    tol = TOL[dtype] * (1 if dtype == torch.float64 else 10)  # float32: L chained ops
    assert rel_err(out, ref_out) < tol
    assert_close(rel_err, grads, [g.to(torch.float64) for g in ref_grads], tol, "grad")


@pytest.mark.parametrize("kind", ["block", "full"])
@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float64], [torch.float32]))
def test_recording_pass_records_exact_weights(kernel, device, dtype, kind, rel_err, ref_depth_attention):
    """Recording passes run one attention per sublayer: the recorded weights are the reference's,
    and the output equals that of the fast (non-recording) pass."""
    L, N, d = 4, 2, 8
    s = make_strategy(kind, L, N if kind == "block" else None, True, True, kernel, d).to(device, dtype)
    ref = make_strategy(kind, L, N if kind == "block" else None, True, True, "naive", d).to(device, dtype)
    sublayers = make_sublayers(L, d).to(device, dtype)
    e = torch.randn(1, 3, d, dtype=torch.float64).to(device, dtype)
    fast_out = s(e, sublayers)
    s.record_next()
    ref.record_next()
    rec_out = s(e, sublayers)
    ref_out = ref(e, sublayers)
    tol = TOL[dtype]
    assert rel_err(rec_out, fast_out) < tol * 10 and rel_err(rec_out, ref_out) < tol
    assert sorted(s.recorded.weights) == list(range(L + 1))
    for index, w in ref.recorded.weights.items():
        assert rel_err(s.recorded.weights[index], w) < tol


# ------------------------------------------------------------------------------------------------
# dispatch, packaging, torch.compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float32], [torch.float32]))
def test_compiles_without_graph_breaks(kernel, device, dtype, rel_err):
    """fullgraph=True fails on any graph break; aot_eager traces forward and backward quickly.
    (kernel="cpu" under torch.compile wants the kernel built beforehand: nothing builds while
    Dynamo traces.)"""
    if kernel == "cpu":
        assert cpu_fused.available()
    L, d = 4, 8
    s = make_strategy("block", L, 2, True, True, kernel, d).to(device, dtype)
    sublayers = make_sublayers(L, d).to(device, dtype)
    e = torch.randn(1, 3, d, device=device, dtype=dtype, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: s(x, sublayers), backend="aot_eager", fullgraph=True)
    out = compiled(e)
    (g,) = torch.autograd.grad(out.sum(), [e])
    ref_out = s(e, sublayers)
    (ref_g,) = torch.autograd.grad(ref_out.sum(), [e])
    assert rel_err(out, ref_out) < 1e-5 and rel_err(g, ref_g) < 1e-5
    with torch.no_grad():  # inference (prefill) traces another graph
        assert rel_err(compiled(e), ref_out) < 1e-5


@pytest.mark.parametrize("kernel,device,dtype", impl_params([torch.float32], [torch.float32]))
def test_output_norm_compiles_without_graph_breaks(kernel, device, dtype, rel_err):
    """The op with its fused output norm under torch.compile (the Triton op's fake implementations
    describe the extra outputs), forward and backward, with and without grad."""
    if kernel == "cpu":
        assert cpu_fused.available()
    srcs, q, g = sources_and_params(3, 1, 3, 8, dtype, device, seed=2)
    w = _leaf(torch.linspace(0.5, 1.5, 8, dtype=torch.float64), dtype, device)

    def op(*xs):
        return depth_attention(list(xs[:3]), xs[3], xs[4], kernel=kernel, output_norm_weight=xs[5])[0]

    torch._dynamo.reset()
    compiled = torch.compile(op, backend="aot_eager", fullgraph=True)
    inputs = [*srcs, q, g, w]
    out, ref_out = compiled(*inputs), op(*inputs)
    grads = torch.autograd.grad(out.sum(), inputs)
    ref_grads = torch.autograd.grad(ref_out.sum(), inputs)
    assert rel_err(out, ref_out) < 1e-6
    assert_close(rel_err, grads, [r.double() for r in ref_grads], 1e-6, "grad")
    with torch.no_grad():
        assert rel_err(compiled(*inputs), ref_out) < 1e-6


# ------------------------------------------------------------------------------------------------
# GPU: realistic shapes, Inductor
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize(
    "S,BT,D",
    [pytest.param(9, 4096, 768, id="S9-BT4096-D768"), pytest.param(3, 1000, 1000, id="S3-BT1000-D1000"),
     pytest.param(25, 2048, 97, id="S25-BT2048-D97")],
)
@pytest.mark.gpu
@needs_gpu
def test_triton_gpu_shapes(S, BT, D, dtype, rel_err, rounded_once):
    srcs, q, g = sources_and_params(S, 1, BT, D, dtype, "cuda", seed=S)
    h, w = depth_attention(srcs, q, g, kernel="triton")
    ref_h, ref_w = naive_depth_attention([s.float() for s in srcs], q, g.float())
    cot = torch.randn_like(ref_h)
    grads = torch.autograd.grad((h.float() * cot).sum(), [*srcs, q, g])
    ref_grads = torch.autograd.grad((ref_h * cot).sum(), [*srcs, q, g])
    tol = TOL[dtype]
    assert rel_err(h, ref_h) < tol
    rounded_once(w, ref_w, dtype)
    assert_close(rel_err, grads, ref_grads, tol, "grad")


@pytest.mark.parametrize("kind", ["block", "full"])
@pytest.mark.gpu
@needs_gpu
def test_triton_gpu_strategy_under_inductor(kind, rel_err):
    L, d = 8, 96
    s = make_strategy(kind, L, 4 if kind == "block" else None, True, True, "triton", d).cuda()
    ref = make_strategy(kind, L, 4 if kind == "block" else None, True, True, "naive", d).cuda()
    sublayers = make_sublayers(L, d).cuda()
    e = torch.randn(2, 64, d, device="cuda", requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(lambda x: s(x, sublayers), fullgraph=True)(e)
    (g,) = torch.autograd.grad(out.sum(), [e])
    ref_out = ref(e, sublayers)
    (ref_g,) = torch.autograd.grad(ref_out.sum(), [e])
    assert rel_err(out, ref_out) < 1e-4 and rel_err(g, ref_g) < 1e-4


@pytest.mark.slow
@needs_cpu_kernel
@pytest.mark.parametrize("kind", ["block", "full"])
def test_cpu_kernel_under_inductor(kind, rel_err):
    """kernel="auto" on CPU under torch.compile: once the C++ kernel is built (the runner builds
    it before a compiled run's first step) the graph calls it as opaque ops, and Inductor's
    forward and gradients match the float64 reference."""
    assert cpu_fused.available()
    L, d = 8, 32
    s = make_strategy(kind, L, 4 if kind == "block" else None, True, True, "auto", d)
    ref = make_strategy(kind, L, 4 if kind == "block" else None, True, True, "naive", d).double()
    ref.load_state_dict(s.state_dict())
    sublayers = make_sublayers(L, d)
    ref_sublayers = make_sublayers(L, d).double()
    ref_sublayers.load_state_dict(sublayers.state_dict())
    code: list[str] = []

    def recording(gm, inputs):  # the traced graph, its autograd subgraphs included
        code.extend(m.code for _, m in gm.named_modules() if hasattr(m, "code"))
        return gm.forward

    e = torch.randn(2, 16, d, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(lambda x: s(x, sublayers), backend=recording, fullgraph=True)(e)
    assert any("attnres_cpu.forward" in c for c in code)
    torch._dynamo.reset()
    out = torch.compile(lambda x: s(x, sublayers), fullgraph=True)(e)
    (g,) = torch.autograd.grad(out.sum(), [e])
    e64 = e.detach().double().requires_grad_()
    ref_out = ref(e64, ref_sublayers)
    (ref_g,) = torch.autograd.grad(ref_out.sum(), [e64])
    assert rel_err(out, ref_out) < 1e-5 and rel_err(g, ref_g) < 1e-5
