"""The public ops `full_attn_res` and `block_attn_res` against the float64 reference of
DESIGN.md section 2 (tests/conftest.py), their contract, and gradcheck."""

# Arguments use DESIGN.md's shape names (S sources, B, T, D), as pyproject's N806 exception does.
# ruff: noqa: N803

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from attnres.functional import block_attn_res, depth_attention, full_attn_res
from attnres.ops.dispatch import triton_available

pytestmark = pytest.mark.usefixtures("torch_single_thread")

DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# relative error (norm of the difference over norm of the reference) allowed per input dtype
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# (S sources, B, T, D, contiguous)
CASES = [
    (1, 2, 3, 8, True),  # zero previous layers / one source
    (2, 1, 4, 16, True),  # B = 1
    (3, 2, 5, 16, False),  # transposed views
    (4, 3, 1, 8, True),  # T = 1
    (5, 1, 1, 4, False),  # B = T = 1
    (9, 2, 7, 24, False),
]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
# every implementation behind the public ops; Triton on CPU runs in its interpreter (tests/conftest.py)
KERNEL_PARAMS = [
    "naive",
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
            reason="needs triton (CUDA, or its CPU interpreter with TRITON_INTERPRET=1)",
        ),
    ),
]


def _as_param(value, id_fn=str):
    return value if isinstance(value, type(pytest.param(None))) else pytest.param(value, id=id_fn(value))


def grid_params(axes, skip):
    """The cartesian product of `axes` (lists of values or pytest.param, the innermost first), as one
    parametrize: ids joined innermost first, as stacked decorators name them, marks merged, and the
    combinations for which skip(*values) is true left out."""
    import itertools

    params = []
    for combo in itertools.product(*[[_as_param(v) for v in axis] for axis in axes]):
        values = tuple(v for p in combo for v in p.values)
        if skip(*values):
            continue
        ids = (p.id if p.id is not None else "-".join(map(str, p.values)) for p in combo)
        params.append(pytest.param(*values, id="-".join(ids), marks=[m for p in combo for m in p.marks]))
    return params


def triton_full_list(*values) -> bool:
    """Triton's "full-list" on contiguous sources: `full_attn_res` unbinds a stacked tensor into a list of
    views and makes the same `depth_attention` call, so on contiguous sources "full-tensor" hands the
    kernel the same inputs; Triton runs it there only (the CPU paths keep every case, and a permuted
    layout, where the stack is a contiguous copy of strided sources, keeps both)."""
    return "triton" in values and "full-list" in values and "permuted" not in values


def case_id(S, B, T, D, contiguous, dtype) -> str:
    return f"S{S}-B{B}-T{T}-D{D}-{DTYPE_NAMES[dtype]}" + ("" if contiguous else "-noncontig")


def grid(extra: list[str]):
    return [
        pytest.param(*case, dtype, x, id=f"{case_id(*case, dtype)}-{x}")
        for case in CASES
        for dtype in DTYPES
        for x in extra
    ]


def make_leaf(shape, dtype, contiguous, gen, scale=1.0):
    """A leaf tensor and a function that turns it (or a float64 copy of it) into the (..., T, D)
    input: the leaf itself, or a non-contiguous view of a (..., 2 D, T) leaf (transposed, then
    every other feature, so it stays non-contiguous even when T = 1)."""
    if contiguous:
        leaf = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return leaf.to(dtype).requires_grad_(), lambda x: x
    *lead, T, D = shape
    leaf = torch.randn(*lead, 2 * D, T, generator=gen, dtype=torch.float64) * scale
    return leaf.to(dtype).requires_grad_(), lambda x: x.transpose(-1, -2)[..., ::2]


def upcast_leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64).requires_grad_()


def random_query(D, dtype, gen):
    """Nonzero random query, scaled so that logits are O(1): the weights are far from uniform."""
    q = torch.randn(D, generator=gen, dtype=torch.float64) * 2.0 / D**0.5
    return q.to(dtype).requires_grad_()


