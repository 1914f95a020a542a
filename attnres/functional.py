"""Functional depth attention: the public ops (DESIGN.md section 2).

`depth_attention` is the one operation both AttnRes variants share; `full_attn_res`
and `block_attn_res` are its two public forms. Inputs are validated once and then
handed to an implementation in `attnres.ops`, chosen by `kernel` (`attnres/ops/dispatch.py`):

- "auto" (default): "triton" for CUDA tensors of a half or float32 dtype (D <= 8192) when
  triton is installed, "cpu" for CPU tensors of float32 or float64 when its C++ kernel builds
  (under torch.compile only when an earlier call built it: nothing builds while Dynamo traces),
  "torch" otherwise;
- "triton": fused Triton kernels (`attnres/ops/triton_fused.py`); CUDA tensors, or CPU
  tensors under the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported);
- "cpu": one fused C++ loop each way over the tokens (`attnres/ops/cpu_fused.py`), compiled
  on first use (about a minute, once per machine); CPU tensors of float32 or float64;
- "torch": the fast formulation in plain PyTorch (`attnres/ops/torch_fused.py`);
- "naive": the reference (`attnres/ops/naive.py`).

Every op takes sources of any leading shape, (..., D): (B, T, D) in a Transformer, but also
(D,) for one token or (B, H, T, D); the statistics and weights have the leading shape (...),
and the result is what the same op gives on the sources flattened to (M, D).

`output_norm_weight=` (D,) on `depth_attention`, `block_attn_res` and `full_attn_res` fuses the
next sublayer's pre-norm into the op, as flash-linear-attention does: the op returns
RMSNorm(h) * output_norm_weight (the op's eps, float32 statistics, float64 for float64 inputs)
in place of h, computed from h before it is rounded to the input dtype, with gradients for the
weight too. The Triton kernels apply it in registers (forward) and take it back out of the
incoming gradient (backward): no pass over memory of its own. Without gradients they write
only the normed result; with gradients they also write h, which the backward reads (a separate
RMSNorm would keep its input too, and add a read of h forward and a write and read of dh
backward). The "torch" and "naive" paths compute the same in plain PyTorch.

The two-phase API (`key_inv_rms`, `completed_attention`, `merge_completed`, `merge_partial`)
is what the residual strategies use: statistics of a completed source computed once, the
queries of several sublayers against all completed sources in one pass (phase 1, which
`merge_completed` extends by sources completed since), and each sublayer's own newest
sources merged in with an online-softmax update (phase 2). Each takes the next sublayer's
pre-norm too (`output_norm_weight=`, `output_norm_eps=`), applied to its first output: the C++
and Triton kernels fuse it into the same loop over the tokens (forward and backward; `cpu_fused`,
`triton_fused`), the other implementations compose it (`F.rms_norm` on the mixed h, the same math).
"""


from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from attnres.ops import naive_depth_attention
from attnres.ops.dispatch import KERNELS, SCORINGS, check_call, check_sources, implementation, resolve_kernel
from attnres.ops.naive import naive_generalized_depth_attention
from attnres.ops.torch_fused import fold_queries

__all__ = [
    "KERNELS",
    "SourceStack",
    "block_attn_res",
    "completed_attention",
    "depth_attention",
    "fold_queries",
    "full_attn_res",
    "generalized_depth_attention",
    "key_inv_rms",
    "merge_completed",
    "merge_partial",
    "resolve_kernel",
    "static_depth_mixing",
]


