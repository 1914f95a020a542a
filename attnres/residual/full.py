"""Full Attention Residuals (Kimi Team, arXiv 2603.15031).

Sublayer l reads depth attention over [e, f_0(h_0), ..., f_{l-1}(h_{l-1})] with its own
zero-initialised pseudo-query; the output aggregates over e and all L outputs.
Memory O(L * D) per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from attnres.residual.base import DepthAttentionResidual, Sublayer


class FullAttentionResidual(DepthAttentionResidual):
    """Full AttnRes as a drop-in module: `forward(embedding, sublayers, **kw)` or
    `forward(encoder, src, mask=None, src_key_padding_mask=None, is_causal=None)`.

    Owns `num_layers + 1` pseudo-queries and key norms; the last is the output
    aggregation, which `forward` returns (DESIGN.md section 2, "Output").
    """

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        eps: float = 1e-6,
        key_norm_gain: bool = True,
        output_aggregation: bool = True,
    ) -> None:
        super().__init__(d_model, num_layers, eps, key_norm_gain, output_aggregation)

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        sources = [embedding]  # each (B, T, D)
        for index, sublayer in enumerate(sublayers):
            h = self.attend(index, sources)
            sources.append(self.call_sublayer(index, sublayer, h, sublayer_kwargs))
        return self.output(sources)