def random_gain(D, dtype, gen):
    return (1.0 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()


def source_scales(S, gen):
    """Different magnitudes per source, so the raw-value sum is not the normalised one."""
    return torch.exp(torch.randn(S, generator=gen, dtype=torch.float64)).tolist()


def backward_with(h, w, gen):
    """Backpropagate fixed random cotangents of h and of the weights; returns them (float64)."""
    ch = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    cw = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    ((h * ch.to(h.dtype)).sum() + (w * cw.to(w.dtype)).sum()).backward()
    return ch, cw


def reference_backward(h, w, ch, cw):
    ((h * ch).sum() + (w * cw).sum()).backward()


# ------------------------------------------------------------------------------------------------
# against the reference: forward and every gradient
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S,B,T,D,contiguous,dtype,form", grid(["tensor", "list"]))
def test_full_attn_res_matches_reference(S, B, T, D, contiguous, dtype, form, rel_err, ref_depth_attention):
    gen = torch.Generator().manual_seed(S * 1000 + B * 100 + T * 10 + D)
    scales = source_scales(S, gen)
    emb_leaf, view = make_leaf((B, T, D), dtype, contiguous, gen, scales[0])
    if form == "tensor":
        prev_leaves = [make_leaf((S - 1, B, T, D), dtype, contiguous, gen)[0]]
        with torch.no_grad():
            prev_leaves[0].mul_(torch.tensor(scales[1:], dtype=torch.float64).to(dtype).view(-1, 1, 1, 1))

        def previous(leaves):
            return view(leaves[0])

        def prev_list(leaves):
            return list(view(leaves[0]).unbind(0))
    else:
        prev_leaves = [make_leaf((B, T, D), dtype, contiguous, gen, s)[0] for s in scales[1:]]

        def previous(leaves):
            return [view(x) for x in leaves]

        prev_list = previous
    q = random_query(D, dtype, gen)

    emb, prev = view(emb_leaf), previous(prev_leaves)
    if not contiguous:
        assert not emb.is_contiguous()
    out = full_attn_res(emb, prev, q)
    h, w = out["retrieved_representation"], out["attention_weights"]
    assert h.shape == (B, T, D) and w.shape == (S, B, T)
    ch, cw = backward_with(h, w, gen)

    ref_emb, ref_prev, ref_q = upcast_leaf(emb_leaf), [upcast_leaf(x) for x in prev_leaves], upcast_leaf(q)
    ref_h, ref_w = ref_depth_attention([view(ref_emb), *prev_list(ref_prev)], ref_q, None, 1e-6)
    reference_backward(ref_h, ref_w, ch, cw)

    tol = TOL[dtype]
    assert rel_err(h, ref_h) < tol
    assert rel_err(w, ref_w) < tol
    assert rel_err(emb_leaf.grad, ref_emb.grad) < tol
    for leaf, ref_leaf in zip(prev_leaves, ref_prev, strict=True):
        if leaf.numel():  # an empty (0, B, T, D) stack has no gradient
            assert rel_err(leaf.grad, ref_leaf.grad) < tol
    assert rel_err(q.grad, ref_q.grad) < tol


@pytest.mark.parametrize("S,B,T,D,contiguous,dtype,variant", grid(["partial-gain", "nopartial-gain", "partial-nogain"]))
def test_block_attn_res_matches_reference(S, B, T, D, contiguous, dtype, variant, rel_err, ref_depth_attention):
    gen = torch.Generator().manual_seed(S * 1000 + B * 100 + T * 10 + D + 7)
    with_partial, with_gain = variant.startswith("partial"), variant.endswith("-gain")
    scales = source_scales(S, gen)
    leaves, views = [], []
    for s in scales:
        leaf, view = make_leaf((B, T, D), dtype, contiguous, gen, s)
        leaves.append(leaf)
        views.append(view)
    q = random_query(D, dtype, gen)
    g = random_gain(D, dtype, gen) if with_gain else None

    def split(xs):
        srcs = [view(x) for view, x in zip(views, xs, strict=True)]
        return (srcs[:-1], srcs[-1]) if with_partial else (srcs, None)

    blocks, partial = split(leaves)
    h, w = block_attn_res(blocks, partial, q, norm_weight=g, return_weights=True)
    assert h.shape == (B, T, D) and w.shape == (S, B, T)
    ch, cw = backward_with(h, w, gen)

    ref_leaves, ref_q = [upcast_leaf(x) for x in leaves], upcast_leaf(q)
    ref_g = None if g is None else upcast_leaf(g)
    ref_blocks, ref_partial = split(ref_leaves)
    ref_h, ref_w = ref_depth_attention(ref_blocks + ([] if ref_partial is None else [ref_partial]), ref_q, ref_g)
    reference_backward(ref_h, ref_w, ch, cw)

    tol = TOL[dtype]
    assert rel_err(h, ref_h) < tol
    assert rel_err(w, ref_w) < tol
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert rel_err(leaf.grad, ref_leaf.grad) < tol
    assert rel_err(q.grad, ref_q.grad) < tol
    if g is not None:
        assert rel_err(g.grad, ref_g.grad) < tol


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 0.5], ids=lambda e: f"eps{e:g}")
def test_eps_is_added_to_the_mean_square(eps, rel_err, ref_depth_attention):
    """Small sources, where where eps sits (inside the square root, added to mean(v^2)) matters."""
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randn(2, 3, 8, generator=gen, dtype=torch.float64) * s for s in (0.05, 0.3, 0.01)]
    q, g = random_query(8, torch.float64, gen).detach(), random_gain(8, torch.float64, gen).detach()
    ref_full, ref_full_w = ref_depth_attention(srcs, q, None, eps)
    out = full_attn_res(srcs[0], srcs[1:], q, eps=eps)
    assert rel_err(out["retrieved_representation"], ref_full) < 1e-12
    assert rel_err(out["attention_weights"], ref_full_w) < 1e-12
    ref_block, _ = ref_depth_attention(srcs, q, g, eps)
    assert rel_err(block_attn_res(srcs[:2], srcs[2], q, norm_weight=g, eps=eps), ref_block) < 1e-12


