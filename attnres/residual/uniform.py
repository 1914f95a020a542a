"""A control for Block AttnRes: the same sources, mixed with fixed uniform weights.

Sublayer l of block n reads the plain mean of Block AttnRes's sources,
h_l = (b_0 + ... + b_{n-1} + b_n^{i-1}) / S_l (S_l sources, the empty partial sum left out),
and the output is the mean of all N + 1 blocks. Nothing in the mix is learned: no queries,
no keys, no gain. It answers "is it the routing or the bounded scale?" from the scale's side:
the hidden state stays a mean (bounded), but no sublayer can choose what it reads.

What this control turns out to be (a test holds it, tests/residual/test_controls.py): every
reader of the mix is normalised (each sublayer's pre-norm, the final norm), and a mean of
the sources is the standard residual's h_l divided by S_l. So, up to the RMSNorms' eps, this
model computes the standard residual's function for every value of its weights, trains the
same way, and differs from it only by rounding. The bounded scale of a uniform mix changes
nothing under PreNorm; what Block AttnRes adds is the departure from uniform, which its
queries learn (DESIGN.md section 2b says the same of zero queries).

It is `BlockAttentionResidual` with its pseudo-queries fixed at zero (a buffer, not a
parameter) and no key-norm gain, so it runs on every kernel Block AttnRes runs on (the
two-phase fast path with zero logits gives exactly uniform weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnres.residual.block import DEFAULT_NUM_BLOCKS, BlockAttentionResidual


class UniformBlockResidual(BlockAttentionResidual):
    """Block AttnRes's sources mixed by their plain mean (module docstring). Options are Block
    AttnRes's blocks (`num_blocks`, `block_sizes`), `eps`, `output_aggregation` (the mean of the
    blocks, or their plain sum), `kernel` and `fuse_prenorm`; it owns no parameters."""

    elementwise_parameters = ()

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        num_blocks: int = DEFAULT_NUM_BLOCKS,
        eps: float = 1e-6,
        output_aggregation: bool = True,
        kernel: str = "auto",
        block_sizes: Sequence[int] | None = None,
        fuse_prenorm: bool = True,
    ) -> None:
        super().__init__(d_model, num_layers, num_blocks, eps, key_norm_gain=False,
                         output_aggregation=output_aggregation, kernel=kernel, block_sizes=block_sizes,
                         fuse_prenorm=fuse_prenorm)
        rows = self.pseudo_query.shape
        del self.pseudo_query  # zero logits for good: the softmax over S sources is 1 / S each
        # persistent, though it never changes: a loader that builds the model on the meta device
        # (transformers' from_pretrained) fills only what the checkpoint holds, and left it garbage
        self.register_buffer("pseudo_query", torch.zeros(rows))

    def reset_parameters(self) -> None:
        pass  # nothing learned; the zero queries never change

    def depth_layout(self) -> tuple[str, list[str], str]:
        _, cols, what = super().depth_layout()
        return f"Uniform mix of Block sources (N={self.num_blocks})", cols, what
