"""Depth attention, the fast formulation in plain PyTorch (CPU, and the generic fallback).

Same math as `naive.py` (DESIGN.md section 2), organised for speed and memory:

- the core takes the n sources as one (n, M, D) tensor: the logits of all K queries are one
  (n M, D) @ (D, K) product, and the weighted sums and the backward go source by source, in
  place, so that no (n, M, D) temporary is allocated per call (on CPU its page faults cost more
  than its arithmetic: experiments/BENCHMARKS.md, "Small models"). The strategies keep their
  completed sources in a buffer they only append to (`attnres.functional.SourceStack`) and pass
  it as `stacked`: nothing is stacked per call. Sources are never normalised into a copy: per token and
  source only two statistics exist, the inverse RMS r_i = 1 / sqrt(mean(v_i^2) + eps) and
  the logit z_i = (v_i . q) * r_i (the key-norm gain is folded into the query q);
- one custom autograd function saves only those statistics (float32 for half inputs) and a
  reference to the sources (the caller's buffer, or the source tensors it already holds),
  and recomputes the rest in its backward;
- K queries can be served at once (phase 1 of two-phase Block AttnRes: the sublayers of a
  block against all completed blocks), and an already-aggregated source can be merged in as
  a "prefix" with a known logit (phase 2: the sublayer's own partial sum, online softmax;
  one new source takes `merge_one`, a lerp with a sigmoid weight, in a few operations).

The core `depth_attention_forward` / `depth_attention_backward` pair is what the Triton
kernels of `triton_fused.py` implement too (the same math and saved statistics; the kernels
take the sources as a list).
Per-token math of the backward, for cotangents dO_k of the outputs, dz_ext of the logits
and dlse_k of the log-sum-exp (alpha = softmax over sources, P_k = dO_k . out_k):

    dz_ki = alpha_ki (dO_k . v_i - P_k + dlse_k) + dz_ext_ki
    dv_i  = sum_k alpha_ki dO_k + r_i sum_k dz_ki q_k - (sum_k dz_ki z_ki) r_i^2 / D v_i
    dq_k  = sum over tokens and i of dz_ki r_i v_i

The last term of dv_i is the derivative through r_i, so a cached r_i (computed once per
completed block) is a pure speed-up and needs no gradient path of its own.

A fused output RMSNorm (one query, no prefix: `out_norm`, the weight w) returns
y = h * n * w with n = 1 / sqrt(mean(h^2) + eps), computed from the unrounded h, and keeps
h (in the input dtype) and n for the backward, which turns the cotangent dy of y into that
of h before anything else, dO = n (w dy) - n^3 / D ((w dy) . h) h, and gives
dw = sum over tokens of n dy h.

The weights are recomputed as exp(z - lse), renormalised (`_weights`): lse rounded to the
statistics dtype is off by up to half an ulp of itself (7.6e-6 in float32 for |lse| >= 128),
and every exp(z_i - lse) by that factor, so their sum misses 1 by as much. Where the
softmax is nearly saturated (top weight 1 - 1e-5, say), P_k and dO_k . v_top then differ
by that error instead of by the tiny true difference, and dz, hence the query, gain and
source gradients, went wrong by 10-100x the naive reference's error. Renormalised, the
weights sum to 1 to float32 rounding, as a softmax's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "depth_attention_backward",
    "depth_attention_forward",
    "fused_depth_attention",
    "inv_rms",
    "merge_one",
    "mix_one",
    "run_depth_attention",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 statistics for half inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def inv_rms(v: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(v^2 over D) + eps), (..., D) -> (...), in the compute dtype; no gradient.

    Exact for any finite input: when a square overflows (|v| past ~1e19 in float32 or
    bfloat16) the row is rescaled by c = max(1, max|v|) first, as `naive.py` does. In eager
    mode that second pass runs only when needed; under torch.compile it always runs, fused by
    Inductor into the same loop.
    """
    cd, d = compute_dtype(v.dtype), v.shape[-1]
    if not torch.compiler.is_compiling():
        ms = torch.linalg.vector_norm(v, dim=-1, dtype=cd).square_().div_(d)
        if bool(torch.isfinite(ms).all()):
            return ms.add_(eps).rsqrt_()
    c = v.abs().amax(dim=-1).to(cd).clamp_min(1.0)  # (...)
    u = v.to(cd) / c.unsqueeze(-1)
    return torch.rsqrt(u.square().mean(dim=-1) + eps / c / c) / c  # eps / c^2 without overflow


