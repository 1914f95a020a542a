"""Hyper-Connections (Zhu et al., "Hyper-Connections", arXiv 2409.19606; ICLR 2025).

The residual stream is widened to n streams, a hyper hidden matrix H of shape (n, D) per
token (`expansion_rate`, the paper's n; default 4). Each sublayer (attention and MLP alike,
as in the paper) has its own connection, in the paper's notation (section 2.1, static):

    h_in = A_m^T H                      # (D,): width connection, the sublayer's input
    H'   = B^T f(h_in) + A_r^T H        # (n, D): depth connection plus stream mixing

with A_m (n, 1), A_r (n, n) and B (1, n). Dynamic hyper-connections (section 2.2) add
input-dependent parts computed from H_bar = norm(H) (per stream, over D):

    A_m(H) = s_alpha * tanh(H_bar W_m) + A_m,   A_r(H) = s_alpha * tanh(H_bar W_r) + A_r,
    B(H)   = s_beta * tanh(H_bar W_beta)^T + B

Initialisation (section 2.3): W_m, W_r, W_beta = 0; A_m = e_{l mod n} (sublayer l reads
stream l mod n), A_r = I, B = 1; s_alpha = s_beta = 0.01. H starts as n copies of the
embedding and every stream then receives each output, so at step 0 every stream equals the
standard residual stream h_l and sublayer l reads exactly h_l. The output is the sum of the n
streams (the last hyper hidden matrix summed over streams), n * h_L at step 0, which the
model's final RMSNorm maps to the standard model's normalised output (up to its eps).

Choices the paper leaves to the implementation: norm is a LayerNorm without learnable affine
(a gain would be redundant with W, which it multiplies); sublayer l uses the sublayer index
(attention and MLP counted apart) for e_{l mod n}.
Parameters per sublayer: static n (n + 1) + n; dynamic D (n + 2) + 2 more, so
L (n^2 + 2n + [D (n + 2) + 2]) in all.
Memory per token (what autograd keeps beyond the standard residual, per sublayer): the n
streams H that are mixed, their normalised copy H_bar (dynamic only) and the sublayer output
that is spread over the streams: (2n + 1) D dynamic, (n + 1) D static (measured 9.0 D at
n = 4, D = 768; experiments/strategy_costs.py). Only n * D per token is live between sublayers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnres.labels import sublayer_label
from attnres.residual.base import ResidualStrategy, Sublayer

#: the initial scale of the dynamic parts (section 2.3)
DYNAMIC_SCALE_INIT = 0.01


def check_expansion_rate(expansion_rate: object, minimum: int = 1) -> None:
    if isinstance(expansion_rate, bool) or not isinstance(expansion_rate, int) or expansion_rate < minimum:
        raise ValueError(
            f"expansion_rate (n, the number of residual streams) must be an int >= {minimum}, got "
            f"{expansion_rate!r}; the papers use 4"
        )


class HyperConnectionResidual(ResidualStrategy):
    """Hyper-Connections as a residual strategy (module docstring): `expansion_rate` streams,
    `dynamic=False` for static hyper-connections (SHC) only.

    Subclasses change the connection by overriding `mixing(index, H)`, which returns the
    sublayer's (pre, post, res) with `h_in = sum_j pre_j H_j` and
    `H'_i = post_i f(h_in) + sum_j res_ij H_j`; `run`, the stream bookkeeping and the heatmap
    rows are shared.
    """

    has_depth_attention = True

    def __init__(
        self, d_model: int, num_layers: int, expansion_rate: int = 4, dynamic: bool = True, eps: float = 1e-6
    ) -> None:
        super().__init__(d_model, num_layers, eps)
        check_expansion_rate(expansion_rate)
        if not isinstance(dynamic, bool):  # `residual.dynamic=no` arrives as the string "no", which is truthy
            raise ValueError(f"dynamic must be true or false (false: static hyper-connections only), got {dynamic!r}")
        self.expansion_rate, self.dynamic = expansion_rate, dynamic
        self._init_hc_parameters()

    def _init_hc_parameters(self) -> None:
        n, L, D = self.expansion_rate, self.num_layers, self.d_model
        self.static_alpha = nn.Parameter(torch.zeros(L, n, n + 1))  # [..., 0] = A_m, [..., 1:] = A_r
        self.static_beta = nn.Parameter(torch.zeros(L, n))  # B
        if self.dynamic:
            self.dynamic_alpha = nn.Parameter(torch.zeros(L, D, n + 1))  # [W_m, W_r]
            self.dynamic_beta = nn.Parameter(torch.zeros(L, D))  # W_beta
            self.dynamic_alpha_scale = nn.Parameter(torch.zeros(L))  # s_alpha
            self.dynamic_beta_scale = nn.Parameter(torch.zeros(L))  # s_beta
        self.reset_parameters()

    def reset_parameters(self) -> None:
        n = self.expansion_rate
        with torch.no_grad():
            self.static_alpha.zero_()
            for index in range(self.num_layers):
                self.static_alpha[index, index % n, 0] = 1.0  # A_m = e_{l mod n}
                self.static_alpha[index, :, 1:] = torch.eye(n)  # A_r = I
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.dynamic_alpha.zero_()
                self.dynamic_beta.zero_()
                self.dynamic_alpha_scale.fill_(DYNAMIC_SCALE_INIT)
                self.dynamic_beta_scale.fill_(DYNAMIC_SCALE_INIT)

    def depth_layout(self) -> tuple[str, list[str], str]:
        L = self.num_layers
        return (f"Hyper-Connections (n={self.expansion_rate})", ["emb", *(sublayer_label(i, L) for i in range(L))],
                "source: the embedding, then each earlier sublayer's output; weight |c| / sum |c| of its coefficient "
                "c in this sublayer's input, tracking each stream as a combination of sources (HC weights are signed)")

    # -- the connection ----------------------------------------------------------------------
    def mixing(self, index: int, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(pre, post, res) of sublayer `index` for `streams` H (B, T, n, D): pre and post
        (..., n), res (..., n, n) with rows the new streams; leading dims (B, T) when dynamic,
        none when static."""
        alpha, beta = self.static_alpha[index], self.static_beta[index]  # (n, n + 1), (n,)
        if self.dynamic:
            H_bar = F.layer_norm(streams, (streams.shape[-1],), eps=self.eps)  # (B, T, n, D), no affine
            alpha = self.dynamic_alpha_scale[index] * torch.tanh(H_bar @ self.dynamic_alpha[index]) + alpha
            beta = self.dynamic_beta_scale[index] * torch.tanh(H_bar @ self.dynamic_beta[index]) + beta
        # A_r^T H: new stream i takes sum_j A_r[j, i] H_j, so res is A_r transposed
        return alpha[..., 0], beta, alpha[..., 1:].transpose(-1, -2)

    def expand_streams(self, embedding: Tensor) -> Tensor:
        """H_0: n copies of the embedding, (B, T, n, D)."""
        return embedding.unsqueeze(-2).expand(*embedding.shape[:-1], self.expansion_rate, embedding.shape[-1])

    def collapse_streams(self, streams: Tensor) -> Tensor:
        """The network's output from the last streams (..., n, D): their sum."""
        return streams.sum(dim=-2)

    # -- running -----------------------------------------------------------------------------
    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        L, n = self.num_layers, self.expansion_rate
        H = self.expand_streams(embedding)  # (B, T, n, D)
        # On recording passes, each stream's coefficients over the L + 1 sources (embedding,
        # then each sublayer's output), per token: (B, T, n, L + 1). None otherwise.
        coefs = None
        if self.recording:
            coefs = embedding.new_zeros((*embedding.shape[:-1], n, L + 1), dtype=torch.float32)
            coefs[..., 0] = 1.0
        for index, sublayer in enumerate(sublayers):
            pre, post, res = self.mixing(index, H)
            x = (pre.unsqueeze(-2) @ H).squeeze(-2)  # (B, T, D): sum_j pre_j H_j
            out = self.call_sublayer(index, sublayer, x, sublayer_kwargs)
            H = res @ H + post.unsqueeze(-1) * out.unsqueeze(-2)  # (B, T, n, D)
            if coefs is not None:
                pre, post, res = (t.detach().float() for t in (pre, post, res))
                self._record_row(index, (pre.unsqueeze(-2) @ coefs).squeeze(-2)[..., : index + 1])
                coefs = res @ coefs
                coefs[..., index + 1] += post
        if coefs is not None:
            self._record_row(L, self.collapse_streams(coefs))
        return self.collapse_streams(H)

    def _record_row(self, index: int, coef: Tensor) -> None:
        """Record |coef| / sum |coef| over the sources (last dim of (B, T, S)) as (S, B, T)."""
        magnitude = coef.abs()
        row = magnitude / magnitude.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(magnitude.dtype).tiny)
        self.record_weights(index, row.movedim(-1, 0))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_layers={self.num_layers}, expansion_rate={self.expansion_rate}, "
                f"dynamic={self.dynamic}")
