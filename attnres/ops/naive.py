"""Depth attention, the reference implementation (DESIGN.md section 2).

    logit_i = w . RMSNorm(v_i)        per token, no 1/sqrt(D)
    alpha   = softmax over i          per token, over the source (depth) axis
    h       = sum_i alpha_i * v_i     values are the raw sources

Written for clarity and to avoid needless copies: the sources stay a list (never
stacked into an (S, B, T, D) tensor), each source is normalised exactly once and
only implicitly -- w . (v * r * g) == (v . (g * w)) * r with r = 1 / rms(v) -- so
the normalised keys are never materialised. Statistics, logits and the softmax
are float32 for half-precision inputs; both results have the input dtype.

`output_norm_weight` (D,): return RMSNorm(h) * weight (eps the op's, statistics in the
compute dtype, applied to h before it is rounded) in place of h, so that the next
sublayer's pre-norm is folded into the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_depth_attention(
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
    compute_dtype = torch.promote_types(sources[0].dtype, torch.float32)
    query = pseudo_query.to(compute_dtype)
    if norm_weight is not None:
        query = query * norm_weight.to(compute_dtype)  # fold the key-norm gain into the query
    logits = []
    for v in sources:  # v: (..., D)
        v32 = v.to(compute_dtype)
        # w . RMSNorm(v) is unchanged when v is divided by any c > 0 and eps by c^2. Dividing by
        # c = max(1, max|v|) keeps the squares from overflowing (bf16 or float32 values past
        # ~1e19 square to inf in float32); c is a constant of the function, hence detached.
        c = v32.detach().abs().amax(dim=-1, keepdim=True).clamp_min(1.0)  # (..., 1)
        u = v32 / c
        inv_rms = torch.rsqrt(u.pow(2).mean(dim=-1) + eps / c.squeeze(-1).pow(2))  # (...): c / rms(v)
        logits.append((u * query).sum(dim=-1) * inv_rms)  # (...)
    weights = torch.softmax(torch.stack(logits), dim=0)  # (S, ...)
    h = weights[0].unsqueeze(-1) * sources[0].to(compute_dtype)
    for alpha, v in zip(weights[1:], sources[1:], strict=True):
        h = h + alpha.unsqueeze(-1) * v.to(compute_dtype)
    if output_norm_weight is not None:  # the next sublayer's pre-norm, before h is rounded
        h = F.rms_norm(h, (h.shape[-1],), output_norm_weight.to(compute_dtype), eps)
    return h.to(sources[0].dtype), weights.to(sources[0].dtype)
