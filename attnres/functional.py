"""Functional depth attention: the public ops (DESIGN.md section 2).

`depth_attention` is the one operation both AttnRes variants share; `full_attn_res`
and `block_attn_res` are its two public forms. Inputs are validated here, once, and
then handed to an implementation in `attnres.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from attnres.ops import naive_depth_attention

__all__ = ["block_attn_res", "depth_attention", "full_attn_res"]


def _check(sources: Sequence[Tensor], pseudo_query: Tensor, norm_weight: Tensor | None, eps: float) -> None:
    if not sources:
        raise ValueError("depth attention needs at least one source, got none")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    first = sources[0]
    if first.dim() != 3:
        raise ValueError(f"sources must be (B, T, D) tensors, source 0 has shape {tuple(first.shape)}")
    for i, v in enumerate(sources[1:], start=1):
        if v.shape != first.shape:
            raise ValueError(
                f"all sources must share one shape: source 0 is {tuple(first.shape)}, source {i} is {tuple(v.shape)}"
            )
        if v.dtype != first.dtype or v.device != first.device:
            raise ValueError(
                f"all sources must share dtype and device: source 0 is {first.dtype} on {first.device}, "
                f"source {i} is {v.dtype} on {v.device}"
            )
    d = first.shape[-1]
    if pseudo_query.shape != (d,):
        raise ValueError(f"pseudo_query must have shape ({d},) to match D={d}, got {tuple(pseudo_query.shape)}")
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must have shape ({d},) to match D={d}, got {tuple(norm_weight.shape)}")


def depth_attention(
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Softmax attention over the depth axis.

    `sources`: S >= 1 tensors (B, T, D) of one dtype and device; `pseudo_query`: (D,);
    `norm_weight`: optional (D,) key RMSNorm gain. Returns `(h, weights)` with h (B, T, D)
    in the sources' dtype and weights (S, B, T) in float32 (float64 for float64 inputs).
    """
    sources = list(sources)
    _check(sources, pseudo_query, norm_weight, eps)
    return naive_depth_attention(sources, pseudo_query, norm_weight, eps)


def full_attn_res(
    embedding: Tensor,
    previous_outputs: Tensor | Sequence[Tensor],
    pseudo_query: Tensor,
    eps: float = 1e-6,
) -> dict[str, Tensor]:
    """Full AttnRes input for one sublayer: depth attention over `[embedding, *previous_outputs]`.

    `embedding`: (B, T, D); `previous_outputs`: a (layers, B, T, D) tensor or a sequence of
    (B, T, D) tensors (layers may be 0); `pseudo_query`: (D,). No key-norm gain.
    Returns {"retrieved_representation": (B, T, D), "attention_weights": (S, B, T)} with
    S = layers + 1; the weights sum to 1 per token.
    """
    if isinstance(previous_outputs, Tensor):
        if previous_outputs.dim() != 4:
            raise ValueError(
                "previous_outputs as a tensor must be (layers, B, T, D), "
                f"got shape {tuple(previous_outputs.shape)}"
            )
        previous_outputs = list(previous_outputs.unbind(0))  # views, no copy
    h, weights = depth_attention([embedding, *previous_outputs], pseudo_query, None, eps)
    return {"retrieved_representation": h, "attention_weights": weights}


def block_attn_res(
    blocks: Sequence[Tensor],
    partial_block: Tensor | None,
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block AttnRes input for one sublayer: depth attention over `blocks + [partial_block]`.

    `blocks`: the completed blocks, `blocks[0]` being the embedding; `partial_block`: the
    running sum of the current block's outputs, or None when the block has none yet (an
    empty partial sum is left out, never attended to as zeros). Returns h (B, T, D), or
    `(h, weights)` with weights (S, B, T) when `return_weights`.
    """
    sources = [*blocks] if partial_block is None else [*blocks, partial_block]
    h, weights = depth_attention(sources, pseudo_query, norm_weight, eps)
    return (h, weights) if return_weights else h

