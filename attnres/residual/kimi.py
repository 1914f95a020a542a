"""Kimi K3's AttnRes parameters in and out of a `BlockAttentionResidual`.

The released K3 (July 2026; docs/strategies.md, "The released model") names its depth-routing
parameters per decoder layer i, two sites each, plus one site before the final norm:

    model.layers.{i}.self_attention_res_proj.weight   (1, D)   site 2 i      (before attention)
    model.layers.{i}.self_attention_res_norm.weight   (D,)
    model.layers.{i}.mlp_res_proj.weight              (1, D)   site 2 i + 1  (before the MLP)
    model.layers.{i}.mlp_res_norm.weight              (D,)
    model.output_attn_res_proj.weight                 (1, D)   site L = 2 n_layer (the output)
    model.output_attn_res_norm.weight                 (D,)

optionally under `language_model.` (a multimodal checkpoint). K3's logit is
proj . (v * rsqrt(mean(v^2) + eps)) * norm_weight, which is this project's w . RMSNorm_g(v) with
w the projection's row and g the norm weight: site l's projection is row l of `pseudo_query`,
its norm weight row l of `key_norm_weight`. Nothing is transposed or rescaled.

`load_kimi_attn_res` copies a K3-format state dict's tensors into a strategy (any other keys are
ignored, so a whole checkpoint can be passed); `kimi_attn_res_state_dict` writes them back out;
`kimi_block_attention_residual` builds the strategy a K3 state dict and its
`attn_res_block_size` describe (`BlockAttentionResidual(block_size_layers=...)`, eps 1e-5).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from attnres.residual.block import BlockAttentionResidual

OUTPUT_PROJ = "output_attn_res_proj.weight"
OUTPUT_NORM = "output_attn_res_norm.weight"
SITES = ("self_attention", "mlp")  # a layer's two sites, in order: before attention, before the MLP
KIMI_EPS = 1e-5  # K3's rms_norm_eps


def kimi_prefix(state_dict: Mapping[str, Tensor]) -> str:
    """The prefix in front of `layers.` and `output_attn_res_*` in a K3-format state dict:
    "model." or "language_model.model." (any prefix ending in "model." is taken)."""
    found = sorted({k[: -len(OUTPUT_PROJ)] for k in state_dict if k.endswith("model." + OUTPUT_PROJ)})
    if len(found) != 1:
        what = "no key" if not found else f"{len(found)} keys ({', '.join(p + OUTPUT_PROJ for p in found)})"
        raise ValueError(f"a K3-format state dict has one '...model.{OUTPUT_PROJ}'; found {what}")
    return found[0]


def kimi_names(num_layers: int, prefix: str = "model.") -> list[tuple[str, str]]:
    """(projection key, norm key) of each of the `num_layers + 1` sites, in site order."""
    if num_layers % 2:
        raise ValueError(f"K3 has two sites per decoder layer; num_layers={num_layers} sublayers is odd")
    names = []
    for layer in range(num_layers // 2):
        for site in SITES:
            base = f"{prefix}layers.{layer}.{site}_res_"
            names.append((base + "proj.weight", base + "norm.weight"))
    names.append((prefix + OUTPUT_PROJ, prefix + OUTPUT_NORM))
    return names


def kimi_num_layers(state_dict: Mapping[str, Tensor]) -> tuple[int, int]:
    """(sublayers L, width D) of the AttnRes tensors of a K3-format state dict."""
    prefix = kimi_prefix(state_dict)
    layers = {int(k[len(prefix) + 7:].split(".", 1)[0]) for k in state_dict
              if k.startswith(prefix + "layers.") and k.endswith("_res_proj.weight")}
    if layers != set(range(len(layers))):
        raise ValueError(f"the K3 state dict's layers with AttnRes tensors are not 0 .. n-1: {sorted(layers)}")
    return 2 * len(layers), state_dict[prefix + OUTPUT_PROJ].shape[-1]


def _check(residual: BlockAttentionResidual) -> None:
    if not isinstance(residual, BlockAttentionResidual):
        raise TypeError(f"K3's AttnRes is Block AttnRes; got {type(residual).__name__}")
    if residual.pseudo_query is None or residual.key_norm_weight is None:
        raise ValueError("K3's AttnRes has a static pseudo-query and a key-norm gain per site: build the strategy "
                         "with query='static', mixing='attention', key_norm=True and key_norm_gain=True")


@torch.no_grad()
def load_kimi_attn_res(residual: BlockAttentionResidual, state_dict: Mapping[str, Tensor]) -> list[str]:
    """Copy a K3-format state dict's AttnRes tensors into `residual`'s `pseudo_query` and
    `key_norm_weight` rows (cast to their dtype). All 2 (L + 1) tensors must be there with the
    right shapes, and the state dict must have exactly L / 2 layers of them. Returns the keys read."""
    _check(residual)
    L, D = residual.num_layers, residual.d_model
    layers, width = kimi_num_layers(state_dict)
    if (layers, width) != (L, D):
        raise ValueError(f"the K3 state dict has {layers // 2} layers ({layers} sublayers) of width {width}; the "
                         f"strategy has {L} sublayers of width {D}")
    names = kimi_names(L, kimi_prefix(state_dict))
    missing = [k for pair in names for k in pair if k not in state_dict]
    if missing:
        raise KeyError(f"the K3 state dict lacks {len(missing)} AttnRes tensors, e.g. {missing[0]}")
    for row, (proj, norm) in enumerate(names):
        for key, shape in ((proj, (1, D)), (norm, (D,))):
            if tuple(state_dict[key].shape) != shape:
                raise ValueError(f"{key} has shape {tuple(state_dict[key].shape)}, expected {shape}")
        residual.pseudo_query[row].copy_(state_dict[proj][0])
        residual.key_norm_weight[row].copy_(state_dict[norm])
    return [k for pair in names for k in pair]


@torch.no_grad()
def kimi_attn_res_state_dict(residual: BlockAttentionResidual, prefix: str = "model.",
                             dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """`residual`'s pseudo-queries and key-norm gains under K3's names (`prefix` "model." or
    "language_model.model."), projections (1, D) and norm weights (D,), in `dtype` (default
    theirs; K3 stores bfloat16). New tensors, detached."""
    _check(residual)
    dtype = dtype or residual.pseudo_query.dtype
    out = {}
    for row, (proj, norm) in enumerate(kimi_names(residual.num_layers, prefix)):
        out[proj] = residual.pseudo_query[row].detach().to(dtype).clone().unsqueeze(0)
        out[norm] = residual.key_norm_weight[row].detach().to(dtype).clone()
    return out


def kimi_block_attention_residual(state_dict: Mapping[str, Tensor], attn_res_block_size: int,
                                  **options) -> BlockAttentionResidual:
    """The Block AttnRes a K3-format state dict and its config's `attn_res_block_size` (decoder
    layers per block) describe, with its parameters loaded: L and D from the tensors, eps 1e-5
    (K3's `rms_norm_eps`) unless `options` say otherwise, on the CPU in float32."""
    L, D = kimi_num_layers(state_dict)
    residual = BlockAttentionResidual(D, L, block_size_layers=attn_res_block_size, **{"eps": KIMI_EPS, **options})
    load_kimi_attn_res(residual, state_dict)
    return residual
