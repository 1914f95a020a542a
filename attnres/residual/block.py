"""Block Attention Residuals (Kimi Team, arXiv 2603.15031).

The L sublayers are cut into N consecutive blocks of S = L / N. The embedding is block
b_0, a source of its own. b_n (n >= 1) is the plain sum of the outputs of block n's
sublayers. The first sublayer of block n attends over the completed blocks
[b_0, ..., b_{n-1}]; its i-th sublayer (i >= 2) also over the partial sum b_n^{i-1} of
the block's first i-1 outputs. The output aggregates over all N + 1 blocks.
Memory O(N * D) per token; N = L is Full AttnRes exactly.

Where this departs from an often-shared sketch of the same API, it follows the paper:
a block's empty partial sum is left out rather than attended to as a zero source, and
the output is a final depth attention over all blocks, not the last block's partial sum.

Fast path (two-phase, DESIGN.md section 4): a completed block never changes, so its key
statistic is computed once; at the start of block n the S sublayers' queries meet all
completed blocks in one batched pass (phase 1, `completed_attention`), and sublayer i >= 2
then merges only its own partial sum into that result with an online-softmax update
(phase 2, `merge_partial`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from attnres.functional import completed_attention, key_inv_rms, merge_partial
from attnres.residual.base import DepthAttentionResidual, Sublayer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class BlockAttentionResidual(DepthAttentionResidual):
    """Block AttnRes as a drop-in module: `forward(embedding, sublayers, **kw)` or
    `forward(encoder, src, mask=None, src_key_padding_mask=None, is_causal=None)`.

    Owns `num_layers + 1` pseudo-queries and key norms; the last is the output
    aggregation, which `forward` returns. `num_layers % num_blocks != 0` is a ValueError.
    """

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        num_blocks: int = 8,
        eps: float = 1e-6,
        key_norm_gain: bool = True,
        output_aggregation: bool = True,
        kernel: str = "auto",
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1 or num_layers % num_blocks != 0:
            raise ValueError(
                f"num_blocks={num_blocks} must divide the {num_layers} sublayers "
                f"(2 per transformer layer); valid values: {', '.join(map(str, _divisors(num_layers)))}"
            )
        super().__init__(d_model, num_layers, eps, key_norm_gain, output_aggregation, kernel)
        self.num_blocks = num_blocks
        self.block_size = num_layers // num_blocks  # S, sublayers per block

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        kernel = self.fast_kernel(embedding)
        if kernel is not None:
            return self._run_two_phase(embedding, sublayers, sublayer_kwargs, kernel)
        blocks = [embedding]  # completed blocks, each (B, T, D)
        partial: Tensor | None = None  # b_n^i; None while block n has no output yet
        for index, sublayer in enumerate(sublayers):
            if index > 0 and index % self.block_size == 0:
                blocks.append(partial)
                partial = None
            h = self.attend(index, blocks if partial is None else [*blocks, partial])
            out = self.call_sublayer(index, sublayer, h, sublayer_kwargs)
            partial = out if partial is None else partial + out
        blocks.append(partial)
        return self.output(blocks)

    def _run_two_phase(
        self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any], kernel: str
    ) -> Tensor:
        S, eps = self.block_size, self.eps
        queries = self.fast_queries(embedding)  # (L + 1, D)
        blocks, inv_rms = [embedding], [key_inv_rms(embedding, eps, kernel)]  # completed blocks, (B, T) each
        for start in range(0, self.num_layers, S):
            # phase 1: the S queries of this block against all completed blocks, one pass
            accs, lse = completed_attention(blocks, torch.stack(inv_rms), queries[start : start + S], eps, kernel)
            partial: Tensor | None = None
            for i in range(S):
                index = start + i
                if partial is None:
                    h = accs[i]
                else:  # phase 2: fold in this block's partial sum (online softmax)
                    h = merge_partial(accs[i], lse[i], [partial], None, queries[index], eps, kernel)
                out = self.call_sublayer(index, sublayers[index], h, sublayer_kwargs)
                partial = out if partial is None else partial + out
            blocks.append(partial)
            if start + S < self.num_layers or self.output_aggregation:
                inv_rms.append(key_inv_rms(partial, eps, kernel))
        return self.fast_output(blocks, inv_rms, queries, kernel)

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, " + super().extra_repr()