def _weights(zall: Tensor, lse: Tensor) -> Tensor:
    """Softmax weights (K, n', M) over axis 1 from the logits (K, n', M) and their rounded
    log-sum-exp (K, M), renormalised so that they sum to 1 (module docstring)."""
    alpha = torch.exp(zall - lse.unsqueeze(1))
    return alpha / alpha.sum(dim=1, keepdim=True)


def _rows(v: Tensor, cd: torch.dtype) -> Tensor:
    """(..., D) -> (M, D) in the compute dtype; a view for contiguous float32/64 inputs."""
    return v.to(cd).reshape(-1, v.shape[-1])


def _source_rows(sources: Sequence[Tensor], stacked: Tensor | None, cd: torch.dtype) -> Tensor | list[Tensor]:
    """The n sources as rows in the compute dtype, indexable by source: `stacked` (their values,
    stacked, as the strategies keep them) viewed as one (n, M, D) tensor, else a list of (M, D)
    views of the sources (copies only for a dtype other than the compute dtype). Never a stacking
    copy: on the public op's lists that copy and its page faults cost 4x the forward's time."""
    if stacked is not None:
        return stacked.to(cd).reshape(len(sources), -1, sources[0].shape[-1])
    return [_rows(v, cd) for v in sources]


def _logits(vals: Tensor | Sequence[Tensor], queries: Tensor) -> Tensor:
    """v_i . q_k for every source and query, (n, M, K): one (n M, D) @ (D, K) product on a
    stacked tensor, one (M, D) @ (D, K) product per source on a list."""
    if isinstance(vals, Tensor):
        return torch.matmul(vals, queries.T)
    return torch.stack([v @ queries.T for v in vals])


def _weighted_sum(vals: Tensor | Sequence[Tensor], a: Tensor) -> Tensor:
    """sum_i a[i] * vals[i] for vals (n, M, D) (or n of (M, D)) and per-token weights a (n, M): a
    new (M, D) tensor, accumulated in place (one pass per source, no (n, M, D) temporary)."""
    acc = vals[0] * a[0].unsqueeze(-1)
    for i in range(1, len(vals)):
        acc.addcmul_(vals[i], a[i].unsqueeze(-1))
    return acc


