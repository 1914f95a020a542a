"""`attnres.TransformerEncoder`: `torch.nn.TransformerEncoder` with a choice of residual.

The form the PyTorch RFC proposes: `nn.TransformerEncoder`'s constructor plus `residual`
("standard", "block_attention" or "full_attention") and `attn_residual_num_blocks`, so that
replacing `nn.TransformerEncoder` by this class changes nothing until `residual=` is given:
with "standard", `forward` is `nn.TransformerEncoder.forward` itself (its nested-tensor and
fused fast path included), and there are no extra parameters or state_dict keys.

With "block_attention" / "full_attention" the encoder owns a `BlockAttentionResidual` /
`FullAttentionResidual` over its 2 * num_layers sublayers as `self.attn_residual` (so
`state_dict`, `.to()` and `parameters()` include its pseudo-queries and key norms), and
`forward(src, mask, src_key_padding_mask, is_causal)` is `self.attn_residual(self, src, ...)`:
each layer's attention and feed-forward halves run as pre-norm sublayers (whatever the
layers' `norm_first` says), AttnRes takes the place of the residual adds, and the encoder's
own `norm`, if any, is applied to the output aggregation (DESIGN.md section 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from attnres.residual.block import DEFAULT_NUM_BLOCKS, BlockAttentionResidual
from attnres.residual.full import FullAttentionResidual

RESIDUALS = ("standard", "block_attention", "full_attention")


class TransformerEncoder(nn.TransformerEncoder):
    """`torch.nn.TransformerEncoder` with `residual=` (module docstring).

    `attn_residual_num_blocks` is Block AttnRes's N (it must divide 2 * num_layers), or
    give `block_sizes`, the sublayers per block (positive, summing to 2 * num_layers: a
    shorter last block, say), which wins over the default N. Both only apply to
    `residual="block_attention"`.
    """

    def __init__(
        self,
        encoder_layer: nn.TransformerEncoderLayer,
        num_layers: int,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        residual: str = "standard",
        attn_residual_num_blocks: int = DEFAULT_NUM_BLOCKS,
        block_sizes: Sequence[int] | None = None,
    ) -> None:
        if residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {', '.join(map(repr, RESIDUALS))}, got {residual!r}")
        if block_sizes is not None and residual != "block_attention":
            raise ValueError(f"block_sizes applies to residual='block_attention' only, not residual={residual!r}")
        attn_residual = None
        if residual != "standard":  # built first: a bad configuration raises before any layer is copied
            if not isinstance(encoder_layer, nn.TransformerEncoderLayer):
                raise TypeError(
                    f"residual={residual!r} runs the attention and feed-forward halves of "
                    f"torch.nn.TransformerEncoderLayer, got {type(encoder_layer).__name__}"
                )
            d_model, sublayers = encoder_layer.self_attn.embed_dim, 2 * num_layers
            if residual == "block_attention":
                try:
                    attn_residual = BlockAttentionResidual(
                        d_model, sublayers, num_blocks=attn_residual_num_blocks, block_sizes=block_sizes
                    )
                except ValueError as err:  # name the keyword this constructor takes
                    raise ValueError(f"attn_residual_num_blocks={attn_residual_num_blocks}: {err}") from None
            else:
                attn_residual = FullAttentionResidual(d_model, sublayers)
            # the queries and key norms live where the layers do
            p = next(encoder_layer.parameters(), None)
            if p is not None:
                attn_residual.to(device=p.device, dtype=p.dtype)
        super().__init__(encoder_layer, num_layers, norm, enable_nested_tensor, mask_check)
        self.residual = residual
        self.attn_residual = attn_residual  # None with "standard": no parameters, no state_dict keys

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        if self.attn_residual is None:
            return super().forward(src, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        return self.attn_residual(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)

    def extra_repr(self) -> str:
        return f"residual={self.residual!r}"
