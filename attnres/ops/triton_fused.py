"""Depth attention, fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1).

Same math and the same entry points as `torch_fused.py` (whose module docstring has the
backward formulas); imported only when a kernel is asked for "triton", so `import attnres`
never imports triton.

- `_fwd_kernel`: one program per BLOCK_M tokens holds whole rows (D padded to a power of
  two, any D up to 16384; `attnres.functional` picks these kernels automatically up to 8192,
  where no variant spills). It loops over the sources at run time, loading the next
  source's tile while it works on this one; for each it takes r = 1 / rms(v) (overflow
  safe: where the squares overflow, rows are scaled by max(1, max|v|) first) or reads a
  cached r, forms the logits of up to 4 queries at once and updates an online softmax
  (running max, sum and float32 accumulator per query). It writes the outputs, the logits z and the log-sum-exp
  lse; a "prefix" (a phase-1 result with its lse) starts the softmax.
- `_bwd_kernel`: recomputes everything from the sources and the saved z, lse and r; a
  persistent grid accumulates the query gradient per program (summed on the host, so it is
  deterministic). Without a prefix it reads the sources twice (the first pass finds
  P_k = dO_k . out_k); with a prefix P_k comes from the saved output and one pass over the
  sources suffices (plus one over the saved logits alone). Either first pass also sums the
  recomputed exp(z - lse), to renormalise the weights (see torch_fused.py).
- Why a runtime loop: the sources arrive as a tuple of pointers, which Triton indexes only at
  compile time, so an unrolled loop was the obvious form; but ptxas then keeps every
  source's tile live (it sinks the softmax updates past later loads), and registers, spills
  and compile time grew with the source count (Full AttnRes at 24 sublayers: 7 KB of spill
  per thread, 48 s to compile one variant). `_pick` selects a source's pointer by a chain of
  scalar selects instead (about 4 instructions per candidate, so tuples are not padded).
  `experiments/kernel_resources.py` compiles every variant for sm_90 without a GPU and
  reports registers, spills and the instructions the loops issue per byte; a test holds the
  spills.
- The fused output RMSNorm (`out_norm`, on output 0 of any call: one query or several, a prefix
  or not): the forward normalises h in registers before its one store (and stores h too only
  when a backward may need it); the backward turns the incoming cotangent of y into that of h
  right after loading it (and with a prefix reads h, not y, for P = dO . h), and sums the
  weight's gradient per program like the query's. No extra pass over memory either way. A
  second-order gradient through a normed merge is refused (its h needs the prefix's value).
- `torch.library.custom_op` registrations (`attnres::depth_attention_fwd`/`_bwd`,
  `attnres::inv_rms`) with fake implementations and `register_autograd`, so torch.compile
  keeps them as single graph nodes instead of breaking the graph.
Statistics are float32; inputs may be float32, bfloat16 or float16.
"""

# Kernel arguments use DESIGN.md's shape names (M tokens, D, K queries) and Triton's upper-case
# compile-time constants (BLOCK_M, HAS_PREFIX, ...).
# ruff: noqa: N803

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnres.ops.torch_fused import SECOND_ORDER_NORMED_MERGE, attend, differentiable_backward, second_order

__all__ = ["fused_depth_attention", "inv_rms", "run_depth_attention"]
PREFIX_QUERIES = 1  # a prefix (phase-1 result) is taken with one query per call; other kernels take any
# `run_depth_attention(out_norm=...)` norms output 0 of any call (K queries, a prefix or not): the
# strategies' two-phase sites hand the next sublayer its pre-norm from the kernel (`attnres.functional`)
FUSED_OUTPUT_NORM = True

MAX_K = 4  # queries served by one launch at most; more are split into several launches
_MAX_BLOCK_D = 16384


