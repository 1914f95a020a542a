"""Kimi K3's AttnRes re-expressed in float64, from its description alone (../shared/PAPER.md,
"The released model"), for the tests of the K3 layout, numerics and parameters.

The mix: the sources (completed blocks, then the current partial sum) are upcast; keys are the
sources times rsqrt(mean of squares + eps), without the norm weight; the norm weight multiplies
the projection instead (query = weight * proj); scores and softmax over the sources; the output is
the weighted sum of the upcast sources. K3 does this in float32 and casts back; here it is float64
and the caller compares the kernel's rounded result with the unrounded float64 one.

The schedule: decoder layer i mixes before attention and before the MLP; blocks start at the
layers 0, k, 2k, ... (k = `attn_res_block_size`, in layers); block sums hold sublayer outputs
only, in the model dtype; the embedding is source 0 on its own; one more mix before the final norm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

K3_EPS = 1e-5


def k3_mix(sources: Sequence[Tensor], proj: Tensor, norm_weight: Tensor, eps: float = K3_EPS) -> tuple[Tensor, Tensor]:
    """(h, weights): h (..., D) float64, weights (S, ...) float64. `proj` (1, D) or (D,), `norm_weight` (D,)."""
    v = torch.stack([s.to(torch.float64) for s in sources])  # (S, ..., D), upcast
    keys = v * torch.rsqrt(v.square().mean(dim=-1, keepdim=True) + eps)  # no norm weight on the keys
    query = norm_weight.to(torch.float64) * proj.to(torch.float64).reshape(-1)  # the weight on the query
    weights = torch.softmax((keys * query).sum(dim=-1), dim=0)  # (S, ...)
    return (weights.unsqueeze(-1) * v).sum(dim=0), weights


def k3_sources_per_site(n_layer: int, attn_res_block_size: int) -> list[list[str]]:
    """The sources each of the 2 n_layer + 1 sites mixes, by name ("emb", "block 1", ...,
    "partial"), as the description has them."""
    sites, blocks, partial = [], ["emb"], False
    for layer in range(n_layer):
        for site in ("attention", "mlp"):
            if site == "attention" and layer > 0 and layer % attn_res_block_size == 0:
                blocks, partial = [*blocks, f"block {len(blocks)}"], False  # the partial sum closes
            sites.append([*blocks, *(["partial"] if partial else [])])
            partial = True  # the sublayer's output joins the partial sum
    sites.append([*blocks, f"block {len(blocks)}"])  # the output: every block, the last one included
    return sites


def k3_replay(embedding: Tensor, outputs: Sequence[Tensor], n_layer: int, attn_res_block_size: int,
              mix: Callable[[int, list[Tensor]], Tensor]) -> list[Tensor]:
    """Each site's float64 mix, `mix(site, sources)`, over the sources K3 would build from the
    embedding and the sublayer outputs `outputs` (what a run produced, in the model dtype): block
    sums added in the model dtype, in the order K3 adds them."""
    results, blocks, partial = [], [embedding], None
    for layer in range(n_layer):
        for site in range(2):
            index = 2 * layer + site
            if site == 0 and layer > 0 and layer % attn_res_block_size == 0:
                blocks, partial = [*blocks, partial], None
            results.append(mix(index, blocks if partial is None else [*blocks, partial]))
            partial = outputs[index] if partial is None else partial + outputs[index]
    results.append(mix(2 * n_layer, [*blocks, partial]))
    return results


def bf16_bound(expected: Tensor, dtype: torch.dtype, scale: Tensor | None = None, ulps: float = 0.5) -> Tensor:
    """Per element, what `ulps` units in the last place of `dtype` allow around the float64
    `expected` (0.5: a correct rounding), plus float32 arithmetic's own error relative to `scale`
    (the magnitude of what was summed: for a weighted sum, sum_i alpha_i |v_i|; default |expected|),
    plus the subnormal spacing."""
    info = torch.finfo(dtype)
    stat = 1e-12 if dtype == torch.float64 else 2e-6
    scale = expected.abs() if scale is None else scale
    return ulps * info.eps * expected.abs() + stat * scale + info.smallest_normal * info.eps


def mix_scale(sources: Sequence[Tensor], weights: Tensor) -> Tensor:
    """sum_i alpha_i |v_i| (..., D): the magnitude of a weighted sum's terms, for `bf16_bound`."""
    return sum(w.unsqueeze(-1) * s.to(torch.float64).abs() for w, s in zip(weights, sources, strict=True))