@pytest.mark.parametrize(
    "dtype,magnitude",
    [
        pytest.param(torch.float16, 1e4, id="f16-1e4"),
        pytest.param(torch.bfloat16, 1e30, id="bf16-1e30"),
        pytest.param(torch.bfloat16, 1e-30, id="bf16-1e-30"),
        pytest.param(torch.float32, 1e25, id="f32-1e25"),
    ],
)
def test_large_and_small_magnitudes_stay_finite_and_exact(dtype, magnitude, rel_err, ref_depth_attention, rounded_once):
    """Squares of such values overflow (or underflow) a naive float32 (or half) mean of squares."""
    gen = torch.Generator().manual_seed(11)
    limit = torch.finfo(dtype).max / 2
    srcs = [
        (torch.randn(2, 4, 16, generator=gen, dtype=torch.float64) * magnitude * s).clamp(-limit, limit).to(dtype)
        for s in (1.0, 3.0, 0.5, 2.0)
    ]
    q = random_query(16, torch.float32, gen).detach()
    g = random_gain(16, torch.float32, gen).detach()

    h, w = block_attn_res(srcs[:3], srcs[3], q, norm_weight=g, return_weights=True)
    ref_h, ref_w = ref_depth_attention(srcs, q, g)
    assert h.dtype == dtype and torch.isfinite(h).all()
    rounded_once(w, ref_w, dtype)  # logits, max and softmax are float32, the weights rounded once
    assert rel_err(h, ref_h) < TOL[dtype]

    out = full_attn_res(srcs[0], torch.stack(srcs[1:]), q)
    ref_h, ref_w = ref_depth_attention(srcs, q)
    assert torch.isfinite(out["retrieved_representation"]).all()
    rounded_once(out["attention_weights"], ref_w, dtype)
    assert rel_err(out["retrieved_representation"], ref_h) < TOL[dtype]


# ------------------------------------------------------------------------------------------------
# any leading shape (..., D)
# ------------------------------------------------------------------------------------------------

# (leading shape, D, layout): one token, a sequence, (B, T), 4-D and 5-D, an empty batch; the
# permuted layout makes the leading dimensions non-contiguous (and D strided)
LEADING_SHAPES = [
    pytest.param((), 8, "contiguous", id="D8"),
    pytest.param((5,), 8, "contiguous", id="T5-D8"),
    pytest.param((2, 3), 16, "contiguous", id="B2-T3-D16"),
    pytest.param((2, 3, 4), 8, "contiguous", id="B2-H3-T4-D8"),
    pytest.param((2, 3, 4), 8, "permuted", id="B2-H3-T4-D8-permuted"),
    pytest.param((2, 1, 3, 2), 12, "contiguous", id="5d-D12"),
    pytest.param((0, 3), 8, "contiguous", id="B0-T3-D8"),
]


