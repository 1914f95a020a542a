"""mHC: Manifold-Constrained Hyper-Connections (DeepSeek-AI, arXiv 2512.24880).

Hyper-Connections (`attnres.residual.hc`) with n streams x_l (n, D) per token, in the
paper's notation x_{l+1} = H_res x_l + H_post^T f(H_pre x_l), where the residual mapping is
constrained to the doubly stochastic matrices (the Birkhoff polytope, section 4.1), so the
residual path neither amplifies nor attenuates the streams' mean however many layers compose.
Parameterisation (section 4.2), per sublayer, from all n streams of a token at once:

    x'     = RMSNorm(vec(x_l))                                  # (n D,), no gain
    H_pre  = sigmoid(a_pre  * x' phi_pre  + b_pre)              # (n,), non-negative
    H_post = 2 sigmoid(a_post * x' phi_post + b_post)           # (n,), in (0, 2)
    H_res  = SinkhornKnopp(a_res * mat(x' phi_res) + b_res)     # (n, n), doubly stochastic

SinkhornKnopp (section 4.2): M = exp(logits), then `sinkhorn_iterations` rounds (the paper's
t_max = 20) of dividing by row sums and then by column sums.

Initialisation. The gating factors a start at 0.01 (as the paper's); the projections phi at
zero, and the biases so that step 0 is the standard residual: b_pre = logit(1/n) (the input
is the mean of the streams), b_post = 0 (H_post = 1: every stream receives each output) and
b_res = 0 on the diagonal, RES_OFF_DIAGONAL_INIT off it (H_res within about 1e-3 of the
identity, the mapping mHC restores; symmetric, so one Sinkhorn round makes it exactly
doubly stochastic). With all streams starting as the embedding they stay equal, sublayer l
reads exactly the standard h_l, and the output (the streams' sum, as for HC) is n * h_L. The
paper fixes neither phi's nor the biases' initial values in the text followed here; these are
this project's choices.

Parameters per sublayer: n D (n^2 + 2n) for phi, n^2 + 2n biases and 3 gates.
Memory per token (what autograd keeps beyond the standard residual, per sublayer): as HC,
(2n + 1) D (the streams, their flattened RMS-normalised copy, the sublayer output), plus the
Sinkhorn iterates, 2 t_max (n^2 + n) + n^2 values (816 for n = 4, t_max = 20: 1.1 D at
D = 768 but 8.5 D at D = 96). Measured 10.2 D at gpt-small, 18.1 D at tiny
(experiments/strategy_costs.py). The paper recomputes these in the backward instead
(section 4.3); this reference path does not. Between sublayers only the n streams, n * D per
token, are live.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnres.residual.hc import DYNAMIC_SCALE_INIT, HyperConnectionResidual, check_expansion_rate

#: b_res off the diagonal at initialisation: exp(-8) ~ 3e-4, so H_res starts near the identity
RES_OFF_DIAGONAL_INIT = -8.0


def sinkhorn_knopp(logits: Tensor, iterations: int = 20) -> Tensor:
    """Doubly stochastic approximation of exp(logits) (..., n, n): `iterations` rounds of row
    then column normalisation. Columns sum to 1 exactly (normalised last); rows converge at a
    rate set by the logits' spread: for 4 x 4 logits drawn from N(0, s^2), 20 rounds leave rows
    off by at most ~1e-11 at s = 0.5, ~1e-4 at s = 1 and ~1e-2 at s = 2 (100 rounds: ~1e-16 at
    s = 1). The max is subtracted first (a common factor: no change to the result)."""
    M = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        M = M / M.sum(dim=-1, keepdim=True)
        M = M / M.sum(dim=-2, keepdim=True)
    return M


class ManifoldHyperConnectionResidual(HyperConnectionResidual):
    """mHC as a residual strategy (module docstring): `expansion_rate` streams (n >= 2: with one
    stream H_res is the constant 1 and sigmoid cannot reach H_pre = 1), `sinkhorn_iterations`
    rounds of Sinkhorn-Knopp (>= 1)."""

    def __init__(
        self, d_model: int, num_layers: int, expansion_rate: int = 4, sinkhorn_iterations: int = 20,
        eps: float = 1e-6,
    ) -> None:
        check_expansion_rate(expansion_rate, minimum=2)
        if isinstance(sinkhorn_iterations, bool) or not isinstance(sinkhorn_iterations, int) or sinkhorn_iterations < 1:
            raise ValueError(
                f"sinkhorn_iterations must be an int >= 1 (rounds of row and column normalisation making H_res "
                f"doubly stochastic; the paper uses 20), got {sinkhorn_iterations!r}"
            )
        super().__init__(d_model, num_layers, expansion_rate, dynamic=True, eps=eps)
        self.sinkhorn_iterations = sinkhorn_iterations

    def _init_hc_parameters(self) -> None:
        n, L, D = self.expansion_rate, self.num_layers, self.d_model
        self.phi = nn.Parameter(torch.zeros(L, n * D, n * n + 2 * n))  # [phi_pre, phi_post, phi_res]
        self.gate = nn.Parameter(torch.zeros(L, 3))  # a_pre, a_post, a_res
        self.bias_pre = nn.Parameter(torch.zeros(L, n))
        self.bias_post = nn.Parameter(torch.zeros(L, n))
        self.bias_res = nn.Parameter(torch.zeros(L, n, n))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        n = self.expansion_rate
        with torch.no_grad():
            self.phi.zero_()
            self.gate.fill_(DYNAMIC_SCALE_INIT)
            self.bias_pre.fill_(-math.log(n - 1))  # sigmoid(b) = 1 / n
            self.bias_post.zero_()  # 2 sigmoid(0) = 1
            off_diagonal = RES_OFF_DIAGONAL_INIT * (1 - torch.eye(n))
            self.bias_res.copy_(off_diagonal.expand_as(self.bias_res))

    def depth_layout(self) -> tuple[str, list[str], str]:
        title, cols, _ = super().depth_layout()
        return (title.replace("Hyper-Connections", "mHC"), cols,
                "source: the embedding, then each earlier sublayer's output; weight c / sum c of its coefficient c "
                "in this sublayer's input, tracking each stream as a combination of sources (mHC's are non-negative)")

    def mixing(self, index: int, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.expansion_rate
        flat = streams.flatten(-2)  # (B, T, n D): all streams of a token
        z = F.rms_norm(flat, (flat.shape[-1],), eps=self.eps) @ self.phi[index]  # (B, T, n^2 + 2 n)
        a_pre, a_post, a_res = self.gate[index]
        pre = torch.sigmoid(a_pre * z[..., :n] + self.bias_pre[index])  # (B, T, n)
        post = 2 * torch.sigmoid(a_post * z[..., n : 2 * n] + self.bias_post[index])  # (B, T, n)
        res_logits = a_res * z[..., 2 * n :].unflatten(-1, (n, n)) + self.bias_res[index]  # (B, T, n, n)
        return pre, post, sinkhorn_knopp(res_logits, self.sinkhorn_iterations)

    def extra_repr(self) -> str:
        return super().extra_repr().replace(", dynamic=True", "") + f", sinkhorn_iterations={self.sinkhorn_iterations}"
