"""Full Attention Residuals (Kimi Team, arXiv 2603.15031).

Sublayer l reads depth attention over [e, f_0(h_0), ..., f_{l-1}(h_{l-1})] with its own
zero-initialised pseudo-query; the output aggregates over e and all L outputs.
Memory O(L * D) per token.

`window=W` (an ablation, arXiv 2603.15031): sublayer l, and the output, attend over the
embedding and the last W sources only; W >= L is Full AttnRes exactly. The other ablation
options are those of `DepthAttentionResidual` (`attnres.residual.ablations`).

Fast path: every source's key statistic is computed once, when it appears. Sublayers are
taken in chunks of C (about sqrt(L), at most 4): at the start of a chunk the C queries meet
all sources so far in one batched pass (phase 1), and each later sublayer of the chunk
merges only the sources added since (phase 2). That reads the sources about L^2 / (2 C) +
L C / 2 times instead of L^2 / 2, in O(L) op calls (with the Triton kernels, one graph node
each under torch.compile, so compiling does not grow with L^2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from attnres.functional import SourceStack, completed_attention, merge_partial
from attnres.labels import sublayer_label
from attnres.residual.ablations import check_window
from attnres.residual.base import DepthAttentionResidual, Sublayer


class FullAttentionResidual(DepthAttentionResidual):
    """Full AttnRes as a drop-in module: `forward(embedding, sublayers, **kw)` or
    `forward(encoder, src, mask=None, src_key_padding_mask=None, is_causal=None)`.

    Owns `num_layers + 1` pseudo-queries and key norms; the last is the output
    aggregation, which `forward` returns (DESIGN.md section 2, "Output"). `window`: None
    (every source), or W >= 1, the embedding plus the last W sources (module docstring).
    """

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        eps: float = 1e-6,
        key_norm_gain: bool = True,
        output_aggregation: bool = True,
        kernel: str = "auto",
        *,
        query: str = "static",
        mixing: str = "attention",
        scoring: str = "softmax",
        key_norm: bool = True,
        heads: int = 1,
        window: int | None = None,
        fuse_prenorm: bool = True,
    ) -> None:
        super().__init__(d_model, num_layers, eps, key_norm_gain, output_aggregation, kernel, query=query,
                         mixing=mixing, scoring=scoring, key_norm=key_norm, heads=heads, fuse_prenorm=fuse_prenorm)
        self.window = check_window(window, num_layers)
        # a window that hides a source takes the reference path too; W >= L hides none
        self.ablated = self.ablated or (self.window is not None and self.window < num_layers)
        self.chunk = min(4, max(1, round(math.sqrt(num_layers))))  # C, sublayers per phase-1 pass
        # without gradients, one call per sublayer over all l + 1 sources (the one-pass route) reads
        # L^2 / 2 rows a token: cheaper than two-phase up to a few hundred tokens (BENCHMARKS.md)
        self.one_pass_tokens = 128

    def depth_layout(self) -> tuple[str, list[str], str]:
        L = self.num_layers
        window = "" if self.window is None else f" (W={self.window})"
        outside = "" if self.window is None else f"; weight 0 outside the embedding and the last {self.window}"
        return ("Full AttnRes" + window, ["emb", *(sublayer_label(i, L) for i in range(L))],
                "source: the embedding, then the output of each earlier sublayer" + outside)

    def attend(self, index: int, sources: Sequence[Tensor]) -> Tensor:
        """Depth attention as the base class has it, over the embedding and the last `window`
        sources when there are more; the recorded row keeps one column per source (0 outside)."""
        W = self.window
        if W is None or len(sources) <= W + 1:
            return super().attend(index, sources)
        columns = [0, *range(len(sources) - W, len(sources))]
        h, weights = self.mix(index, [sources[i] for i in columns], columns)
        if self.recording:
            row = weights.new_zeros((len(sources), *weights.shape[1:]))  # (S, B, T)
            row[columns] = weights
            self.record_weights(index, row)
        return h

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        kernel = self.fast_kernel(embedding)
        if kernel is not None:
            mix_one = self.one_pass_mix(embedding, kernel)
            if mix_one is not None:  # decoding: one call per sublayer, each output a source of its own
                return self.run_one_pass(embedding, sublayers, sublayer_kwargs, mix_one, range(self.num_layers))
            return self._run_two_phase(embedding, sublayers, sublayer_kwargs, kernel)
        sources = [embedding]  # each (B, T, D)
        for index, sublayer in enumerate(sublayers):
            h = self.attend(index, sources)
            sources.append(self.call_sublayer(index, sublayer, h, sublayer_kwargs))
        return self.output(sources)

    def _run_two_phase(
        self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any], kernel: str
    ) -> Tensor:
        L, C, eps = self.num_layers, self.chunk, self.eps
        queries = self.fast_queries(embedding)  # (L + 1, D)
        sources = SourceStack(embedding, L + 1, eps, kernel)  # the embedding, then every output
        for index, sublayer in enumerate(sublayers):
            j = index % C
            start = index - j
            norm = self.prenorm_of(sublayer)  # (weight, eps): fused into the mix (`prenorm_of`), or None
            if j == 0:  # phase 1: this chunk's queries against all sources so far
                chunk_queries = queries[start : min(start + C, L)]
                done, done_rms, stacked = sources.take()
                accs, lse = completed_attention(done, done_rms, chunk_queries, eps, kernel, stacked,
                                                *(norm or (None, None)))
                h = accs[0]
            else:  # phase 2: merge the j sources added since the chunk began
                newer, newer_rms, stacked = sources.take(start + 1, index + 1)
                h = merge_partial(accs[j], lse[j], newer, newer_rms, queries[index], eps, kernel, stacked,
                                  *(norm or (None, None)))
            if norm is None:
                out = self.call_sublayer(index, sublayer, h, sublayer_kwargs)
            else:  # h is the sublayer's pre-norm of the mix already
                out = sublayer.forward_normed(h, **sublayer_kwargs)
            sources.append(out, statistics=index + 1 < L or self.output_aggregation)
        return self.fast_output(sources, queries, kernel)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.window is None else f", window={self.window}")