def depth_attention(
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    kernel: str = "auto",
    output_norm_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention over the depth axis.

    `sources`: S >= 1 tensors (..., D) of one shape, dtype and device; `pseudo_query`: (D,);
    `norm_weight`: optional (D,) key RMSNorm gain. Returns `(h, weights)` with h (..., D)
    and weights (S, ...), both in the sources' dtype: statistics, logits and softmax are
    float32 (float64 for float64 sources) inside, rounded once at the end.
    `kernel` picks the implementation (module docstring). With `output_norm_weight` (D,),
    the first result is RMSNorm(h) * output_norm_weight instead of h (module docstring).
    """
    sources = list(sources)
    check_call(sources, pseudo_query, norm_weight, eps, output_norm_weight)
    kernel = resolve_kernel(kernel, sources[0])
    if kernel == "naive":
        return naive_depth_attention(sources, pseudo_query, norm_weight, eps, output_norm_weight)
    return implementation(kernel).fused_depth_attention(sources, pseudo_query, norm_weight, eps, output_norm_weight)


def generalized_depth_attention(
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    scoring: str = "softmax",
    heads: int = 1,
    key_norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Depth attention with the ablation options of arXiv 2603.15031; the defaults give
    `depth_attention` (to rounding). Always the reference implementation, in plain PyTorch.

    `pseudo_query`: (D,), or one query per token, (..., D) of the sources' shape.
    `scoring`: "softmax", or "sigmoid" (weights sigmoid(logit_i) / sum_j sigmoid(logit_j)).
    `heads`: H dividing D; each group of D / H channels has its own logits, key statistics and
    normalisation. `key_norm=False`: logits from the raw sources. Returns `(h, weights)`,
    weights (S, ...) averaged over heads (`attnres.ops.naive.naive_generalized_depth_attention`).
    """
    sources = list(sources)
    check_call(sources, pseudo_query, norm_weight, eps, per_token_query=True)
    d = sources[0].shape[-1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
    if not (isinstance(heads, int) and not isinstance(heads, bool) and heads >= 1 and d % heads == 0):
        raise ValueError(f"heads={heads!r} must be a positive int dividing D={d}")
    return naive_generalized_depth_attention(sources, pseudo_query, norm_weight, eps, scoring, heads, bool(key_norm))


def static_depth_mixing(sources: Sequence[Tensor], logits: Tensor) -> tuple[Tensor, Tensor]:
    """Input-independent mixing (arXiv 2603.15031, ablation study): weights softmax(logits)
    over the S sources, the same for every token; no queries, no keys. `logits`: (S,).
    Returns `(h, weights)` as `depth_attention` does: h (..., D), weights (S, ...)."""
    sources = list(sources)
    check_sources(sources)
    if logits.shape != (len(sources),):
        raise ValueError(f"logits must have shape ({len(sources)},), one per source, got {tuple(logits.shape)}")
    compute_dtype = torch.promote_types(sources[0].dtype, torch.float32)
    alpha = torch.softmax(logits.to(compute_dtype), dim=0)  # (S,)
    h = alpha[0] * sources[0].to(compute_dtype)
    for a, v in zip(alpha[1:], sources[1:], strict=True):
        h = h + a * v.to(compute_dtype)
    weights = alpha.reshape(-1, *(1,) * (sources[0].dim() - 1)).expand(-1, *sources[0].shape[:-1])
    return h.to(sources[0].dtype), weights.to(sources[0].dtype)


# ------------------------------------------------------------------------------------------------
# two-phase API (the residual strategies' fast path)
# ------------------------------------------------------------------------------------------------


def key_inv_rms(source: Tensor, eps: float = 1e-6, kernel: str = "auto") -> Tensor:
    """The key statistic 1 / sqrt(mean(v^2) + eps) of a source (..., D) -> (...), in the
    statistics dtype, without gradient: compute it once per completed source and pass it to
    `completed_attention` / `merge_partial`, which differentiate through it themselves."""
    kernel = resolve_kernel(kernel, source)
    if kernel == "naive":
        kernel = "torch"
    return implementation(kernel).inv_rms(source, eps)


def completed_attention(
    sources: Sequence[Tensor],
    inv_rms: Tensor | None,
    queries: Tensor,
    eps: float = 1e-6,
    kernel: str = "auto",
    stacked: Tensor | tuple | None = None,
    output_norm_weight: Tensor | None = None,
    output_norm_eps: float | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Phase 1: K queries (K, D) (gain-folded, see `fold_queries`) against the same sources
    (n tensors (..., D)) in one pass. `inv_rms`: (n, ...) from `key_inv_rms`, or None to
    compute it. Returns K outputs (..., D) and their log-sum-exp (K, ...) of the logits,
    which `merge_partial` needs to extend the softmax with further sources. `stacked`: what
    `SourceStack.take` gives with the sources, for the implementation it was built for: the
    sources' values as one (n, ..., D) tensor ("torch", which then reads that instead of
    stacking them itself), or the pass's gradient sink ("cpu"); None otherwise.
    `output_norm_weight` (D,): output 0 is RMSNorm(h_0) * output_norm_weight, with eps
    `output_norm_eps` (None: `eps`), the log-sum-exp still h_0's (module docstring)."""
    sources = list(sources)
    kernel = resolve_kernel(kernel, sources[0])
    impl = implementation("torch" if kernel == "naive" else kernel)
    outs, lse = _run_normed(impl, sources, inv_rms, queries, (), None, eps, stacked, output_norm_weight,
                            output_norm_eps)
    return outs, lse


def _run_normed(impl, sources, inv_rms, queries, prefix_h, prefix_lse, eps, stacked, norm_weight, norm_eps):
    """`impl.run_depth_attention`'s (outs, lse), output 0 through the pre-norm `norm_weight`
    when one is given: in the kernel where it fuses one (`FUSED_OUTPUT_NORM`), else composed."""
    norm_eps = eps if norm_eps is None else norm_eps
    if norm_weight is not None and getattr(impl, "FUSED_OUTPUT_NORM", False):
        outs, _, lse = impl.run_depth_attention(sources, inv_rms, queries, prefix_h, prefix_lse, eps,
                                                out_norm=norm_weight.to(queries.dtype), stacked=stacked,
                                                out_eps=norm_eps)
        return outs, lse
    outs, _, lse = impl.run_depth_attention(sources, inv_rms, queries, prefix_h, prefix_lse, eps, stacked=stacked)
    if norm_weight is not None:
        outs = [_prenorm(outs[0], norm_weight, norm_eps), *outs[1:]]
    return outs, lse


def _prenorm(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The composed pre-norm, as the model's own `RMSNorm` computes it."""
    return F.rms_norm(h, (h.shape[-1],), weight, eps)


def merge_completed(
    accs: Sequence[Tensor],
    lse: Tensor,
    sources: Sequence[Tensor],
    inv_rms: Tensor | None,
    queries: Tensor,
    eps: float = 1e-6,
    kernel: str = "auto",
    stacked: Tensor | tuple | None = None,
    output_norm_weight: Tensor | None = None,
    output_norm_eps: float | None = None,
) -> tuple[list[Tensor], Tensor]:
    """Phase 1 extended by more completed sources: K phase-1 results `accs` (K tensors (..., D))
    with their log-sum-exp `lse` (K, ...) and the same K queries (K, D) merged with `sources`
    as one softmax over all (the online-softmax merge of `merge_partial`, for K queries).
    Returns the K outputs and their log-sum-exp, which `merge_partial` (or this) extends further.
    Block AttnRes runs a block's phase 1 one block early, with the block before it, over all
    completed blocks but the newest, and merges the newest here (`BlockAttentionResidual`).
    `inv_rms` and `stacked`: as for `merge_partial`; `output_norm_weight`, `output_norm_eps`: as for
    `completed_attention` (output 0 through the next sublayer's pre-norm)."""
    sources = list(sources)
    kernel = resolve_kernel(kernel, accs[0])
    impl = implementation("torch" if kernel == "naive" else kernel)
    limit = merge_queries(kernel)
    if limit is None or len(accs) <= limit:
        return _run_normed(impl, sources, inv_rms, queries, list(accs), lse, eps, stacked, output_norm_weight,
                           output_norm_eps)
    outs, merged = [], []  # a kernel that takes one query with a prefix: a call per query, the norm in the first
    for k, acc in enumerate(accs):
        out, one = _run_normed(impl, sources, inv_rms, queries[k : k + 1], [acc], lse[k : k + 1], eps, stacked,
                               output_norm_weight if k == 0 else None, output_norm_eps)
        outs += out
        merged.append(one)
    return outs, torch.cat(merged)


def merge_queries(kernel: str) -> int | None:
    """How many queries one `merge_completed` pass of `kernel` (resolved, `resolve_kernel`)
    serves: None for any number, else more take a pass each (the Triton kernels: 1)."""
    return getattr(implementation("torch" if kernel == "naive" else kernel), "PREFIX_QUERIES", None)


def merge_partial(
    acc: Tensor,
    lse: Tensor,
    sources: Sequence[Tensor],
    inv_rms: Tensor | None,
    query: Tensor,
    eps: float = 1e-6,
    kernel: str = "auto",
    stacked: Tensor | tuple | None = None,
    output_norm_weight: Tensor | None = None,
    output_norm_eps: float | None = None,
) -> Tensor:
    """Phase 2: extend a phase-1 result `acc` (..., D) with log-sum-exp `lse` (...) by more
    sources (e.g. the block's partial sum) under the same query (D,), as one softmax over all:
    the online-softmax merge. `inv_rms`: (len(sources), ...) or None. `stacked`: as for
    `completed_attention`. Returns h (..., D), or with `output_norm_weight` (D,)
    RMSNorm(h) * output_norm_weight (eps `output_norm_eps`, None: `eps`; fused on the C++ and Triton
    kernels)."""
    sources = list(sources)
    kernel = resolve_kernel(kernel, acc)
    impl = implementation("torch" if kernel == "naive" else kernel)
    if len(sources) == 1 and hasattr(impl, "merge_one"):  # e.g. Block AttnRes's partial sum: a few ops
        h = impl.merge_one(acc, lse, sources[0], query, eps)
        if output_norm_weight is None:
            return h
        return _prenorm(h, output_norm_weight, eps if output_norm_eps is None else output_norm_eps)
    outs, _ = merge_completed([acc], lse.unsqueeze(0), sources, inv_rms, query.unsqueeze(0), eps, kernel, stacked,
                              output_norm_weight, output_norm_eps)
    return outs[0]


class SourceStack:
    """The completed sources of one two-phase pass, in order: the tensors (what autograd
    differentiates), their key statistics (`key_inv_rms`, computed once each) and, on the
    eager "torch" path, a copy of their values in one preallocated (capacity, ..., D) buffer,
    so that each phase-1 or phase-2 call reads its n sources as one (n, ..., D) tensor (one
    product for the logits of all its queries) with no stacking copy. Under torch.compile, and
    with the Triton or C++ kernels, there is no buffer (Inductor and the kernels read the list).

    `take(a, b)` gives the arguments of sources a..b-1 for `completed_attention` /
    `merge_partial`: (tensors, inv_rms (b - a, ...) or None, stacked or None). The C++ kernel
    computes the statistics itself, from rows it reads anyway: for it none are kept, and
    `stacked` is the pass's gradient sink with the sources' places in it (`cpu_fused.GradSink`:
    each call adds its source gradients into one buffer per source)."""

    def __init__(self, first: Tensor, capacity: int, eps: float, kernel: str) -> None:
        self.eps, self.kernel = eps, kernel
        self.sources: list[Tensor] = []
        self._inv_rms: list[Tensor] = []
        eager = kernel == "torch" and not torch.compiler.is_compiling()
        self._values = first.new_empty((capacity, *first.shape)) if eager else None
        impl = implementation(kernel)
        # the C++ kernel computes the statistic from the rows it reads anyway: none kept for it
        self._statistics = getattr(impl, "CACHED_STATISTICS", True)
        # and adds each call's source gradients into one buffer per source (`cpu_fused.GradSink`)
        sink = getattr(impl, "GradSink", None)
        tracing = torch.compiler.is_compiling()
        self._sink = sink() if sink is not None and torch.is_grad_enabled() and not tracing else None
        self._tracked: list[int | None] = []
        self.append(first)

    def append(self, source: Tensor, statistics: bool = True) -> None:
        """Add a completed source; `statistics=False` when nothing will attend to it (its key
        statistic is then not computed)."""
        index = len(self.sources)
        if self._values is not None:
            with torch.no_grad():
                self._values[index].copy_(source)
        tracked = self._sink is not None and source.requires_grad
        if tracked:
            source = self._sink.track(source, index)
        self._tracked.append(index if tracked else None)
        self.sources.append(source)
        if statistics and self._statistics:
            self._inv_rms.append(key_inv_rms(source, self.eps, self.kernel))

    def take(self, a: int = 0, b: int | None = None) -> tuple[list[Tensor], Tensor | None, Tensor | tuple | None]:
        b = len(self.sources) if b is None else b
        stacked = None if self._values is None else self._values[a:b]
        if self._sink is not None:
            stacked = (self._sink, self._tracked[a:b])
        return self.sources[a:b], torch.stack(self._inv_rms[a:b]) if self._statistics else None, stacked


def full_attn_res(
    embedding: Tensor,
    previous_outputs: Tensor | Sequence[Tensor],
    pseudo_query: Tensor,
    eps: float = 1e-6,
    kernel: str = "auto",
    output_norm_weight: Tensor | None = None,
) -> dict[str, Tensor]:
    """Full AttnRes input for one sublayer: depth attention over `[embedding, *previous_outputs]`.

    `embedding`: (..., D), e.g. (B, T, D); `previous_outputs`: a (layers, ..., D) tensor or a
    sequence of (..., D) tensors (layers may be 0); `pseudo_query`: (D,). No key-norm gain.
    Returns {"retrieved_representation": (..., D), "attention_weights": (S, ...)} with
    S = layers + 1, both in the input dtype (float32 statistics inside); the weights sum to 1
    per token. With `output_norm_weight` (D,), "retrieved_representation" is
    RMSNorm(h) * output_norm_weight (the next sublayer's pre-norm, fused). `kernel`: see the
    module docstring.
    """
    if isinstance(previous_outputs, Tensor):
        if previous_outputs.dim() != embedding.dim() + 1:
            raise ValueError(
                "previous_outputs as a tensor must be (layers, *embedding.shape), "
                f"(layers, {', '.join(map(str, embedding.shape))}), got shape {tuple(previous_outputs.shape)}"
            )
        previous_outputs = list(previous_outputs.unbind(0))  # views, no copy
    h, weights = depth_attention([embedding, *previous_outputs], pseudo_query, None, eps, kernel, output_norm_weight)
    return {"retrieved_representation": h, "attention_weights": weights}


def block_attn_res(
    blocks: Sequence[Tensor],
    partial_block: Tensor | None,
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
    kernel: str = "auto",
    output_norm_weight: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block AttnRes input for one sublayer: depth attention over `blocks + [partial_block]`.

    `blocks`: the completed blocks, `blocks[0]` being the embedding; `partial_block`: the
    running sum of the current block's outputs, or None when the block has none yet (an
    empty partial sum is left out, never attended to as zeros); all (..., D) of one shape.
    Returns h (..., D), or `(h, weights)` with weights (S, ...) when `return_weights`, both
    in the input dtype. With `output_norm_weight` (D,), h is RMSNorm(h) * output_norm_weight
    (the next sublayer's pre-norm, fused). `kernel`: see the module docstring.
    """
    sources = [*blocks] if partial_block is None else [*blocks, partial_block]
    h, weights = depth_attention(sources, pseudo_query, norm_weight, eps, kernel, output_norm_weight)
    return (h, weights) if return_weights else h