def leading_shape_leaf(lead, D, layout, gen, scale):
    """A float32 leaf and the (*lead, D) input made from it: the leaf itself, or (permuted) a
    view of a (*reversed(lead), 2 D) leaf with its leading dimensions reversed and every other
    feature."""
    if layout == "contiguous":
        leaf = (torch.randn(*lead, D, generator=gen, dtype=torch.float64) * scale).float().requires_grad_()
        return leaf, lambda x: x
    leaf = (torch.randn(*lead[::-1], 2 * D, generator=gen, dtype=torch.float64) * scale).float().requires_grad_()
    order = [*range(len(lead) - 1, -1, -1), len(lead)]
    return leaf, lambda x: x.permute(order)[..., ::2]


@pytest.mark.parametrize("lead,D,layout,op,kernel",
                         grid_params([LEADING_SHAPES, ["full-tensor", "full-list", "block"], KERNEL_PARAMS],
                                     triton_full_list))
def test_any_leading_shape(lead, D, layout, op, kernel, rel_err, ref_depth_attention):
    """Sources (..., D) of any leading shape: forward and every gradient against the float64
    reference, and the same numbers as the op on the sources flattened to (1, M, D)."""
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    S = 4
    gen = torch.Generator().manual_seed(len(lead) * 100 + D)
    made = [leading_shape_leaf(lead, D, layout, gen, s) for s in source_scales(S, gen)]
    leaves, views = [leaf for leaf, _ in made], [view for _, view in made]
    q = random_query(D, torch.float32, gen)
    g = random_gain(D, torch.float32, gen) if op == "block" else None
    params = [q] + ([] if g is None else [g])

    def run(srcs, q, g):
        if op == "block":
            return block_attn_res(srcs[:-1], srcs[-1], q, norm_weight=g, return_weights=True, kernel=kernel)
        previous = torch.stack(srcs[1:]) if op == "full-tensor" else srcs[1:]
        out = full_attn_res(srcs[0], previous, q, kernel=kernel)
        return out["retrieved_representation"], out["attention_weights"]

    def inputs(xs, ps):  # the (..., D) sources on the device, and the parameters
        srcs = [view(x.to(device)) for view, x in zip(views, xs, strict=True)]
        return srcs, ps[0].to(device), None if g is None else ps[1].to(device)

    srcs, q_in, g_in = inputs(leaves, params)
    assert srcs[0].shape == (*lead, D) and (layout == "contiguous" or not srcs[0].is_contiguous())
    h, w = run(srcs, q_in, g_in)
    assert h.shape == (*lead, D) and w.shape == (S, *lead)
    cot_h = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    cot_w = torch.randn(w.shape, generator=gen, dtype=torch.float64)

    def grads(h, w, wrt):
        total = (h.double().cpu() * cot_h).sum() + (w.double().cpu() * cot_w).sum()
        return torch.autograd.grad(total, wrt)

    got = grads(h, w, [*leaves, *params])
    ref_leaves, ref_params = [upcast_leaf(x) for x in leaves], [upcast_leaf(p) for p in params]
    ref_srcs = [view(x) for view, x in zip(views, ref_leaves, strict=True)]
    ref_h, ref_w = ref_depth_attention(ref_srcs, ref_params[0], None if g is None else ref_params[1])
    want = grads(ref_h, ref_w, [*ref_leaves, *ref_params])
    tol = TOL[torch.float32]
    assert rel_err(h.cpu(), ref_h) < tol and rel_err(w.cpu(), ref_w) < tol
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a, b) < tol, f"grad {i}"

    # the same as on the sources flattened to (1, M, D), the shape the ops took before, to a few
    # float32 roundings (torch's softmax takes another code path for another layout)
    flat = [x.reshape(1, -1, D) for x in srcs]
    flat_h, flat_w = run(flat, q_in, g_in)
    flat_h, flat_w = flat_h.view(h.shape), flat_w.view(w.shape)
    assert rel_err(h.cpu(), flat_h.cpu()) < 1e-6 and rel_err(w.cpu(), flat_w.cpu()) < 1e-6
    for i, (a, b) in enumerate(zip(got, grads(flat_h, flat_w, [*leaves, *params]), strict=True)):
        assert rel_err(a, b) < 1e-6, f"grad {i}"


