"""DenseFormer (Pagliardini et al., "DenseFormer: Enhancing Information Flow in Transformers via
Depth Weighted Averaging", arXiv 2402.02622, 2024).

A Transformer layer (block) is two sublayers with the standard residual inside it:
`a = x + f_{2k}(x)`, `X_{k+1} = a + f_{2k+1}(a)`. After block i (1-based, i = 1 .. d with
d = L / 2) a Depth Weighted Average (DWA, paper section 3) mixes the embedding X_0 and the
block outputs so far with learned scalars: `Y_i = sum_j alpha_{i,j} X_j`; block i + 1 reads
`Y_i` and the network outputs `Y_d`. `alpha_{i,i} = 1` and every other weight 0 at
initialisation, so the model starts as the standard residual exactly.

Dilation k and period p (section 3.2, where Figure 1's caption points; "k x p-DenseFormer",
1 x 1 being the dense default):
DWA_i averages only over `{X_j : j <= i, j = i (mod k)}`, and a DWA module follows block i only
when p divides i (otherwise `Y_i = X_i`).
Parameters: `sum over i in 1..d with p | i of (floor(i / k) + 1)`; k = p = 1 gives d (d + 3) / 2.
Memory per token: the d block outputs are kept for later averages, O(d * D) = O(L * D / 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnres.labels import sublayer_label
from attnres.residual.base import ResidualStrategy, Sublayer


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (1 = the paper's dense default), got {value!r}")


class DenseFormerResidual(ResidualStrategy):
    """DenseFormer as a residual strategy: `dilation` (k) and `period` (p) as in the module
    docstring. `num_layers` (sublayers) must be even: a block is an attention and an MLP.

    `dwa_weight[m]` holds the weights of the m-th DWA module (the one after block
    `dwa_blocks[m]`), ordered by source: ascending j over `dwa_sources(i)`, last = the block
    itself (initialised to 1, the rest to 0).
    """

    has_depth_attention = True

    def __init__(self, d_model: int, num_layers: int, dilation: int = 1, period: int = 1, eps: float = 1e-6) -> None:
        super().__init__(d_model, num_layers, eps)
        if num_layers % 2 != 0:
            raise ValueError(
                f"DenseFormer averages after whole transformer layers (attention + MLP), so num_layers={num_layers} "
                f"sublayers must be even (2 * n_layer)"
            )
        _check_count("dilation", dilation)
        _check_count("period", period)
        self.dilation, self.period = dilation, period
        self.num_blocks = num_layers // 2  # d
        self.dwa_blocks = tuple(i for i in range(1, self.num_blocks + 1) if i % period == 0)
        self.dwa_weight = nn.ParameterList(nn.Parameter(torch.zeros(len(self.dwa_sources(i)))) for i in self.dwa_blocks)
        self.reset_parameters()

    def dwa_sources(self, i: int) -> list[int]:
        """Block indices j averaged by DWA_i: j <= i and j = i (mod dilation), ascending."""
        return list(range(i % self.dilation, i + 1, self.dilation))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w in self.dwa_weight:
                w.zero_()
                w[-1] = 1.0  # alpha_{i,i}: DWA_i starts as the identity on X_i

    def depth_layout(self) -> tuple[str, list[str], str]:
        L = self.num_layers
        return (f"DenseFormer ({self.dilation}x{self.period})", ["emb", *(sublayer_label(i, L) for i in range(L))],
                "source: the embedding, then each earlier sublayer's output; weight |c| / sum |c| of its coefficient "
                "c in this sublayer's input (DWA weights are signed)")

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        L = self.num_layers
        dwa = dict(zip(self.dwa_blocks, self.dwa_weight, strict=True))
        # On recording passes, each state's coefficients over the L + 1 sources (the embedding,
        # then each sublayer's output): the heatmap rows. None otherwise.
        track = self.recording
        e_coef = torch.eye(L + 1, dtype=torch.float64)[0] if track else None  # (L + 1,)
        blocks, block_coefs = [embedding], [e_coef]  # X_0, X_1, ..., each (B, T, D)
        y, y_coef = embedding, e_coef  # Y_{i-1}: what block i reads
        for i in range(1, self.num_blocks + 1):
            h, h_coef = y, y_coef
            for index in (2 * i - 2, 2 * i - 1):  # the block's attention and MLP, standard residual inside
                if track:
                    self._record_row(index, h_coef[: index + 1], embedding)
                    h_coef = h_coef.clone()
                    h_coef[index + 1] += 1.0
                h = h + self.call_sublayer(index, sublayers[index], h, sublayer_kwargs)
            blocks.append(h)
            block_coefs.append(h_coef)
            if i not in dwa:  # periodic DenseFormer: no DWA after this block
                y, y_coef = h, h_coef
                continue
            weights, js = dwa[i], self.dwa_sources(i)
            y = weights[0] * blocks[js[0]]  # a running sum: no stacked copy of the sources
            for w, j in zip(weights[1:], js[1:], strict=True):
                y = y + w * blocks[j]
            if track:
                w64 = weights.detach().to("cpu", torch.float64)
                y_coef = torch.stack([w * block_coefs[j] for w, j in zip(w64, js, strict=True)]).sum(0)
        if track:
            self._record_row(L, y_coef, embedding)
        return y

    def _record_row(self, index: int, coef: Tensor, like: Tensor) -> None:
        """Record |coef| / sum |coef| as (S, B, T) for sublayer `index` (or the output)."""
        magnitude = coef.abs()
        row = (magnitude / magnitude.sum().clamp_min(torch.finfo(torch.float64).tiny)).to(like.device, torch.float32)
        self.record_weights(index, row[:, None, None].expand(-1, *like.shape[:-1]))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_layers={self.num_layers}, dilation={self.dilation}, "
                f"period={self.period}, dwa_modules={len(self.dwa_blocks)}")