def _row_elems(block_d: int, kp: int) -> int:
    """Elements of a source's (BLOCK_M, BLOCK_D) tile per thread. Each element costs a few
    instructions per query, each loop iteration a fixed overhead (reductions, softmax, the
    pointer select): 16 amortises the overhead for one query, 8 keeps the (queries x 8)
    accumulator in registers for several; more where 16 warps cannot cover a row with that."""
    return max(16 if kp == 1 else 8, block_d // (32 * 16))


def _queries_per_launch(d: int) -> int:
    """Up to MAX_K queries per launch, fewer for wide rows (16 warps, hence at most 128
    registers per thread, cover a row of 4096; the backward's per-query tiles must fit)."""
    return max(1, min(MAX_K, 8192 // triton.next_power_of_2(d)))


def _launch_shape(d: int, kc: int) -> tuple[int, int, int, int]:
    """BLOCK_D, KP (queries padded to a power of two), BLOCK_M and num_warps for D and kc queries
    (experiments/kernel_resources.py reports what they compile to)."""
    block_d = triton.next_power_of_2(d)
    if block_d > _MAX_BLOCK_D:
        raise ValueError(f"the Triton depth-attention kernels support D <= {_MAX_BLOCK_D}, got D={d}")
    kp = triton.next_power_of_2(kc)
    elems = _row_elems(block_d, kp)
    num_warps = max(4, min(16, block_d // (32 * elems)))
    block_m = max(1, min(16, elems * 32 * num_warps // block_d))
    return block_d, kp, block_m, num_warps


# ------------------------------------------------------------------------------------------------
# kernels
#
# Every tile is 3-D, (queries, tokens, D), and a source's tile is loaded as (1, BLOCK_M, BLOCK_D):
# loads, products with the (KP, 1, BLOCK_D) queries and reductions then share one layout, and
# Triton converts no tile between layouts inside the loops (2-D loads broadcast into 3-D math made
# Triton 3.6 shuffle every tile through shared memory, and spill 6 KB per thread). A source's
# statistics are (1, BLOCK_M), the logits and softmax state (KP, BLOCK_M).
# ------------------------------------------------------------------------------------------------


@triton.jit
def _row_inv_rms(v, D, eps):
    """1 / sqrt(mean(v^2) + eps) per token of v (1, BM, BD) float32, padded with zeros, as
    (1, BM). Squares overflow float32 only for |v| above ~1e19; then, and only then, rows are
    scaled by c = max(1, max|v|) first (as naive.py always does), so the common case costs one
    product and one sum per element."""
    ss = tl.sum(v * v, axis=2)
    if tl.max(ss) == float("inf"):
        inv_c = 1.0 / tl.maximum(tl.max(tl.abs(v), axis=2), 1.0)
        u = v * inv_c[:, :, None]
        r = inv_c / tl.sqrt(tl.sum(u * u, axis=2) / D + eps * inv_c * inv_c)  # eps / c^2 without overflow
    else:
        r = 1.0 / tl.sqrt(ss / D + eps)
    return r


@triton.jit
def _pick(ptrs, i):
    """ptrs[i] for a runtime i. A tuple takes only compile-time indices; a chain of scalar
    selects keeps the loop over sources a real loop (see the module docstring)."""
    p = ptrs[0]
    for j in tl.static_range(1, len(ptrs)):
        p = tl.where(i == j, ptrs[j], p)
    return p


@triton.jit
def _load_next(srcs, i, n_src, offs, mask, c3, D):
    """Source i + 1's tile (1, BM, BD) in its own dtype, masked off entirely after the last
    source. (n_src - 1 - i) * D >= D > every valid column while a source follows, and 0 after
    the last: integer arithmetic, which the interpreter takes as a mask (a scalar bool not)."""
    more = c3 < (n_src - 1 - i) * D
    return tl.load(_pick(srcs, i + 1) + offs, mask=mask & more, other=0.0)


@triton.jit
def _tiles(M, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, row0):
    """Rows (BM,) from row0, and the (1, BM, BD) element offsets and mask of their tile."""
    rows = row0 + tl.arange(0, BLOCK_M)
    r3 = rows[None, :, None]
    c3 = tl.arange(0, BLOCK_D)[None, None, :]
    return rows, r3.to(tl.int64) * D + c3, (r3 < M) & (c3 < D)


@triton.jit
def _inv_rms_kernel(x_ptr, r_ptr, M, D, eps, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, offs, mask = _tiles(M, D, BLOCK_M, BLOCK_D, tl.program_id(0) * BLOCK_M)
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(r_ptr + rows[None, :], _row_inv_rms(v, D, eps), mask=rows[None, :] < M)


@triton.jit(do_not_specialize=["n_src"])
def _fwd_kernel(
    srcs, n_src, r_in, q_ptr, pre_h, pre_lse, outs, z_ptr, lse_ptr, r_out, on_ptr, h_out, hn_out,
    M, D, eps, out_eps,
    K: tl.constexpr, KP: tl.constexpr, HAS_RMS: tl.constexpr,
    HAS_PREFIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ONORM: tl.constexpr = False, STORE_H: tl.constexpr = False,
):
    rows, offs, mask = _tiles(M, D, BLOCK_M, BLOCK_D, tl.program_id(0) * BLOCK_M)
    c3 = tl.arange(0, BLOCK_D)[None, None, :]
    ks = tl.arange(0, KP)
    k3 = ks[:, None, None]
    q = tl.load(q_ptr + k3 * D + c3, mask=(k3 < K) & (c3 < D), other=0.0).to(tl.float32)  # (KP, 1, BD)
    rmask = rows[None, :] < M  # (1, BM)
    zmask = (ks[:, None] < K) & rmask  # (KP, BM)
    if HAS_PREFIX:  # K == 1: the softmax starts from a phase-1 result and its log-sum-exp
        m = tl.load(pre_lse + ks[:, None] * M + rows[None, :], mask=zmask, other=0.0)
        l_sum = tl.full([KP, BLOCK_M], 1.0, tl.float32)
        acc = tl.load(pre_h[0] + offs, mask=mask, other=0.0).to(tl.float32)  # (1, BM, BD)
    else:
        m = tl.full([KP, BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([KP, BLOCK_M], tl.float32)
        acc = tl.zeros([KP, BLOCK_M, BLOCK_D], tl.float32)
    nxt = tl.load(srcs[0] + offs, mask=mask, other=0.0)
    for i in range(n_src):  # a runtime loop, the next source's tile loading during this one
        v = nxt.to(tl.float32)  # (1, BM, BD)
        nxt = _load_next(srcs, i, n_src, offs, mask, c3, D)
        if HAS_RMS:
            r = tl.load(r_in + i * M + rows[None, :], mask=rmask, other=1.0)  # (1, BM)
        else:
            r = _row_inv_rms(v, D, eps)  # kept for the backward
            tl.store(r_out + i * M + rows[None, :], r, mask=rmask)
        z = tl.sum(v * q, axis=2) * r  # (KP, BM)
        tl.store(z_ptr + (ks[:, None] * n_src + i) * M + rows[None, :], z, mask=zmask)
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        l_sum = l_sum * scale + p
        acc = acc * scale[:, :, None] + p[:, :, None] * v
        m = m_new
    tl.store(lse_ptr + ks[:, None] * M + rows[None, :], m + tl.log(l_sum), mask=zmask)
    out = acc / l_sum[:, :, None]  # (KP, BM, BD)
    if HAS_ONORM:  # the fused output RMSNorm of output 0, y = h * n * w, from h in registers
        if KP == 1:
            h0 = out
        else:
            h0 = tl.sum(tl.where(k3 == 0, out, 0.0), axis=0, keep_dims=True)  # (1, BM, BD)
        hn = 1.0 / tl.sqrt(tl.sum(h0 * h0, axis=2) / D + out_eps)  # (1, BM)
        tl.store(hn_out + rows[None, :], hn, mask=rmask)
        if STORE_H:  # for the backward
            tl.store(h_out + offs, h0.to(h_out.dtype.element_ty), mask=mask)
        w = tl.load(on_ptr + c3, mask=c3 < D, other=0.0)  # (1, 1, BD)
        if KP == 1:
            out = h0 * hn[:, :, None] * w
        else:
            out = tl.where(k3 == 0, h0 * hn[:, :, None] * w, out)
    for k in tl.static_range(K):
        if KP == 1:
            o = out
        else:
            o = tl.sum(tl.where(k3 == k, out, 0.0), axis=0, keep_dims=True)  # (1, BM, BD)
        tl.store(outs[k] + offs, o.to(outs[k].dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_src"])
def _bwd_kernel(
    srcs, n_src, r_ptr, q_ptr, z_ptr, lse_ptr, pre_lse, outs, d_outs, dz_ptr, dlse_ptr,
    d_srcs, dq_ptr, d_pre_h, d_pre_lse, on_ptr, h_ptr, hn_ptr, dw_ptr,
    M, D, n_blocks,
    K: tl.constexpr, KP: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_DZ: tl.constexpr,
    HAS_DLSE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ONORM: tl.constexpr = False,
):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    c3 = tl.arange(0, BLOCK_D)[None, None, :]
    ks = tl.arange(0, KP)
    k3 = ks[:, None, None]
    qmask = (k3 < K) & (c3 < D)
    q = tl.load(q_ptr + k3 * D + c3, mask=qmask, other=0.0).to(tl.float32)  # (KP, 1, BD)
    dq = tl.zeros([KP, 1, BLOCK_D], tl.float32)
    dw = tl.zeros([1, 1, BLOCK_D], tl.float32)  # the output norm's weight gradient (HAS_ONORM)
    for blk in range(pid, n_blocks, nprog):
        rows, offs, mask = _tiles(M, D, BLOCK_M, BLOCK_D, blk * BLOCK_M)
        rmask = rows[None, :] < M  # (1, BM)
        zmask = (ks[:, None] < K) & rmask  # (KP, BM)
        kz = ks[:, None] * M + rows[None, :]  # (KP, BM) offsets into (K, M) statistics
        if KP == 1:
            d_o = tl.load(d_outs[0] + offs, mask=mask, other=0.0).to(tl.float32)  # (1, BM, BD)
        else:
            d_o = tl.zeros([KP, BLOCK_M, BLOCK_D], tl.float32)
            for k in tl.static_range(K):
                dok = tl.load(d_outs[k] + offs, mask=mask, other=0.0).to(tl.float32)
                d_o = tl.where(k3 == k, dok, d_o)
        if HAS_ONORM:  # d_o[0] is the cotangent of y = h * n * w (output 0); make it that of h
            hv = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (1, BM, BD)
            hn = tl.load(hn_ptr + rows[None, :], mask=rmask, other=0.0)[:, :, None]  # (1, BM, 1)
            w = tl.load(on_ptr + c3, mask=c3 < D, other=0.0)  # (1, 1, BD)
            if KP == 1:
                dy = d_o
            else:
                dy = tl.sum(tl.where(k3 == 0, d_o, 0.0), axis=0, keep_dims=True)  # (1, BM, BD)
            dw += tl.sum(dy * hv * hn, axis=1, keep_dims=True)
            wdy = w * dy
            # n^3 / D (wdy . h) h as (n (wdy . h) n / D) (n h): n^3 alone under- or overflows
            dh0 = hn * wdy - (hn * tl.sum(wdy * hv, axis=2, keep_dims=True) * hn / D) * (hn * hv)
            if KP == 1:
                d_o = dh0
            else:
                d_o = tl.where(k3 == 0, dh0, d_o)
        lse = tl.load(lse_ptr + kz, mask=zmask, other=0.0)
        if HAS_DLSE:
            dlse = tl.load(dlse_ptr + kz, mask=zmask, other=0.0)
        else:
            dlse = tl.zeros([KP, BLOCK_M], tl.float32)
        # The weights are exp(z - lse) / s, s their sum: lse rounded to float32 is off by up to
        # half an ulp of itself, and so is the sum of exp(z - lse) off 1 (torch_fused.py's
        # docstring says what that did to the gradients of a nearly saturated softmax).
        if HAS_PREFIX:  # P = dO . out from the saved output (K == 1); s from the logits alone
            if HAS_ONORM:  # the output before the norm
                o = hv
            else:
                o = tl.load(outs[0] + offs, mask=mask, other=0.0).to(tl.float32)
            P = tl.sum(d_o * o, axis=2)
            s = tl.exp(tl.load(pre_lse + kz, mask=zmask, other=0.0) - lse)
            for i in range(n_src):
                z = tl.load(z_ptr + (ks[:, None] * n_src + i) * M + rows[None, :], mask=zmask, other=0.0)
                s += tl.exp(z - lse)
        else:  # first pass: P = sum_i alpha_i dO . v_i, and s
            P = tl.zeros([KP, BLOCK_M], tl.float32)
            s = tl.zeros([KP, BLOCK_M], tl.float32)
            nxt = tl.load(srcs[0] + offs, mask=mask, other=0.0)
            for i in range(n_src):
                v = nxt.to(tl.float32)
                nxt = _load_next(srcs, i, n_src, offs, mask, c3, D)
                z = tl.load(z_ptr + (ks[:, None] * n_src + i) * M + rows[None, :], mask=zmask, other=0.0)
                a = tl.exp(z - lse)
                P += a * tl.sum(d_o * v, axis=2)
                s += a
        inv_s = 1.0 / s  # >= 1 / n' (the largest weight's exp(z - lse) is about 1): never 1 / 0
        if not HAS_PREFIX:
            P = P * inv_s
        # Two running values per query and token in the loop below, not the three the formulas
        # name (P, dlse, sum_i alpha_i g_i; with 1 / s, the prefix variants took 125 registers
        # instead of 96, 16 warps per SM on sm_90 instead of 20): dz_i = alpha_i (g_i - Pd), and
        # the prefix's logit gradient a_pre (g_pre - P + dlse) = rest - a_pre Pd, since
        # a_pre g_pre = P - sum_i alpha_i g_i.
        Pd = P - dlse
        rest = P  # prefix: P - sum_i alpha_i g_i
        nxt = tl.load(srcs[0] + offs, mask=mask, other=0.0)
        for i in range(n_src):
            v = nxt.to(tl.float32)  # (1, BM, BD)
            nxt = _load_next(srcs, i, n_src, offs, mask, c3, D)
            r = tl.load(r_ptr + i * M + rows[None, :], mask=rmask, other=0.0)  # (1, BM)
            zoff = (ks[:, None] * n_src + i) * M + rows[None, :]
            z = tl.load(z_ptr + zoff, mask=zmask, other=0.0)
            alpha = tl.where(zmask, tl.exp(z - lse) * inv_s, 0.0)  # (KP, BM)
            g = tl.sum(d_o * v, axis=2)
            if HAS_PREFIX:
                rest -= alpha * g
            dz = alpha * (g - Pd)
            if HAS_DZ:
                dz += tl.load(dz_ptr + zoff, mask=zmask, other=0.0)
            dzr = dz * r
            # the derivative through r, c r v with c = -(sum dz z) r / D: r^2 alone under- or overflows
            # for |v| beyond ~1e19 or below ~1e-19, (r v) and c do not
            c = -tl.sum(dz * z, axis=0, keep_dims=True) * r / D  # (1, BM)
            dv = tl.sum(alpha[:, :, None] * d_o + dzr[:, :, None] * q, axis=0, keep_dims=True) + c[:, :, None] * (
                v * r[:, :, None]
            )
            d_src = _pick(d_srcs, i)
            if ACCUMULATE:
                dv += tl.load(d_src + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(d_src + offs, dv.to(d_src.dtype.element_ty), mask=mask)
            dq += tl.sum(dzr[:, :, None] * v, axis=1, keep_dims=True)  # (KP, 1, BD)
        if HAS_PREFIX:
            a_pre = tl.exp(tl.load(pre_lse + kz, mask=zmask, other=0.0) - lse) * inv_s
            tl.store(d_pre_lse + kz, rest - a_pre * Pd, mask=zmask)
            dh = a_pre[:, :, None] * d_o  # (1, BM, BD): K == 1
            tl.store(d_pre_h[0] + offs, dh.to(d_pre_h[0].dtype.element_ty), mask=mask)
    tl.store(dq_ptr + (pid * K + k3) * D + c3, dq, mask=qmask)
    if HAS_ONORM:
        tl.store(dw_ptr + pid * D + c3, dw, mask=c3 < D)


# ------------------------------------------------------------------------------------------------
# host side: custom ops
# ------------------------------------------------------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _n_programs(n_blocks: int, num_warps: int, device: torch.device) -> int:
    if device.type == "cuda":  # about 32 resident warps per SM
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_blocks, sms * max(1, 32 // num_warps)))
    return max(1, min(n_blocks, 4))  # the interpreter: few programs, each looping


@torch.library.custom_op("attnres::inv_rms", mutates_args=())
def _inv_rms_op(v: Tensor, eps: float) -> Tensor:
    v = _rows(v)
    d = v.shape[-1]
    m = v.numel() // d
    r = torch.empty(v.shape[:-1], dtype=torch.float32, device=v.device)
    block_d, _, block_m, num_warps = _launch_shape(d, 1)
    _inv_rms_kernel[(triton.cdiv(m, block_m),)](v, r, m, d, eps, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
    return r


@_inv_rms_op.register_fake
def _(v, eps):
    return v.new_empty(v.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("attnres::depth_attention_fwd", mutates_args=())
def _fwd_op(
    sources: list[Tensor],
    r_cache: Tensor | None,
    queries: Tensor,
    prefix_h: list[Tensor],
    prefix_lse: Tensor | None,
    eps: float,
    out_norm: Tensor | None,
    save_h: bool,
    out_eps: float,
) -> tuple[list[Tensor], Tensor, Tensor, Tensor, Tensor, Tensor]:
    sources = [_rows(v) for v in sources]
    first = sources[0]
    shape, d, n, K = first.shape, first.shape[-1], len(sources), queries.shape[0]
    m = first.numel() // d
    device = first.device
    queries = _rows(queries.float())
    outs = [first.new_empty(shape) for _ in range(K)]
    z = torch.empty((K, n, *shape[:-1]), dtype=torch.float32, device=device)
    lse = torch.empty((K, *shape[:-1]), dtype=torch.float32, device=device)
    r_new = torch.empty((n, *shape[:-1]) if r_cache is None else (0,), dtype=torch.float32, device=device)
    r = _rows(r_cache.float()) if r_cache is not None else r_new
    has_prefix = prefix_lse is not None
    pre_h = tuple(_rows(p) for p in prefix_h) if has_prefix else (first,)
    pre_lse = _rows(prefix_lse.float()) if has_prefix else lse
    has_onorm = out_norm is not None  # on output 0: in the first launch
    h = first.new_empty(shape if has_onorm and save_h else (0,))  # output 0 before the norm
    h_inv_rms = torch.empty(shape[:-1] if has_onorm else (0,), dtype=torch.float32, device=device)
    on = _rows(out_norm.float()) if has_onorm else queries
    per_launch = _queries_per_launch(d)
    for k0 in range(0, K, per_launch):
        kc = min(per_launch, K - k0)
        block_d, kp, block_m, num_warps = _launch_shape(d, kc)
        has_rms = r_cache is not None or k0 > 0  # later chunks reuse the r the first one wrote
        _fwd_kernel[(triton.cdiv(m, block_m),)](
            tuple(sources), n, r, queries[k0:], pre_h, pre_lse, tuple(outs[k0 : k0 + kc]), z[k0:], lse[k0:], r_new,
            on, h if save_h else first, h_inv_rms if has_onorm else lse,
            m, d, eps, out_eps,
            K=kc, KP=kp, HAS_RMS=has_rms, HAS_PREFIX=has_prefix, BLOCK_M=block_m, BLOCK_D=block_d,
            HAS_ONORM=has_onorm and k0 == 0, STORE_H=has_onorm and save_h and k0 == 0, num_warps=num_warps,
        )
    return outs, z, lse, r_new, h, h_inv_rms


@_fwd_op.register_fake
def _(sources, r_cache, queries, prefix_h, prefix_lse, eps, out_norm, save_h, out_eps):
    first = sources[0]
    K, n = queries.shape[0], len(sources)
    stat = {"dtype": torch.float32}
    r_shape = (n, *first.shape[:-1]) if r_cache is None else (0,)
    has_onorm = out_norm is not None
    return (  # contiguous, as the real outputs are whatever the inputs' strides
        [first.new_empty(first.shape) for _ in range(K)],
        first.new_empty((K, n, *first.shape[:-1]), **stat),
        first.new_empty((K, *first.shape[:-1]), **stat),
        first.new_empty(r_shape, **stat),
        first.new_empty(first.shape if has_onorm and save_h else (0,)),
        first.new_empty(first.shape[:-1] if has_onorm else (0,), **stat),
    )


@torch.library.custom_op("attnres::depth_attention_bwd", mutates_args=())
def _bwd_op(
    sources: list[Tensor],
    r: Tensor,
    queries: Tensor,
    z: Tensor,
    lse: Tensor,
    prefix_lse: Tensor | None,
    outs: list[Tensor],
    d_outs: list[Tensor],
    dz_ext: Tensor | None,
    dlse: Tensor | None,
    out_norm: Tensor | None,
    h: Tensor | None,
    h_inv_rms: Tensor | None,
) -> tuple[list[Tensor], Tensor, list[Tensor], Tensor, Tensor]:
    sources = [_rows(v) for v in sources]
    first = sources[0]
    d, K = first.shape[-1], queries.shape[0]
    m = first.numel() // d
    device = first.device
    queries = _rows(queries.float())
    has_prefix = prefix_lse is not None
    per_launch = _queries_per_launch(d)
    split = K > per_launch  # gradients of the sources accumulate over launches: keep them float32 then
    d_src = [torch.empty(v.shape, dtype=torch.float32 if split else v.dtype, device=device) for v in sources]
    d_outs = tuple(_rows(g) for g in d_outs)
    d_pre_h = [first.new_empty(first.shape)] if has_prefix else []
    d_pre_lse = torch.empty_like(lse) if has_prefix else lse.new_empty(0)
    d_q = torch.empty_like(queries)
    has_onorm = out_norm is not None  # on output 0: in the first launch
    on = _rows(out_norm.float()) if has_onorm else queries
    d_on = torch.empty(d if has_onorm else 0, dtype=torch.float32, device=device)
    for k0 in range(0, K, per_launch):
        kc = min(per_launch, K - k0)
        block_d, kp, block_m, num_warps = _launch_shape(d, kc)
        n_blocks = triton.cdiv(m, block_m)
        nprog = _n_programs(n_blocks, num_warps, device)
        dq_part = torch.empty((nprog, kc, d), dtype=torch.float32, device=device)
        dw_part = torch.empty((nprog, d) if has_onorm else (0,), dtype=torch.float32, device=device)
        _bwd_kernel[(nprog,)](
            tuple(sources), len(sources), _rows(r), queries[k0:], _rows(z[k0:]), _rows(lse[k0:]),
            _rows(prefix_lse) if has_prefix else lse, tuple(_rows(o) for o in outs) if has_prefix else (first,),
            d_outs[k0 : k0 + kc], _rows(dz_ext[k0:]) if dz_ext is not None else z,
            _rows(dlse[k0:]) if dlse is not None else lse,
            tuple(d_src), dq_part, tuple(d_pre_h) if has_prefix else (first,), d_pre_lse if has_prefix else lse,
            on, _rows(h) if has_onorm else first, _rows(h_inv_rms) if has_onorm else lse, dw_part,
            m, d, n_blocks,
            K=kc, KP=kp, HAS_PREFIX=has_prefix, HAS_DZ=dz_ext is not None, HAS_DLSE=dlse is not None,
            ACCUMULATE=k0 > 0, BLOCK_M=block_m, BLOCK_D=block_d, HAS_ONORM=has_onorm and k0 == 0,
            num_warps=num_warps,
        )
        d_q[k0 : k0 + kc] = dq_part.sum(0)
        if has_onorm and k0 == 0:
            d_on = dw_part.sum(0)
    if split:
        d_src = [g.to(v.dtype) for g, v in zip(d_src, sources, strict=True)]
    return d_src, d_q, d_pre_h, d_pre_lse, d_on


@_bwd_op.register_fake
def _(sources, r, queries, z, lse, prefix_lse, outs, d_outs, dz_ext, dlse, out_norm, h, h_inv_rms):
    has_prefix = prefix_lse is not None
    return (
        [v.new_empty(v.shape) for v in sources],
        queries.new_empty(queries.shape, dtype=torch.float32),
        [sources[0].new_empty(sources[0].shape)] if has_prefix else [],
        torch.empty_like(lse) if has_prefix else lse.new_empty(0),
        queries.new_empty(queries.shape[-1] if out_norm is not None else 0, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    sources, r_cache, queries, prefix_h, prefix_lse, eps, out_norm, save_h, out_eps = inputs
    outs, z, lse, r_new, h, h_inv_rms = output
    ctx.n, ctx.has_prefix, ctx.q_dtype, ctx.eps = len(sources), prefix_lse is not None, queries.dtype, eps
    ctx.out_eps = out_eps
    ctx.has_onorm, ctx.on_dtype = out_norm is not None, None if out_norm is None else out_norm.dtype
    r = r_cache if r_cache is not None else r_new
    ctx.save_for_backward(
        r, queries, z, lse, prefix_lse, out_norm, h, h_inv_rms, *sources, *(outs if ctx.has_prefix else ())
    )


def _backward(ctx, d_outs, dz, dlse, _dr, _dh, _dhn):
    r, queries, z, lse, prefix_lse, out_norm, h, h_inv_rms, *rest = ctx.saved_tensors
    sources, outs = rest[: ctx.n], rest[ctx.n :]
    if second_order():  # create_graph=True: the backward in differentiable PyTorch operations
        if ctx.has_onorm and ctx.has_prefix:  # h needs the prefix's value, which is not kept
            raise RuntimeError(SECOND_ORDER_NORMED_MERGE)
        d_src, d_q, d_pre_h, d_pre_lse, d_on = differentiable_backward(
            sources, ctx.eps, queries.float(), z, lse, prefix_lse, outs, list(d_outs), dz, dlse,
            out_norm.float() if ctx.has_onorm else None, ctx.out_eps,
        )
        d_on = d_on.to(ctx.on_dtype) if ctx.has_onorm else None
        return d_src, None, d_q.to(ctx.q_dtype), d_pre_h, d_pre_lse, None, d_on, None, None
    d_outs = [torch.zeros_like(sources[0]) if g is None else g for g in d_outs]
    if not ctx.has_onorm:
        out_norm = h = h_inv_rms = None
    d_src, d_q, d_pre_h, d_pre_lse, d_on = _bwd_op(
        sources, r, queries, z, lse, prefix_lse, list(outs), d_outs, dz, dlse, out_norm, h, h_inv_rms
    )
    d_on = d_on.to(ctx.on_dtype) if ctx.has_onorm else None
    if not ctx.has_prefix:
        return d_src, None, d_q.to(ctx.q_dtype), [], None, None, d_on, None, None
    return d_src, None, d_q.to(ctx.q_dtype), d_pre_h, d_pre_lse, None, d_on, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# entry points (the signatures of torch_fused.py)
# ------------------------------------------------------------------------------------------------


def inv_rms(v: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(v^2 over D) + eps), (..., D) -> (...) float32, no gradient; exact for any
    finite input (rows are rescaled in registers)."""
    return _inv_rms_op(v.detach(), eps)


def run_depth_attention(
    sources: Sequence[Tensor],
    r_cache: Tensor | None,
    queries: Tensor,
    prefix_h: Sequence[Tensor] = (),
    prefix_lse: Tensor | None = None,
    eps: float = 1e-6,
    out_norm: Tensor | None = None,
    stacked: Tensor | None = None,
    out_eps: float | None = None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Differentiable (outs, z, lse) with respect to sources, queries, prefix_h, prefix_lse and
    out_norm (r_cache is a cached function of the sources, see torch_fused.py). `out_norm`: the
    (D,) weight of an RMSNorm of output 0 (eps `out_eps`, None: `eps`) fused into the kernels,
    for any number of queries, with or without a prefix (`FUSED_OUTPUT_NORM`), or None; h,
    output 0 before it, is written only when a gradient may be asked for. `stacked` (the
    sources' values in one tensor) is accepted for torch_fused.py's signature and not used:
    the kernels read the sources where they are."""
    out_eps = eps if out_eps is None else out_eps
    r_cache = None if r_cache is None else r_cache.detach()
    tensors = (queries, *sources, *prefix_h) + tuple(t for t in (prefix_lse, out_norm) if t is not None)
    save_h = out_norm is not None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outs, z, lse, *_ = _fwd_op(list(sources), r_cache, queries, list(prefix_h), prefix_lse, eps, out_norm, save_h,
                               out_eps)
    return outs, z, lse


def fused_depth_attention(
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    output_norm_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attend over `sources` (each (..., D), e.g. (B, T, D)) with `pseudo_query` (D,).

    Returns `(h, weights)`, both in the sources' dtype (computed in float32, or
    float64 for float64 sources, and rounded once): h is (..., D), weights is
    (S, ...) and sums to 1 over S for every token (to that dtype's rounding).
    With `output_norm_weight` (D,), h is RMSNorm(h) * output_norm_weight instead,
    fused into the kernels.
    Inputs are not validated here: `attnres.functional` does that once, at the
    public boundary.
    """
    return attend(run_depth_attention, sources, pseudo_query, norm_weight, eps, output_norm_weight)