# ------------------------------------------------------------------------------------------------
# the fused output RMSNorm (output_norm_weight=)
# ------------------------------------------------------------------------------------------------


def ref_output_norm(h, weight, eps=1e-6):
    """float64 RMSNorm of the op's result, written from its definition."""
    h = h.to(torch.float64)
    return h / torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(torch.float64)


def onorm_params():
    """(kernel, dtype): every implementation, float64 where it takes it, Triton interpreted on CPU."""
    params = []
    for kernel in KERNEL_PARAMS:
        name = kernel if isinstance(kernel, str) else kernel.values[0]
        marks = () if isinstance(kernel, str) else kernel.marks
        for dtype in ([torch.float32, torch.bfloat16] if name == "triton" else DTYPES):
            params.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{DTYPE_NAMES[dtype]}"))
    return params


ONORM_SHAPES = [pytest.param(1, (2, 3), 8, id="S1-B2-T3-D8"), pytest.param(4, (2, 3), 24, id="S4-B2-T3-D24"),
                pytest.param(3, (5,), 97, id="S3-T5-D97")]


@pytest.mark.parametrize("kernel,dtype,S,lead,D,op",
                         grid_params([onorm_params(), ONORM_SHAPES, ["depth_attention", "block", "full-tensor",
                                                                    "full-list"]], triton_full_list))
def test_output_norm_is_the_op_then_rms_norm(kernel, dtype, S, lead, D, op, rel_err, ref_depth_attention):
    """RMSNorm(h) * weight in place of h: forward and every gradient (sources, query, key gain,
    the norm's weight) against the float64 op followed by a float64 RMSNorm, on every kernel."""
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(S * 10 + D)
    srcs = [(torch.randn(*lead, D, generator=gen, dtype=torch.float64) * s) for s in source_scales(S, gen)]
    srcs = [x.to(device, dtype).requires_grad_() for x in srcs]
    q = random_query(D, dtype, gen).detach().to(device).requires_grad_()
    g = random_gain(D, dtype, gen).detach().to(device).requires_grad_() if op in ("depth_attention", "block") else None
    w = random_gain(D, dtype, gen).detach().to(device).requires_grad_()
    eps = 1e-6 if op != "block" else 1e-3  # the op's eps is the norm's
    if op == "depth_attention":
        y, weights = depth_attention(srcs, q, g, eps, kernel, output_norm_weight=w)
    elif op == "block":
        y, weights = block_attn_res(srcs[:-1] or srcs, srcs[-1] if S > 1 else None, q, norm_weight=g, eps=eps,
                                    return_weights=True, kernel=kernel, output_norm_weight=w)
    else:
        previous = torch.stack(srcs[1:]) if op == "full-tensor" and S > 1 else srcs[1:]
        out = full_attn_res(srcs[0], previous, q, eps=eps, kernel=kernel, output_norm_weight=w)
        y, weights = out["retrieved_representation"], out["attention_weights"]
    assert y.dtype == dtype and y.shape == (*lead, D) and weights.shape == (S, *lead)
    leaves = [*srcs, q, w] + ([] if g is None else [g])
    cot_y = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    cot_w = torch.randn(weights.shape, generator=gen, dtype=torch.float64)

    def grads(y, weights, wrt):
        total = (y.double().cpu() * cot_y).sum() + (weights.double().cpu() * cot_w).sum()
        return torch.autograd.grad(total, wrt)

    got = grads(y, weights, leaves)
    ref_leaves = [upcast_leaf(x.cpu()) for x in leaves]
    ref_srcs, ref_q, ref_w = ref_leaves[:S], ref_leaves[S], ref_leaves[S + 1]
    ref_g = None if g is None else ref_leaves[S + 2]
    ref_h, ref_weights = ref_depth_attention(ref_srcs, ref_q, ref_g, eps)
    ref_y = ref_output_norm(ref_h, ref_w, eps)
    want = grads(ref_y, ref_weights, ref_leaves)
    tol = TOL[dtype]
    assert rel_err(y.cpu(), ref_y) < tol and rel_err(weights.cpu(), ref_weights) < tol
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a.cpu(), b) < tol, f"grad {i}"
    assert rel_err(got[S + 1].cpu(), want[S + 1]) < tol and want[S + 1].abs().max() > 0, "the weight's gradient"

    # the same numbers as torch's rms_norm on the op's result in the statistics dtype, rounded once
    # (the op norms h before rounding it: half an ulp of the dtype apart at most, plus float32's error)
    with torch.no_grad():
        h, plain_weights = depth_attention(srcs, q, g, eps, kernel)  # every op is this one
        stat = torch.float64 if dtype == torch.float64 else torch.float32
        torch_y = F.rms_norm(h.to(stat), (D,), w.to(stat), eps).to(dtype)
        no_grad_y, _ = depth_attention(srcs, q, g, eps, kernel, output_norm_weight=w)
    same = 1e-12 if dtype == torch.float64 else 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert rel_err(plain_weights.cpu(), weights.cpu()) < same, "the weights are the op's"
    assert rel_err(no_grad_y.cpu(), y.cpu()) < same, "with and without autograd alike"
    assert rel_err(y.cpu(), torch_y.cpu()) < same


