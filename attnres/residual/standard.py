"""The standard PreNorm residual: h_0 = e, h_{l+1} = h_l + f_l(h_l), output h_L."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from attnres.residual.base import ResidualStrategy, Sublayer


class StandardResidual(ResidualStrategy):
    """The baseline every AttnRes variant is compared against. No parameters."""

    def __init__(self, d_model: int, num_layers: int, eps: float = 1e-6) -> None:
        super().__init__(d_model, num_layers, eps)

    def depth_layout(self) -> tuple[str, list[str], str]:
        return "Standard residual", [], ""

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        h = embedding  # (B, T, D)
        for index, sublayer in enumerate(sublayers):
            h = h + self.call_sublayer(index, sublayer, h, sublayer_kwargs)
        return h
