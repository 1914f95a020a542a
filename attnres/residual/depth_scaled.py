"""A control for Block AttnRes: the standard residual with depth-scaled branches.

    h_0 = e,   h_{l+1} = h_l + m * f_l(h_l),   m = (base_depth / n_layer) ** depth_alpha,

with n_layer = L / 2 Transformer layers; the output is h_L. m is CompleteP's residual-branch
multiplier (Dey et al., arXiv 2505.01618), the rule `parametrization="mup"` already applies to
every sublayer output (`attnres.parametrization.branch_multiplier`, used here, not restated),
taken alone under the standard parametrization: no width rules, no learning-rate factors. So
it bounds how fast the hidden state grows with depth, by a fixed multiplier and without any
mix of sources: the scale's side of "routing or scale?". At `base_depth` layers m = 1 and this
is the standard residual exactly; `depth_alpha=1` is CompleteP's choice (0.5: depth-muP).

Under `parametrization="mup"` with a `base_depth` of the model's own, the model multiplies
the sublayer outputs by its own m too; both then apply (compare the controls under the
standard parametrization, as the depth study does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from attnres.parametrization import branch_multiplier
from attnres.residual.base import ResidualStrategy, Sublayer


class DepthScaledResidual(ResidualStrategy):
    """h_{l+1} = h_l + m f_l(h_l) with CompleteP's m = (base_depth / (L / 2)) ** depth_alpha
    (module docstring). `base_depth`: the Transformer layers (2 sublayers each) at which m = 1.
    No parameters."""

    def __init__(self, d_model: int, num_layers: int, base_depth: int = 4, depth_alpha: float = 1.0,
                 eps: float = 1e-6) -> None:
        super().__init__(d_model, num_layers, eps)
        if isinstance(base_depth, bool) or not isinstance(base_depth, int) or base_depth < 1:
            raise ValueError(f"base_depth={base_depth!r} must be a positive int: the Transformer layers at which "
                             "the branch multiplier is 1 (the shallowest depth a study compares)")
        if isinstance(depth_alpha, bool) or not isinstance(depth_alpha, (int, float)) or not 0 <= depth_alpha <= 1:
            raise ValueError(f"depth_alpha={depth_alpha!r} must be a number from 0 to 1 (1: CompleteP, 0.5: depth-muP, "
                             "0: no scaling)")
        self.base_depth, self.depth_alpha = base_depth, float(depth_alpha)
        self.branch_multiplier = branch_multiplier(num_layers / 2, base_depth, self.depth_alpha)

    def depth_layout(self) -> tuple[str, list[str], str]:
        return f"Standard residual, branches x {self.branch_multiplier:.3g}", [], ""

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        m = self.branch_multiplier
        h = embedding  # (B, T, D)
        for index, sublayer in enumerate(sublayers):
            h = h + m * self.call_sublayer(index, sublayer, h, sublayer_kwargs)
        return h

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_layers={self.num_layers}, base_depth={self.base_depth}, "
                f"depth_alpha={self.depth_alpha}, branch_multiplier={self.branch_multiplier:.4g}")