@pytest.mark.parametrize("kernel", ["naive", "torch"])
def test_gradcheck_output_norm(kernel):
    gen = torch.Generator().manual_seed(4)
    srcs = [torch.randn(2, 2, 4, generator=gen, dtype=torch.float64) * s for s in (1.0, 2.0, 0.5)]
    q, g, w = (torch.randn(4, generator=gen, dtype=torch.float64) for _ in range(3))
    inputs = tuple(x.requires_grad_() for x in (*srcs, q, g, w))

    def fn(a, b, c, q, g, w):
        return depth_attention([a, b, c], q, g, 1e-3, kernel, output_norm_weight=w)

    assert torch.autograd.gradcheck(fn, inputs)


# ------------------------------------------------------------------------------------------------
# contract
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("op", ["full-tensor", "full-list", "block"])
def test_dtype_device_no_mutation_and_weights_sum_to_one(op, dtype):
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(2, 3, 8, generator=gen).to(dtype)
    prev = (torch.randn(3, 2, 8, 3, generator=gen) * 4).to(dtype).transpose(-1, -2)  # non-contiguous
    q, g = torch.randn(8, generator=gen).to(dtype), torch.randn(8, generator=gen).to(dtype)
    inputs = [emb, prev, q, g]
    clones = [x.clone() for x in inputs]
    if op == "block":
        blocks = [emb, *prev.unbind(0)[:2]]
        h, w = block_attn_res(blocks, prev[2], q, norm_weight=g, return_weights=True)
    else:
        out = full_attn_res(emb, prev if op == "full-tensor" else list(prev.unbind(0)), q)
        h, w = out["retrieved_representation"], out["attention_weights"]
    for x, c in zip(inputs, clones, strict=True):
        assert torch.equal(x, c), "an input was modified"
    assert h.dtype == dtype and h.device == emb.device and h.shape == (2, 3, 8)
    assert w.shape == (4, 2, 3) and w.device == emb.device
    assert w.dtype == dtype, "the weights keep the input dtype too"
    assert not torch.allclose(w, torch.full_like(w, 0.25), atol=1e-3), "random queries give non-uniform weights"
    # each weight rounded once to the dtype: the sum is 1 to half an ulp of it, plus float32's error
    atol = torch.finfo(dtype).eps / 2 + 1e-6
    assert torch.allclose(w.double().sum(0), torch.ones(2, 3, dtype=torch.float64), atol=atol, rtol=0)
    assert (w >= 0).all()


@pytest.mark.parametrize("op,dtype,kernel", grid_params(
    [["full-tensor", "full-list", "block", "depth_attention"],
     [pytest.param(dt, id=DTYPE_NAMES[dt]) for dt in (torch.bfloat16, torch.float16, torch.float32)], KERNEL_PARAMS],
    triton_full_list))
