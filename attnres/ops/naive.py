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

`naive_generalized_depth_attention` is the same operation with the paper's ablation options
(per-token queries, sigmoid scoring, no key norm, several heads); it is what the AttnRes
strategies run when one of those options is set.
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


def naive_generalized_depth_attention(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    scoring: str = "softmax",
    heads: int = 1,
    key_norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Depth attention with the paper's ablation options (arXiv 2603.15031, ablation study);
    the defaults compute what `naive_depth_attention` does.

    `query`: (D,), or (..., D) of the sources' shape, one query per token (the input-dependent
    query). `heads` H splits D into H groups of D / H channels, each with its own logits, its
    own key RMS statistic over its group and its own normalisation over the sources.
    `key_norm=False` takes logits from the raw sources. `scoring="sigmoid"` weighs source i by
    sigmoid(logit_i) / sum_j sigmoid(logit_j), computed as a softmax of log-sigmoids (the same
    ratio, without underflow). `norm_weight` (D,) scales the keys, normalised or not.
    Returns `(h, weights)` in the sources' dtype: h (..., D); weights (S, ...), the mean over
    heads, so they still sum to 1 over S.
    """
    compute_dtype = torch.promote_types(sources[0].dtype, torch.float32)
    split = (heads, sources[0].shape[-1] // heads)  # D -> (H, D / H)
    q = query.to(compute_dtype)
    if norm_weight is not None:
        q = q * norm_weight.to(compute_dtype)  # fold the key gain into the query, as above
    q = q.unflatten(-1, split)  # (H, D/H) or (..., H, D/H)
    logits = []
    for v in sources:
        u = v.to(compute_dtype).unflatten(-1, split)  # (..., H, D/H)
        if not key_norm:
            logits.append((u * q).sum(dim=-1))  # (..., H)
            continue
        c = u.detach().abs().amax(dim=-1, keepdim=True).clamp_min(1.0)  # overflow guard, as above
        u = u / c
        inv_rms = torch.rsqrt(u.pow(2).mean(dim=-1) + eps / c.squeeze(-1).pow(2))  # (..., H)
        logits.append((u * q).sum(dim=-1) * inv_rms)
    scores = torch.stack(logits)  # (S, ..., H)
    if scoring == "sigmoid":
        scores = F.logsigmoid(scores)
    weights = torch.softmax(scores, dim=0)  # (S, ..., H)
    h = sum(w.unsqueeze(-1) * v.to(compute_dtype).unflatten(-1, split) for w, v in zip(weights, sources, strict=True))
    return h.flatten(-2).to(sources[0].dtype), weights.mean(dim=-1).to(sources[0].dtype)
