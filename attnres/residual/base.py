"""The residual-strategy interface: what each sublayer reads, and what the network outputs.

A strategy is constructed as `Strategy(d_model, num_layers, **options)`, where `num_layers`
counts sublayers (every attention and every MLP is one; `L = 2 * n_layer`). Its
`forward(embedding, sublayers, **sublayer_kwargs)` runs the sublayers in order, calls each
as `sublayer(x, **sublayer_kwargs)`, and returns the hidden state that goes to the final
norm. `forward(encoder, src, mask=None, src_key_padding_mask=None, is_causal=None)` does
the same for the layers of a `torch.nn.TransformerEncoder`.

Subclasses implement `run` and route every sublayer call through `call_sublayer` and
every depth attention through `attend`; that is all it takes to support recording.
The AttnRes strategies also have a fast path (`kernel` option, see
`attnres.functional`): two-phase depth attention, taken on every pass that does not record.

A pass without gradients over at most `one_pass_tokens` tokens (each step of
`Transformer.generate()`, and a short prompt's prefill) takes a third route where the kernel has
one (`mix_one`: the C++ and plain-PyTorch kernels): one kernel call per sublayer over all its
sources (`run_one_pass`). With a token or a few, each call's fixed cost is what a mix costs, and
two-phase attention, which saves reads of the sources over many tokens, spends more calls and
more plumbing to save nothing (experiments/BENCHMARKS.md, "Decoding").

Knock-outs (`attnres.probes`) use the same two routes: while a knock-out is armed
(`residual._knockout`, set only inside `attnres.probes.knockout`), `call_sublayer` and `mix`
hand over to it and `fast_kernel` returns None, so the pass takes the reference path. With
no knock-out armed, nothing of this runs: the recording and fast paths are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnres.functional import KERNELS, SourceStack, completed_attention, depth_attention, fold_queries, resolve_kernel
from attnres.ops.dispatch import implementation, promoted
from attnres.residual.ablations import DEFAULTS, ablated_mix, check_ablations, options_repr

Sublayer = Callable[..., Tensor]


@dataclass
class DepthRecord:
    """What one recorded forward pass saw (all tensors detached).

    `weights[l]` is sublayer l's depth-attention weights, (S_l, B, T); index `num_layers`
    is the output aggregation. Source i of every row is column i of a heatmap: for Full
    AttnRes the embedding then each earlier output, for Block AttnRes the embedding then
    each block (the last one possibly partial). `input_rms[l]` / `output_rms[l]` are the
    RMS over D of sublayer l's input and output, averaged over tokens (float32 scalars).
    """

    num_layers: int
    weights: dict[int, Tensor] = field(default_factory=dict)
    input_rms: list[Tensor] = field(default_factory=list)
    output_rms: list[Tensor] = field(default_factory=list)


def _plain_sum(sources: Sequence[Tensor]) -> Tensor:
    out = sources[0]
    for v in sources[1:]:
        out = out + v
    return out


def _global_hooks() -> bool:
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def _mean_rms(x: Tensor) -> Tensor:
    return x.detach().float().pow(2).mean(dim=-1).sqrt().mean()


class ResidualStrategy(nn.Module):
    """Base class of every residual strategy; see the module docstring for the contract."""

    #: whether this strategy computes depth-attention weights (dashboards draw heatmaps then)
    has_depth_attention: bool = False
    #: whether its recorded weights are a softmax routed through `mix`, so that one source can be
    #: knocked out of a row and the rest renormalised (`attnres.probes.source_knockouts`)
    source_knockouts: bool = False
    #: parameters (attribute names) that scale the hidden state element-wise, such as a norm's
    #: gain: parametrization="mup" keeps their learning rate (`attnres.parametrization`); any
    #: other parameter with a width axis is taken as contracted with the hidden state over it
    elementwise_parameters: tuple[str, ...] = ()

    def __init__(self, d_model: int, num_layers: int, eps: float = 1e-6) -> None:
        super().__init__()
        if d_model < 1 or num_layers < 1:
            raise ValueError(f"d_model and num_layers must be positive, got {d_model} and {num_layers}")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps!r}")
        self.d_model, self.num_layers, self.eps = d_model, num_layers, eps
        self._record_next = False
        self._record: DepthRecord | None = None
        self.recorded: DepthRecord | None = None
        self._knockout: Any = None  # an attnres.probes knock-out, only while one is armed

    def depth_layout(self) -> tuple[str, list[str], str]:
        """(name for figure titles, heatmap column labels, what the columns are). Column i is
        source i of `record_weights`; with no labels the dashboards number the sources."""
        return type(self).__name__, [], "source"

    # -- recording ---------------------------------------------------------------------------
    def record_next(self) -> None:
        """Record weights and magnitudes during the next forward pass only."""
        self._record_next = True

    @property
    def recording(self) -> bool:
        """Whether the pass now running records (strategies may skip a fast path then)."""
        return self._record is not None

    def record_weights(self, index: int, weights: Tensor) -> None:
        """Record sublayer `index`'s weights over its sources, (S, B, T) and summing to 1 over S
        (expand input-independent weights to that shape), when this pass records. Index
        `num_layers` is the output. Source 0 is the embedding; the rest follow the strategy's
        docstring, so heatmaps of different strategies read the same way."""
        if self._record is None:
            return
        self._record.weights[index] = weights.detach()

    # -- running -----------------------------------------------------------------------------
    def forward(self, first: Tensor | nn.TransformerEncoder, *args: Any, **kwargs: Any) -> Tensor:
        if isinstance(first, nn.TransformerEncoder):
            return self._forward_encoder(first, *args, **kwargs)
        if len(args) != 1:
            raise TypeError("forward(embedding, sublayers, **sublayer_kwargs) takes exactly two positional arguments")
        embedding, sublayers = first, args[0]
        if len(sublayers) != self.num_layers:
            raise ValueError(
                f"{type(self).__name__} was built for num_layers={self.num_layers} sublayers "
                f"but got {len(sublayers)}"
            )
        self._record = DepthRecord(self.num_layers) if self._record_next else None
        self._record_next = False
        try:
            out = self.run(embedding, sublayers, kwargs)
        finally:
            self.recorded, self._record = self._record, None
        return out

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        raise NotImplementedError

    def call_sublayer(self, index: int, sublayer: Sublayer, x: Tensor, sublayer_kwargs: dict[str, Any]) -> Tensor:
        if self._knockout is None:
            out = sublayer(x, **sublayer_kwargs)
        else:  # a knock-out pass: it may reuse a cached output, or remove this one
            out = self._knockout.call_sublayer(index, sublayer, x, sublayer_kwargs)
        if self._record is not None:
            self._record.input_rms.append(_mean_rms(x))
            self._record.output_rms.append(_mean_rms(out))
        return out

    def _forward_encoder(
        self,
        encoder: nn.TransformerEncoder,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        layers = list(encoder.layers)
        if self.num_layers != 2 * len(layers):
            raise ValueError(
                f"a TransformerEncoder with {len(layers)} layers has {2 * len(layers)} sublayers "
                f"(attention + feed-forward each); build {type(self).__name__} with num_layers={2 * len(layers)}, "
                f"not {self.num_layers}"
            )
        # as nn.TransformerEncoder.forward does: boolean masks become additive float masks of src's
        # dtype, so a boolean padding mask next to the float causal mask made below is not a mismatch
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask,
            mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(mask),
            other_name="mask",
            target_type=src.dtype,
        )
        mask = F._canonical_mask(
            mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype, check_other=False
        )
        if is_causal and mask is None:
            seq_len = src.shape[1] if layers and layers[0].self_attn.batch_first else src.shape[0]
            mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=src.device, dtype=src.dtype)
        causal = bool(is_causal)
        sublayers: list[Sublayer] = []
        for layer in layers:
            # the pre-norm halves of the layer, whatever its `norm_first` says (DESIGN.md section 2)
            sublayers.append(
                lambda h, layer=layer: layer._sa_block(layer.norm1(h), mask, src_key_padding_mask, is_causal=causal)
            )
            sublayers.append(lambda h, layer=layer: layer._ff_block(layer.norm2(h)))
        out = self(src, sublayers)
        return encoder.norm(out) if encoder.norm is not None else out


class DepthAttentionResidual(ResidualStrategy):
    """Shared state of the AttnRes strategies: one pseudo-query and key norm per sublayer,
    plus one for the output aggregation (`num_layers + 1` in all).

    Pseudo-queries start at zero, so at step 0 every sublayer reads the uniform mean of its
    sources. `key_norm_gain=False` drops the learnable gain of the key RMSNorm.
    `output_aggregation=False` replaces the final depth attention by the plain sum of all
    sources (which is the standard residual stream).

    `kernel` ("auto", "triton", "torch" or "naive"; `attnres.functional`) picks the
    implementation. Except with "naive", passes that do not record take the two-phase fast
    path (`fast_kernel`); recording passes run one depth attention per sublayer through
    `attend`, so the recorded weights are those of exactly the op the strategy defines.

    The paper's ablations are options (`attnres.residual.ablations` has what each computes):
    `query` ("static" | "input"), `mixing` ("attention" | "static"), `scoring` ("softmax" |
    "sigmoid"), `key_norm` (True | False) and `heads` (H dividing D); the defaults are AttnRes
    as above. Any other value takes the reference path on every pass. The parameters follow
    the options: `pseudo_query` (L + 1, D) for a static query, `query_proj` (L + 1, D, D) for
    an input-dependent one, `key_norm_weight` (L + 1, D) with a key norm and its gain,
    `mixing_logits` (L + 1, max_sources) for static mixing; the others are None.
    `max_sources` is the most sources a row has (default L + 1, Full AttnRes's output).
    `fuse_prenorm` (default True) fuses each sublayer's pre-norm into the mix that makes its input (`prenorm_of`).
    """

    has_depth_attention = True
    source_knockouts = True
    elementwise_parameters = ("key_norm_weight",)
    #: the most tokens (B * T) a pass without gradients may have to take the one-pass route
    #: (module docstring); 0: never. Set by each strategy where it measured the crossover.
    one_pass_tokens: int = 0

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
        max_sources: int | None = None,
        fuse_prenorm: bool = True,
    ) -> None:
        super().__init__(d_model, num_layers, eps)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
        if not isinstance(fuse_prenorm, bool):
            raise ValueError(f"fuse_prenorm={fuse_prenorm!r} must be True or False (the sublayers' pre-norm fused "
                             "into their depth mix, or not)")
        check_ablations(d_model, query, mixing, scoring, key_norm, heads)
        self.kernel = kernel
        # whether the two-phase path hands a sublayer its input already through the sublayer's own
        # pre-norm, fused into the depth mix (`prenorm_of`; the YAML key residual.fuse_prenorm). On by
        # default: at 12 x 32, 8 x 40 and 8 x 96 a train step was 2% to 6% cheaper fused in every run
        # (experiments/BENCHMARKS.md, "The next pre-norm fused")
        self.fuse_prenorm = fuse_prenorm
        self.output_aggregation = output_aggregation
        self.query, self.mixing, self.scoring, self.key_norm, self.heads = query, mixing, scoring, key_norm, heads
        # any ablation runs the reference op on every pass (`fast_kernel`)
        self.ablated = any(getattr(self, name) != value for name, value in DEFAULTS.items())
        rows, attention = num_layers + 1, mixing == "attention"
        self.pseudo_query = nn.Parameter(torch.zeros(rows, d_model)) if attention and query == "static" else None
        # zero, so step 0 still reads the uniform mean
        self.query_proj = nn.Parameter(torch.zeros(rows, d_model, d_model)) if attention and query == "input" else None
        gain = attention and key_norm and key_norm_gain
        self.key_norm_weight = nn.Parameter(torch.ones(rows, d_model)) if gain else None
        width = num_layers + 1 if max_sources is None else max_sources
        self.mixing_logits = None if attention else nn.Parameter(torch.zeros(rows, width))  # (L + 1, S_max)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for zeros in (self.pseudo_query, self.query_proj, self.mixing_logits):
                if zeros is not None:
                    zeros.zero_()
            if self.key_norm_weight is not None:
                self.key_norm_weight.fill_(1.0)

    def fast_kernel(self, like: Tensor) -> str | None:
        """The implementation of the two-phase fast path for inputs like `like`, or None when
        this pass takes the one-attention-per-sublayer path (recording, a knock-out,
        kernel="naive", or an ablation option)."""
        if self._record is not None or self._knockout is not None or self.kernel == "naive" or self.ablated:
            return None
        return resolve_kernel(self.kernel, like)

    def one_pass_mix(self, like: Tensor, kernel: str) -> Callable | None:
        """The kernel's `mix_one(sources, queries (L + 1, D), row, eps) -> h` when this pass takes
        the one-pass route (module docstring): no gradient, at most `one_pass_tokens` tokens, not
        traced by torch.compile (its graph stays the two-phase one), no autocast (one dtype);
        else None."""
        if torch.is_grad_enabled() or like.numel() > self.one_pass_tokens * like.shape[-1]:
            return None
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(like.device.type):
            return None
        return getattr(implementation(kernel), "mix_one", None)

    def run_one_pass(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any],
                     mix_one: Callable, starts: Any) -> Tensor:
        """Each sublayer's depth attention over all its sources in one call of `mix_one`: the
        completed sources, then the running sum of the outputs since the last start (Block: the
        partial block; Full, where every sublayer starts one: the newest output). `starts`: the
        sublayers that close the running sum into a completed source (`in` is all it needs)."""
        eps = self.eps
        queries = self.fast_queries(embedding).contiguous()  # (L + 1, D), gain-folded; the kernel picks its row
        done = [embedding]  # completed sources, each (B, T, D)
        partial: Tensor | None = None
        for index, sublayer in enumerate(sublayers):
            if partial is not None and index in starts:
                done.append(partial)
                partial = None
            h = mix_one(done if partial is None else [*done, partial], queries, index, eps)
            out = self.call_sublayer(index, sublayer, h, sublayer_kwargs)
            partial = out if partial is None else partial + out
        done.append(partial)
        return mix_one(done, queries, self.num_layers, eps) if self.output_aggregation else _plain_sum(done)

    def mix(self, index: int, sources: Sequence[Tensor], columns: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """(h, weights (S, ...)) of depth attention over `sources` with the parameters of
        `index`, not recorded. `columns`: each source's index in the row, when `sources` are
        not its first S (a window). On a knock-out pass, the knock-out decides which sources
        take part (`attnres.probes`); the weights keep one row per source (0 where removed)."""
        if self._knockout is not None:
            return self._knockout.mix(self, index, sources, columns)
        return self.reference_mix(index, sources, columns)

    def reference_mix(
        self, index: int, sources: Sequence[Tensor], columns: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """`mix` as the strategy defines it, whatever pass is running."""
        if self.ablated:
            return ablated_mix(self, index, sources, columns)
        gain = None if self.key_norm_weight is None else self.key_norm_weight[index]
        return depth_attention(promoted(sources), self.pseudo_query[index], gain, self.eps, self.kernel)

    def attend(self, index: int, sources: Sequence[Tensor]) -> Tensor:
        """Depth attention over `sources` with the query and key norm of `index`, recorded."""
        h, weights = self.mix(index, sources)
        self.record_weights(index, weights)
        return h

    def output(self, sources: Sequence[Tensor]) -> Tensor:
        if self.output_aggregation:
            return self.attend(self.num_layers, sources)
        return _plain_sum(sources)

    # -- the fast path's shared pieces -----------------------------------------------------------
    def prenorm_of(self, sublayer: Sublayer) -> tuple[Tensor, float] | None:
        """(weight, eps) of `sublayer`'s pre-norm when the fast path may fuse it into the sublayer's
        depth mix and call `sublayer.forward_normed` with the result (`attnres.Transformer`'s
        sublayers: their RMSNorm is `norm`); None when `fuse_prenorm` is off, the sublayer has no
        such pair, or a hook watches it or its norm (the hook would see the normed input, or none)."""
        if not self.fuse_prenorm or not hasattr(sublayer, "forward_normed"):
            return None
        norm = getattr(sublayer, "norm", None)
        weight, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
        if not isinstance(weight, Tensor) or not isinstance(eps, float):
            return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in (sublayer, norm)) or _global_hooks():
            return None
        return weight, eps

    def fast_queries(self, like: Tensor) -> Tensor:
        """All L + 1 queries with the key-norm gains folded in, (L + 1, D), statistics dtype."""
        return fold_queries(self.pseudo_query, self.key_norm_weight, like.dtype)

    def fast_output(self, sources: SourceStack, queries: Tensor, kernel: str) -> Tensor:
        """The output aggregation over all of `sources` (their key statistics known)."""
        if not self.output_aggregation:
            return _plain_sum(sources.sources)
        done, done_rms, stacked = sources.take()
        outs, _ = completed_attention(done, done_rms, queries[self.num_layers :], self.eps, kernel, stacked)
        return outs[0]

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_layers={self.num_layers}, eps={self.eps}, "
            f"key_norm_gain={self.key_norm_weight is not None}, output_aggregation={self.output_aggregation}, "
            f"kernel={self.kernel!r}" + options_repr(self)  # the ablation options set, if any
            + ("" if self.fuse_prenorm else ", fuse_prenorm=False")  # only what is not the default, as above
        )