def test_both_results_keep_the_input_dtype(op, dtype, kernel, rounded_once, ref_depth_attention):
    """The representation and the weights come back in the input dtype on every kernel, the
    weights being float32 statistics rounded once; gradients reach the inputs in their dtypes."""
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(9)
    srcs = [(torch.randn(2, 3, 8, generator=gen) * s).to(device, dtype).requires_grad_() for s in (1.0, 3.0, 0.5)]
    q = random_query(8, torch.float32, gen).detach().to(device).requires_grad_()
    g = random_gain(8, dtype, gen).detach().to(device).requires_grad_()
    if op == "block":
        h, w = block_attn_res(srcs[:2], srcs[2], q, norm_weight=g, return_weights=True, kernel=kernel)
    elif op == "depth_attention":
        h, w = depth_attention(srcs, q, g, kernel=kernel)
    else:
        previous = torch.stack(srcs[1:]) if op == "full-tensor" else srcs[1:]
        out = full_attn_res(srcs[0], previous, q, kernel=kernel)
        h, w = out["retrieved_representation"], out["attention_weights"]
        g = None
    assert h.dtype == dtype and w.dtype == dtype
    ref_h, ref_w = ref_depth_attention(srcs, q, g)
    rounded_once(w, ref_w, dtype)
    leaves = [*srcs, q] + ([] if g is None else [g])
    weighting = torch.arange(3.0, device=device).view(3, 1, 1)  # a cotangent on the weights that is not constant
    grads = torch.autograd.grad(h.float().sum() + (w.float() * weighting).sum(), leaves)
    assert [x.dtype for x in grads] == [x.dtype for x in leaves]
    assert all(torch.isfinite(x).all() for x in grads)


def test_full_attn_res_accepts_zero_previous_layers_in_both_forms():
    emb = torch.randn(2, 3, 4, dtype=torch.float64)
    q = torch.randn(4, dtype=torch.float64)
    for previous in (torch.empty(0, 2, 3, 4, dtype=torch.float64), []):
        out = full_attn_res(emb, previous, q)
        assert torch.equal(out["retrieved_representation"], emb)
        assert torch.equal(out["attention_weights"], torch.ones(1, 2, 3, dtype=torch.float64))


def test_tensor_and_list_forms_agree_and_return_weights_is_optional():
    gen = torch.Generator().manual_seed(2)
    emb, prev = torch.randn(2, 3, 8, generator=gen), torch.randn(4, 2, 3, 8, generator=gen)
    q, g = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    a, b = full_attn_res(emb, prev, q), full_attn_res(emb, list(prev), q)
    assert torch.equal(a["retrieved_representation"], b["retrieved_representation"])
    assert torch.equal(a["attention_weights"], b["attention_weights"])
    h = block_attn_res([emb, prev[0]], prev[1], q, norm_weight=g)
    assert isinstance(h, torch.Tensor)
    assert torch.equal(h, block_attn_res([emb, prev[0]], prev[1], q, norm_weight=g, return_weights=True)[0])
    # no partial block: the empty partial sum is left out, not attended to as zeros
    h, w = block_attn_res([emb, prev[0]], None, q, return_weights=True)
    assert w.shape == (2, 2, 3)