def depth_attention_forward(
    vals: Tensor | Sequence[Tensor],
    r_cache: Tensor | None,
    queries: Tensor,
    prefix_h: Sequence[Tensor],
    prefix_lse: Tensor | None,
    eps: float,
    out_norm: Tensor | None = None,
) -> tuple[list[Tensor], Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """No-grad forward. vals: the n sources as rows in the compute dtype, stacked (n, M, D) or a
    list of n (M, D) tensors (`_source_rows`); r_cache:
    their inverse RMS (n, M) or None; queries: (K, D) gain-folded, compute dtype; prefix_h: []
    or K tensors (M, D) whose logit is prefix_lse (K, M); out_norm: None, or (K == 1, no
    prefix) the (D,) weight of a fused output RMSNorm, compute dtype. Returns (outs: K tensors
    (M, D) in the compute dtype, z (K, n, M), lse (K, M), r (n, M), h, n): with out_norm, outs
    is [y] and h the output before the norm, n (M,) its inverse RMS; else both None."""
    K, n = queries.shape[0], len(vals)
    if r_cache is not None:
        r, z = r_cache.reshape(n, -1), _logits(vals, queries)
    elif isinstance(vals, Tensor):  # (n, M); the logits of all K queries in one read of the sources
        r, z = inv_rms(vals, eps), _logits(vals, queries)
    else:  # a list: each source's statistic and logits back to back, so that the second read of it
        # comes from cache (sources past the last-level cache were read from memory twice: 2x the time)
        per_source = [(inv_rms(v, eps), v @ queries.T) for v in vals]
        r, z = torch.stack([x for x, _ in per_source]), torch.stack([y for _, y in per_source])
    z = z.mul_(r.unsqueeze(-1)).permute(2, 0, 1).contiguous()  # (K, n, M)
    zall = z if prefix_lse is None else torch.cat([prefix_lse.reshape(K, 1, -1), z], dim=1)  # (K, n', M)
    lse = torch.logsumexp(zall, dim=1)  # (K, M)
    alpha = _weights(zall, lse)  # (K, n', M)
    outs = []
    for k in range(K):  # K separate outputs: a sublayer keeping one for backward keeps only that one
        if prefix_lse is None:
            outs.append(_weighted_sum(vals, alpha[k]))
        else:
            outs.append(_weighted_sum(vals, alpha[k, 1:]).addcmul_(prefix_h[k], alpha[k, 0].unsqueeze(-1)))
    h = h_inv_rms = None
    if out_norm is not None:  # K == 1: y = h * n * w from the unrounded h
        h, h_inv_rms = outs[0], torch.rsqrt(outs[0].square().mean(dim=-1) + eps)  # (M,)
        outs = [outs[0] * h_inv_rms.unsqueeze(-1) * out_norm]
    return outs, z, lse, r, h, h_inv_rms


def depth_attention_backward(
    vals: Tensor | Sequence[Tensor],
    r: Tensor,
    queries: Tensor,
    z: Tensor,
    lse: Tensor,
    prefix_lse: Tensor | None,
    outs: Sequence[Tensor],
    d_outs: Sequence[Tensor | None],
    dz_ext: Tensor | None,
    dlse: Tensor | None,
    out_norm: Tensor | None = None,
    h: Tensor | None = None,
    h_inv_rms: Tensor | None = None,
) -> tuple[list[Tensor], Tensor, list[Tensor], Tensor | None, Tensor | None]:
    """Gradients (dV (n of (M, D)), d_queries (K, D), d_prefix_h (K of (M, D)), d_prefix_lse (K, M),
    d_out_norm), all in the compute dtype, of the forward above; shapes as there, d_outs (M, D)
    or None. `outs` (M, D) are only read when there is a prefix (then P_k = dO_k . out_k);
    otherwise they may be empty and P_k = sum_i alpha_ki dO_k . v_i. With a fused output norm
    (`out_norm`, and the forward's h and n), `d_outs` are the cotangents of y."""
    cd = queries.dtype
    K, n, d = queries.shape[0], len(vals), queries.shape[-1]
    has_prefix = prefix_lse is not None
    zall = z if not has_prefix else torch.cat([prefix_lse.reshape(K, 1, -1), z], dim=1)
    alpha = _weights(zall, lse)  # (K, n', M)
    a_src = alpha[:, 1:] if has_prefix else alpha  # (K, n, M)
    m = lse.shape[-1]
    d_o = [torch.zeros(m, d, dtype=cd, device=queries.device) if g is None else g for g in d_outs]
    d_out_norm = None
    if out_norm is not None:  # from the cotangent of y = h * n * w to that of h (K == 1)
        hn = h_inv_rms.reshape(-1, 1)  # (M, 1)
        d_out_norm = (d_o[0] * h * hn).sum(dim=0)
        wdy = d_o[0] * out_norm
        # n^3 / D (wdy . h) h as (n (wdy . h) n / D) (n h): n^3 alone under- or overflows
        d_o[0] = wdy * hn - (hn * torch.linalg.vecdot(wdy, h).unsqueeze(-1) * hn / d) * (h * hn)

    # per token, dO_k . v_i: (K, n, M), through one (M, D) scratch. Per source, not over all n at
    # once: a fresh (n, M, D) temporary per call costs more in page faults than its arithmetic
    # (glibc returns large blocks to the system and maps them anew), one (M, D) tensor does not.
    scratch = torch.empty_like(d_o[0])
    g = z.new_empty((K, n, m))
    for k in range(K):
        for i in range(n):
            torch.sum(torch.mul(vals[i], d_o[k], out=scratch), dim=-1, out=g[k, i])
    ag = (a_src * g).sum(dim=1)  # (K, M)
    P = torch.stack([torch.linalg.vecdot(d_o[k], outs[k]) for k in range(K)]) if has_prefix else ag
    dz = a_src * (g - P.unsqueeze(1))
    if dlse is not None:
        dz = dz + a_src * dlse.reshape(K, 1, -1)
    if dz_ext is not None:
        dz = dz + dz_ext.reshape(K, n, -1)
    d_prefix_h: list[Tensor] = []
    d_prefix_lse = None
    if has_prefix:
        a_pre = alpha[:, 0]
        d_prefix_lse = P - ag - a_pre * P
        if dlse is not None:
            d_prefix_lse = d_prefix_lse + a_pre * dlse.reshape(K, -1)
        d_prefix_h = [d_o[k] * a_pre[k].unsqueeze(-1) for k in range(K)]
    dzr = (dz * r.unsqueeze(0)).permute(1, 2, 0).contiguous()  # (n, M, K)
    # the derivative through r_i, c_i (r_i v_i) with c_i = -(sum_k dz_ki z_ki) r_i / D: r_i^2 alone
    # under- or overflows for |v| beyond ~1e19 or below ~1e-19 in float32, (r_i v_i) and c_i do not
    c = (-(dz * z).sum(dim=0) * r / d).unsqueeze(-1)  # (n, M, 1)
    r_col = r.unsqueeze(-1)  # (n, M, 1)
    a_col = a_src.unsqueeze(-1)  # (K, n, M, 1)
    # dv_i = c_i (r_i v_i) + sum_k alpha_ki dO_k + r_i sum_k dz_ki q_k, one (M, D) tensor per source
    # (as autograd accumulates them), in place, the first term formed in dv_i itself: no (M, D)
    # scratch lives beside the n gradients (the backward's peak). As (c_i r_i) v_i, one pass, where
    # c_i r_i is a normal number; else (r_i v_i) first, then times c_i (the extreme magnitudes above).
    # Under torch.compile always the latter (no data-dependent branch; Inductor fuses the two)
    del scratch
    cr = c * r_col  # (n, M, 1)
    one_pass = not torch.compiler.is_compiling() and bool(
        (torch.isfinite(cr) & ((cr.abs() >= torch.finfo(cd).tiny) | (c == 0))).all())
    dV = []
    for i in range(n):
        dv = torch.mul(vals[i], cr[i]) if one_pass else torch.mul(vals[i], r_col[i]).mul_(c[i])
        for k in range(K):
            dv.addcmul_(d_o[k], a_col[k, i])
        dV.append(dv.addmm_(dzr[i], queries))
    if isinstance(vals, Tensor):
        d_q = dzr.view(-1, K).T @ vals.reshape(-1, d)  # (K, D): one product over all sources
    else:
        d_q = dzr[0].T @ vals[0]
        for i in range(1, n):
            d_q.addmm_(dzr[i].T, vals[i])
    return dV, d_q, d_prefix_h, d_prefix_lse, d_out_norm


SECOND_ORDER_STACKED = (
    "attnres: a second-order gradient (create_graph=True) through depth attention on kernel='torch' reading a "
    "SourceStack buffer (the Block/Full strategies' eager fast path) is not available: the op keeps the buffer's "
    "values, not the sources; use kernel='naive' (residual.kernel=naive), or kernel='cpu' for float32/float64 "
    "CPU tensors"
)


# the C++ and Triton kernels' refusal: a merge's h with the next pre-norm fused in needs the prefix's
# value, which their forward does not keep
SECOND_ORDER_NORMED_MERGE = (
    "attnres: a second-order gradient (create_graph=True) through a merge with the next sublayer's pre-norm "
    "fused in (the Block/Full strategies' fuse_prenorm on kernel='cpu' or 'triton') is not available: set "
    "fuse_prenorm=False on the strategy (residual.fuse_prenorm=false), or use kernel='naive'"
)


def second_order() -> bool:
    """Whether a backward running now builds a graph of its own (create_graph=True: its result
    is differentiated again), so it must run in differentiable operations. Never while torch.compile
    traces: AOTAutograd traces the backward without create_graph."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _inv_rms_with_grad(v: Tensor, eps: float) -> Tensor:
    """`inv_rms` of rows (M, D) -> (M,) with gradients, the rows scaled by a constant
    c = max(1, max|v|) first (as naive.py does) so that no square overflows."""
    c = v.detach().abs().amax(dim=-1).clamp_min(1.0)  # (M,)
    u = v / c.unsqueeze(-1)
    return torch.rsqrt(u.square().mean(dim=-1) + eps / c / c) / c


def differentiable_backward(
    sources: Sequence[Tensor],
    eps: float,
    queries: Tensor,
    z: Tensor,
    lse: Tensor,
    prefix_lse: Tensor | None,
    outs: Sequence[Tensor],
    d_outs: Sequence[Tensor | None],
    dz_ext: Tensor | None,
    dlse: Tensor | None,
    out_norm: Tensor | None = None,
    out_eps: float | None = None,
) -> tuple[list[Tensor], Tensor, list[Tensor], Tensor | None, Tensor | None]:
    """`depth_attention_backward` in differentiable operations, for a backward whose result is
    differentiated again (`second_order`), for every fused path (torch, C++, Triton). Inputs as
    the op's autograd node keeps them: the sources (..., D) and the gain-folded queries (K, D)
    with their autograd history, the op's own outputs z (K, n, ...), lse (K, ...) and, with a
    prefix, `outs` (K of (..., D)), whose history leads back through the op. The key statistics,
    the weights and (with the fused output norm) h are recomputed from those with gradients, so
    every derivative of the result is autograd's. The prefixes' values are not needed: their
    gradient is a_pre dO, and they enter the others only through P_k = dO_k . out_k. Returns
    (d_sources, d_queries (K, D), d_prefix_h (K), d_prefix_lse (K, ...) or None, d_out_norm (D,)
    or None) in the dtypes of what they are gradients of."""
    cd, dtype, shape = queries.dtype, sources[0].dtype, sources[0].shape
    K, n, d = queries.shape[0], len(sources), shape[-1]
    # zeros without storage (gradcheck's) are no cotangent
    d_outs = [None if g is None or g._is_zerotensor() else g for g in d_outs]
    dz_ext, dlse = (None if g is None or g._is_zerotensor() else g for g in (dz_ext, dlse))
    vs = [_rows(v, cd) for v in sources]  # (M, D)
    m = vs[0].shape[0]
    r = torch.stack([_inv_rms_with_grad(v, eps) for v in vs])  # (n, M)
    z = z.to(cd).reshape(K, n, m)
    has_prefix = prefix_lse is not None
    zall = z if not has_prefix else torch.cat([prefix_lse.to(cd).reshape(K, 1, m), z], dim=1)
    alpha = torch.softmax(zall, dim=1)  # (K, n', M)
    a_src = alpha[:, 1:] if has_prefix else alpha
    d_o = [torch.zeros(m, d, dtype=cd, device=queries.device) if g is None else _rows(g, cd) for g in d_outs]
    d_out_norm = None
    if out_norm is not None:  # output 0, no prefix: from the cotangent of y = h * n * w to that of h
        h = sum(a_src[0, i].unsqueeze(-1) * v for i, v in enumerate(vs))
        hn = torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + (eps if out_eps is None else out_eps))  # (M, 1)
        d_out_norm = (d_o[0] * h * hn).sum(dim=0).to(out_norm.dtype)
        wdy = d_o[0] * out_norm.to(cd)
        d_o[0] = wdy * hn - (hn * (wdy * h).sum(dim=-1, keepdim=True) * hn / d) * (h * hn)
    g = torch.stack([torch.stack([(do * v).sum(dim=-1) for v in vs]) for do in d_o])  # (K, n, M): dO_k . v_i
    ag = (a_src * g).sum(dim=1)  # (K, M)
    P = torch.stack([(do * _rows(o, cd)).sum(dim=-1) for do, o in zip(d_o, outs, strict=True)]) if has_prefix else ag
    dz = a_src * (g - P.unsqueeze(1))
    if dlse is not None:
        dz = dz + a_src * dlse.to(cd).reshape(K, 1, m)
    if dz_ext is not None:
        dz = dz + dz_ext.to(cd).reshape(K, n, m)
    d_prefix_h: list[Tensor] = []
    d_prefix_lse = None
    if has_prefix:
        a_pre = alpha[:, 0]  # (K, M)
        d_prefix_lse = P - ag - a_pre * P
        if dlse is not None:
            d_prefix_lse = d_prefix_lse + a_pre * dlse.to(cd).reshape(K, m)
        d_prefix_lse = d_prefix_lse.view(prefix_lse.shape).to(prefix_lse.dtype)
        d_prefix_h = [(do * a_pre[k].unsqueeze(-1)).view(shape).to(dtype) for k, do in enumerate(d_o)]
    dzr = dz * r  # (K, n, M)
    c = -(dz * z).sum(dim=0) * r / d  # (n, M): with (r_i v_i), the derivative through r_i
    d_src = []
    for i, v in enumerate(vs):
        dv = sum(a_src[k, i].unsqueeze(-1) * do for k, do in enumerate(d_o))
        dv = dv + dzr[:, i].T @ queries + c[i].unsqueeze(-1) * (v * r[i].unsqueeze(-1))
        d_src.append(dv.view(shape).to(dtype))
    d_q = sum(dzr[:, i] @ v for i, v in enumerate(vs))  # (K, D)
    return d_src, d_q, d_prefix_h, d_prefix_lse, d_out_norm


class _DepthAttention(torch.autograd.Function):
    """Autograd around the core pair. Saves r, z, lse, and with a prefix the outputs (the
    caller keeps them anyway: they are sublayer inputs); with a fused output norm, its weight,
    h and n. The sources: with `stacked` (their values, kept by the caller in a buffer it
    only ever appends to) a reference to that; otherwise the sources themselves (references),
    read one by one in both directions, never stacked into a copy. A backward that is itself
    differentiated (`second_order`) runs `differentiable_backward` on the sources; with
    `stacked` there are none to differentiate, and it says so (SECOND_ORDER_STACKED)."""

    @staticmethod
    def forward(eps, queries, r_cache, prefix_lse, out_norm, stacked, *tensors):  # sources, then K prefix_h or none
        n = len(tensors) - (0 if prefix_lse is None else queries.shape[0])
        sources, prefix_h = tensors[:n], tensors[n:]
        shape, dtype, cd = sources[0].shape, sources[0].dtype, queries.dtype
        vals = _source_rows(sources, stacked, cd)
        outs, z, lse, r, h, h_inv_rms = depth_attention_forward(
            vals, r_cache, queries, [_rows(p, cd) for p in prefix_h], prefix_lse, eps, out_norm
        )
        stat = shape[:-1]
        outs = [o.view(shape).to(dtype) for o in outs]
        if h is None:  # autograd outputs are tensors: empty ones stand for "no output norm"
            h, h_inv_rms = z.new_empty(0), z.new_empty(0)
        else:
            h, h_inv_rms = h.view(shape).to(dtype), h_inv_rms.view(stat)
        K = queries.shape[0]
        return (*outs, z.view(K, n, *stat), lse.view(K, *stat), r.view(n, *stat), h, h_inv_rms)

    @staticmethod
    def setup_context(ctx, inputs, output):
        eps, queries, r_cache, prefix_lse, out_norm, stacked, *tensors = inputs
        *outs, z, lse, r, h, h_inv_rms = output
        ctx.has_prefix, ctx.K = prefix_lse is not None, queries.shape[0]
        ctx.n = n = len(tensors) - (ctx.K if ctx.has_prefix else 0)
        ctx.has_out_norm, ctx.eps = out_norm is not None, eps
        ctx.shape, ctx.dtype = tensors[0].shape, tensors[0].dtype
        ctx.mark_non_differentiable(r, h, h_inv_rms)
        ctx.set_materialize_grads(False)
        # the caller's buffer: held, not saved, since the caller appends to it in place after
        # this call (rows this call reads are never written again)
        ctx.stacked = stacked
        sources = () if stacked is not None else tensors[:n]
        ctx.save_for_backward(
            queries, r, z, lse, prefix_lse, out_norm, h, h_inv_rms, *sources, *(outs if ctx.has_prefix else ())
        )

    @staticmethod
    def backward(ctx, *grads):
        K, n, shape, dtype = ctx.K, ctx.n, ctx.shape, ctx.dtype
        d_outs, dz_ext, dlse = grads[:K], grads[K], grads[K + 1]
        queries, r, z, lse, prefix_lse, out_norm, h, h_inv_rms, *rest = ctx.saved_tensors
        sources, outs = (rest[:n], rest[n:]) if ctx.stacked is None else (None, rest)
        n_prefix = K if ctx.has_prefix else 0
        if all(g is None for g in d_outs) and dz_ext is None and dlse is None:
            return (None,) * (6 + n + n_prefix)
        if second_order():  # create_graph=True: gradients with a graph of their own
            if sources is None:
                raise RuntimeError(SECOND_ORDER_STACKED)
            d_src, d_q, d_pre_h, d_pre_lse, d_out_norm = differentiable_backward(
                sources, ctx.eps, queries, z, lse, prefix_lse, outs, d_outs, dz_ext, dlse,
                out_norm if ctx.has_out_norm else None,
            )
            return (None, d_q, None, d_pre_lse, d_out_norm, None, *d_src, *d_pre_h)
        cd = queries.dtype
        vals = _source_rows(sources, None, cd) if sources is not None else ctx.stacked.to(cd).reshape(n, -1, shape[-1])
        if not ctx.has_out_norm:
            out_norm = h = h_inv_rms = None
        else:
            h, h_inv_rms = _rows(h, cd), h_inv_rms.reshape(-1)
        rows = [None if g is None else _rows(g, cd) for g in d_outs]
        stat = (K, -1)
        dV, d_q, d_pre_h, d_pre_lse, d_out_norm = depth_attention_backward(
            vals, r.reshape(n, -1), queries, z.reshape(K, n, -1), lse.reshape(stat), None if prefix_lse is None
            else prefix_lse.reshape(stat), [_rows(o, cd) for o in outs], rows,
            None if dz_ext is None else dz_ext.reshape(K, n, -1), None if dlse is None else dlse.reshape(stat),
            out_norm, h, h_inv_rms,
        )
        d_src = [dv.view(shape).to(dtype) for dv in dV]
        d_pre_h = [g.view(shape).to(dtype) for g in d_pre_h]
        if d_pre_lse is not None:
            d_pre_lse = d_pre_lse.view(prefix_lse.shape)
        return (None, d_q, None, d_pre_lse, d_out_norm, None, *d_src, *d_pre_h)


def run_depth_attention(
    sources: Sequence[Tensor],
    r_cache: Tensor | None,
    queries: Tensor,
    prefix_h: Sequence[Tensor] = (),
    prefix_lse: Tensor | None = None,
    eps: float = 1e-6,
    out_norm: Tensor | None = None,
    stacked: Tensor | None = None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Differentiable (outs, z, lse) with respect to sources, queries, prefix_h, prefix_lse and
    out_norm (r_cache is a cached function of the sources, see the module docstring).
    `out_norm`: the (D,) weight of a fused output RMSNorm (one query, no prefix), or None.
    `stacked`: optionally the sources' values as one (n, ...) tensor (a view of a buffer the
    caller appends completed sources to and never rewrites): then the op reads that, saves no
    reference to the sources."""
    if out_norm is not None and (queries.shape[0] != 1 or prefix_lse is not None):
        raise ValueError("a fused output norm takes one query and no prefix")
    tensors = (queries, *sources, *prefix_h) + tuple(t for t in (prefix_lse, out_norm) if t is not None)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        # nothing to differentiate (e.g. prefill): no autograd node, and no Dynamo tracing of one
        with torch.no_grad():
            *outs, z, lse, _, _, _ = _DepthAttention.forward(eps, queries, r_cache, prefix_lse, out_norm, stacked,
                                                             *sources, *prefix_h)
        return list(outs), z, lse
    *outs, z, lse, _, _, _ = _DepthAttention.apply(eps, queries, r_cache, prefix_lse, out_norm, stacked, *sources,
                                                   *prefix_h)
    return outs, z, lse


class _MergeOne(torch.autograd.Function):
    """Phase 2 with one new source (Block AttnRes's partial sum): h = lerp(p, acc, w) with
    w = sigmoid(lse - z_p) the weight of the phase-1 result, z_p = (p . q) r_p. The same math
    as `run_depth_attention` with a prefix, in a few operations instead of a few hundred.
    Saves p and h (references) and three (M,) statistics. Per token, for the cotangent dO:
    dz = (1 - w) (dO . p - dO . h), d_lse = -dz, d_acc = w dO,
    dp = (1 - w) dO + dz r_p q - (dz z_p) r_p^2 / D p, dq = sum over tokens of dz r_p p.
    A backward that is itself differentiated (`second_order`) forms the same from p, lse, the
    query and h (the output, whose history leads back through this op) in differentiable
    operations, r_p, z_p and w recomputed."""

    @staticmethod
    def forward(acc, lse, p, query, eps):
        shape, dtype, cd = p.shape, p.dtype, query.dtype
        pr, ar = _rows(p, cd), _rows(acc, cd)
        r = inv_rms(pr, eps)  # (M,)
        zp = torch.mv(pr, query).mul_(r)
        w = torch.sigmoid(lse.reshape(-1).to(cd) - zp)  # (M,): the phase-1 result's share
        h = torch.lerp(pr, ar, w.unsqueeze(-1))
        return h.view(shape).to(dtype), r, zp, w

    @staticmethod
    def setup_context(ctx, inputs, output):
        acc, lse, p, query, eps = inputs
        h, r, zp, w = output
        ctx.mark_non_differentiable(r, zp, w)
        ctx.set_materialize_grads(False)
        ctx.lse_shape, ctx.eps = lse.shape, eps
        ctx.save_for_backward(p, h, query, r, zp, w, lse)

    @staticmethod
    def backward(ctx, dh, *_):
        if dh is None:
            return None, None, None, None, None
        p, h, query, r, zp, w, lse = ctx.saved_tensors
        shape, dtype, cd, d = p.shape, p.dtype, query.dtype, p.shape[-1]
        pr, hr, do = _rows(p, cd), _rows(h, cd), _rows(dh, cd)
        if second_order():  # create_graph=True: the statistics again, with gradients
            r = _inv_rms_with_grad(pr, ctx.eps)
            zp = (pr @ query) * r
            w = torch.sigmoid(lse.reshape(-1).to(cd) - zp)
            a_p = 1.0 - w
            dz = a_p * ((do * pr).sum(dim=-1) - (do * hr).sum(dim=-1))
            dzr = dz * r
            c = (-(dz * zp) * r / d).unsqueeze(-1)
            dp = do * a_p.unsqueeze(-1) + dzr.unsqueeze(-1) * query + (pr * r.unsqueeze(-1)) * c
            d_acc = (do * w.unsqueeze(-1)).view(shape).to(dtype)
            d_lse = (-dz).view(ctx.lse_shape).to(lse.dtype)
            return d_acc, d_lse, dp.view(shape).to(dtype), pr.T @ dzr, None
        a_p = 1.0 - w
        dz = a_p * (torch.linalg.vecdot(do, pr) - torch.linalg.vecdot(do, hr))  # (M,)
        dzr = dz * r
        dp = do * a_p.unsqueeze(-1)
        # the derivative through r_p as (r_p p) times -(dz z_p) r_p / D: r_p^2 alone under- or overflows
        c = (-(dz * zp) * r / d).unsqueeze(-1)
        dp.addmm_(dzr.unsqueeze(-1), query.unsqueeze(0)).addcmul_(pr * r.unsqueeze(-1), c)
        d_acc = (do * w.unsqueeze(-1)).view(shape).to(dtype)
        d_q = torch.mv(pr.T, dzr)
        return d_acc, (-dz).view(ctx.lse_shape), dp.view(shape).to(dtype), d_q, None


def merge_one(acc: Tensor, lse: Tensor, source: Tensor, query: Tensor, eps: float) -> Tensor:
    """Phase 2 for one new source: `run_depth_attention([source], None, query[None], (acc,),
    lse[None], eps)`'s output, differentiable with respect to acc, lse, source and query
    (gain-folded, compute dtype)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (acc, lse, source, query)):
        return _MergeOne.apply(acc, lse, source, query, eps)[0]
    with torch.no_grad():
        return _MergeOne.forward(acc, lse, source, query, eps)[0]


def mix_one(sources: Sequence[Tensor], queries: Tensor, row: int, eps: float) -> Tensor:
    """h of row `row` of the gain-folded queries (K, D) over `sources` (..., D), without gradient,
    in a handful of operations on the stacked sources: the strategies' one-pass route (decoding, a
    few tokens, where each operation's fixed cost is what counts and the stack is a few rows).
    Rounded once to the sources' dtype."""
    v = torch.stack(sources).to(queries.dtype)  # (n, ..., D)
    z = torch.matmul(v, queries[row]).mul_(inv_rms(v, eps))  # (n, ...)
    return (torch.softmax(z, dim=0).unsqueeze(-1) * v).sum(dim=0).to(sources[0].dtype)


def fold_queries(pseudo_query: Tensor, norm_weight: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Queries (..., D) with the key-norm gain folded in, in the statistics dtype of sources of
    `dtype` (float32 for half inputs): w . RMSNorm(v) = ((g * w) . v) * r."""
    cd = compute_dtype(dtype)
    q = pseudo_query.to(cd)
    return q if norm_weight is None else q * norm_weight.to(cd)


def attend(
    run: Callable,
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    output_norm_weight: Tensor | None = None,
):
    """`fused_depth_attention` on a `run_depth_attention` (this module's, or the Triton one): one
    query, no prefix, the weights as the reference computes them (exactly uniform for equal
    logits), rounded once to the sources' dtype."""
    query = fold_queries(pseudo_query, norm_weight, sources[0].dtype)
    out_norm = None if output_norm_weight is None else output_norm_weight.to(query.dtype)
    outs, z, _ = run(list(sources), None, query.unsqueeze(0), eps=eps, out_norm=out_norm)
    return outs[0], torch.softmax(z[0], dim=0).to(sources[0].dtype)


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
    With `output_norm_weight` (D,), h is RMSNorm(h) * output_norm_weight instead.
    Inputs are not validated here: `attnres.functional` does that once, at the
    public boundary.
    """
    return attend(run_depth_attention, sources, pseudo_query, norm_weight, eps, output_norm_weight)