def _e(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


ERRORS = [
    (
        "full-query-wrong-length",
        lambda: full_attn_res(_e(2, 3, 8), [_e(2, 3, 8)], _e(7)),
        r"pseudo_query.*\(8,\).*\(7,\)",
    ),
    ("full-sources-differ", lambda: full_attn_res(_e(2, 3, 8), [_e(2, 4, 8)], _e(8)), r"source 1 is \(2, 4, 8\)"),
    ("full-0d-embedding", lambda: full_attn_res(torch.tensor(1.0), [], _e(1)), r"\(\.\.\., D\).*shape \(\)"),
    ("full-empty-d", lambda: full_attn_res(_e(2, 0), [], _e(0)), r"D >= 1.*\(2, 0\)"),
    ("full-non-3d-previous", lambda: full_attn_res(_e(2, 3, 8), [_e(6, 8)], _e(8)), r"source 1 is \(6, 8\)"),
    (
        "full-3d-tensor-previous",
        lambda: full_attn_res(_e(2, 3, 8), _e(2, 3, 8), _e(8)),
        r"previous_outputs.*\(2, 3, 8\)",
    ),
    (
        "full-dtype-differs",
        lambda: full_attn_res(_e(2, 3, 8), [_e(2, 3, 8, dtype=torch.float64)], _e(8)),
        r"dtype.*float32.*float64",
    ),
    ("full-eps-zero", lambda: full_attn_res(_e(2, 3, 8), [], _e(8), eps=0.0), r"eps.*0\.0"),
    ("full-eps-negative", lambda: full_attn_res(_e(2, 3, 8), [], _e(8), eps=-1e-6), r"eps"),
    ("block-query-wrong-length", lambda: block_attn_res([_e(2, 3, 8)], None, _e(9)), r"pseudo_query.*\(8,\).*\(9,\)"),
    ("block-gain-wrong-length", lambda: block_attn_res([_e(2, 3, 8)], None, _e(8), _e(4)), r"norm_weight.*\(4,\)"),
    (
        "block-partial-differs",
        lambda: block_attn_res([_e(2, 3, 8)], _e(2, 3, 5), _e(8)),
        r"source 1 is \(2, 3, 5\)",
    ),
    (
        "block-blocks-differ",
        lambda: block_attn_res([_e(2, 3, 8), _e(1, 3, 8)], None, _e(8)),
        r"source 1 is \(1, 3, 8\)",
    ),
    ("block-0d", lambda: block_attn_res([torch.tensor(1.0)], None, _e(1)), r"\(\.\.\., D\)"),
    (
        "full-1d-embedding-3d-tensor-previous",
        lambda: full_attn_res(_e(8), _e(2, 3, 8), _e(8)),
        r"previous_outputs.*\(layers, 8\).*\(2, 3, 8\)",
    ),
    (
        "block-leading-shapes-differ",
        lambda: block_attn_res([_e(2, 3, 8)], _e(3, 2, 8), _e(8)),
        r"source 1 is \(3, 2, 8\)",
    ),
    ("block-no-sources", lambda: block_attn_res([], None, _e(8)), r"at least one source"),
    ("block-eps-zero", lambda: block_attn_res([_e(2, 3, 8)], None, _e(8), eps=0), r"eps"),
    ("block-eps-negative", lambda: block_attn_res([_e(2, 3, 8)], None, _e(8), eps=-0.1), r"eps"),
    (
        "output-norm-wrong-length",
        lambda: block_attn_res([_e(2, 3, 8)], None, _e(8), output_norm_weight=_e(7)),
        r"output_norm_weight must have shape \(8,\).*\(7,\)",
    ),
    (
        "full-output-norm-2d",
        lambda: full_attn_res(_e(2, 3, 8), [], _e(8), output_norm_weight=_e(1, 8)),
        r"output_norm_weight.*\(1, 8\)",
    ),
]


@pytest.mark.parametrize("call,match", [pytest.param(c, m, id=i) for i, c, m in ERRORS])
def test_bad_inputs_raise_value_error_naming_the_mismatch(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------
# gradcheck (float64)
# ------------------------------------------------------------------------------------------------


def test_gradcheck_full_attn_res():
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    prev = (torch.randn(2, 2, 2, 4, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    q = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(emb, prev, q):
        out = full_attn_res(emb, prev, q)
        return out["retrieved_representation"], out["attention_weights"]

    assert torch.autograd.gradcheck(fn, (emb, prev, q))


def test_gradcheck_block_attn_res():
    gen = torch.Generator().manual_seed(1)
    b0, b1, partial = (torch.randn(2, 2, 4, generator=gen, dtype=torch.float64) * s for s in (1.0, 2.0, 0.5))
    q, g = torch.randn(4, generator=gen, dtype=torch.float64), 1 + torch.randn(4, generator=gen, dtype=torch.float64)
    inputs = tuple(x.requires_grad_() for x in (b0, b1, partial, q, g))

    def fn(b0, b1, partial, q, g):
        return block_attn_res([b0, b1], partial, q, norm_weight=g, return_weights=True)

    assert torch.autograd.gradcheck(fn, inputs)
