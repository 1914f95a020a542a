"""Block Attention Residuals (Kimi Team, arXiv 2603.15031).

The L sublayers are cut into N consecutive blocks of S = L / N, or of the sizes
`block_sizes` gives (any positive sizes summing to L, e.g. a shorter last block where N
does not divide L, as Megatron-LM allows). The embedding is block b_0, a source of its
own. b_n (n >= 1) is the plain sum of the outputs of block n's sublayers. The first
sublayer of block n attends over the completed blocks [b_0, ..., b_{n-1}]; its i-th
sublayer (i >= 2) also over the partial sum b_n^{i-1} of the block's first i-1 outputs.
The output aggregates over all N + 1 blocks.
Memory O(N * D) per token; N = L is Full AttnRes exactly.

The released Kimi K3 (conf/residual/kimi.yaml) counts its block size in decoder layers
(`block_size_layers`, its `attn_res_block_size`: blocks of 2k sublayers, the last one shorter
where k does not divide n_layer) and draws its pseudo-queries from normal(0, 0.02)
(`query_init_std`); both are options, off by default (the paper's zero queries). Its checkpoint's
AttnRes tensors map in and out at the end of this module (`load_kimi_attn_res`).

Where this departs from an often-shared sketch of the same API, it follows the paper:
a block's empty partial sum is left out rather than attended to as a zero source, and
the output is a final depth attention over all blocks, not the last block's partial sum.

Fast path (two-phase, DESIGN.md section 4): a completed block never changes, so its key
statistic is computed once; at the start of block n its S_n sublayers' queries meet all
completed blocks in one batched pass (phase 1, `completed_attention`), and sublayer i >= 2
then merges only its own partial sum into that result with an online-softmax update
(phase 2, `merge_partial`). Unequal blocks take the same path: phase 1 serves any number
of queries. Where it reads less (`ahead_blocks`: blocks 3-4, 5-6 and 7-8 of the default N=8),
a block's phase-1 pass serves the next block's queries too, over all blocks completed so far;
the next block then merges only the one block completed in between (`merge_completed`): each
completed block is read, and its gradient added into, once for both. The output's query joins
the last phase-1 pass and merges only the blocks completed after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from attnres.functional import SourceStack, completed_attention, merge_completed, merge_partial, merge_queries
from attnres.residual.base import DepthAttentionResidual, Sublayer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Default(int):
    """An int default that knows it was not passed: the signature says `num_blocks=8` (the
    paper's N), yet `block_sizes=[4, 2]` alone is not "inconsistent with num_blocks=8"."""


DEFAULT_NUM_BLOCKS = _Default(8)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_block_sizes(
    num_layers: int, num_blocks: int | None = DEFAULT_NUM_BLOCKS, block_sizes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The sublayers per block, (S_1, ..., S_N), from `num_blocks` (equal blocks; N must divide
    L) or `block_sizes` (positive ints summing to L; wins over a default `num_blocks`, and an
    explicit `num_blocks` must then equal its length). Raises a one-line ValueError otherwise."""
    if block_sizes is not None:
        # any sequence of ints (a list, a tuple, Hydra's ListConfig), not a string
        iterable = hasattr(block_sizes, "__iter__") and not isinstance(block_sizes, (str, bytes))
        sizes = list(block_sizes) if iterable else None
        if not sizes or not all(_is_count(n) and n >= 1 for n in sizes) or sum(sizes) != num_layers:
            raise ValueError(
                f"block_sizes={block_sizes!r} must be positive ints (sublayers per block) summing to the "
                f"{num_layers} sublayers"
            )
        if num_blocks is not DEFAULT_NUM_BLOCKS and num_blocks is not None and num_blocks != len(sizes):
            raise ValueError(
                f"num_blocks={num_blocks} disagrees with block_sizes={sizes} ({len(sizes)} blocks); give one of them"
            )
        return tuple(sizes)
    if not _is_count(num_blocks) or num_blocks < 1 or num_layers % num_blocks != 0:
        raise ValueError(
            f"num_blocks={num_blocks} must divide the {num_layers} sublayers (2 per transformer layer), or give "
            f"block_sizes=[...] (sublayers per block, summing to {num_layers}) for unequal blocks; "
            f"valid values: {', '.join(map(str, _divisors(num_layers)))}"
        )
    return (num_layers // num_blocks,) * num_blocks


def layer_block_sizes(num_layers: int, block_size_layers: int) -> tuple[int, ...]:
    """Sublayers per block for blocks of `block_size_layers` decoder layers (2 sublayers each),
    as Kimi K3 counts them (`attn_res_block_size`): blocks start at layers 0, k, 2k, ..., the
    last one partial. K3's 93 layers at k = 12: (24,) * 7 + (18,). One-line ValueError otherwise."""
    if not _is_count(block_size_layers) or block_size_layers < 1:
        raise ValueError(f"block_size_layers={block_size_layers!r} must be a positive int (decoder layers per block, "
                         "2 sublayers each)")
    if num_layers % 2:
        raise ValueError(f"block_size_layers counts decoder layers (attention + MLP), so num_layers must be even, "
                         f"got {num_layers} sublayers; give block_sizes=[...] in sublayers instead")
    full, rest = divmod(num_layers // 2, block_size_layers)
    return (2 * block_size_layers,) * full + ((2 * rest,) if rest else ())


def ahead_blocks(sizes: Sequence[int]) -> tuple[bool, ...]:
    """For each block, whether the fast path runs the next block's phase 1 with its own (one
    pass over the completed blocks for both; the next block then merges only the block
    completed in between, `merge_completed`). Block n (from 0) reads c = n + 1 completed blocks.
    Paired, those c are read once instead of twice forward and backward and their gradients
    added into once instead of twice: 4c tensor passes (one (..., D) tensor each) fewer. The
    next block's S' queries cost 5 more each: their early results written and read forward,
    read again for the merge's backward, and their gradients written and read. Paired when
    4c > 5 S', each block in one pair at most: N=8 blocks of 2 pair blocks 2-3, 4-5 and 6-7 (from 0)."""
    ahead = [False] * len(sizes)
    n = 0
    while n + 1 < len(sizes):
        if 4 * (n + 1) > 5 * sizes[n + 1]:
            ahead[n] = True
            n += 2
        else:
            n += 1
    return tuple(ahead)


class BlockAttentionResidual(DepthAttentionResidual):
    """Block AttnRes as a drop-in module: `forward(embedding, sublayers, **kw)` or
    `forward(encoder, src, mask=None, src_key_padding_mask=None, is_causal=None)`.

    Owns `num_layers + 1` pseudo-queries and key norms; the last is the output
    aggregation, which `forward` returns. Blocks are `num_blocks` equal ones
    (`num_layers % num_blocks != 0` is a ValueError naming the valid values), or
    `block_sizes`, the sublayers per block (positive, summing to `num_layers`; a shorter
    last block, say). With `block_sizes`, `num_blocks` may be left out; given, it must
    equal `len(block_sizes)`. `block_size_layers=k` gives blocks of k decoder layers (2k
    sublayers; Kimi K3's `attn_res_block_size`), the last one shorter where k does not divide
    `num_layers / 2`; it excludes `block_sizes` and an explicit `num_blocks`. `self.block_sizes`
    is the tuple either way, `self.block_size` the common S of equal blocks (None for unequal ones).

    `query_init_std`: 0 (default) starts every pseudo-query at zero, as the paper prescribes;
    s > 0 draws them from normal(0, s), as K3 does (`initializer_range` 0.02). It draws random
    numbers, so the model's other weights must be drawn first (`attnres.Transformer` builds its
    residual last).

    The ablation options (`query`, `mixing`, `scoring`, `key_norm`, `heads`) are those of
    `DepthAttentionResidual` (`attnres.residual.ablations`); an input-dependent query reads
    the partial block, or at a block's first sublayer the latest completed block. `window` is
    a Full AttnRes option and raises here.
    """

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        num_blocks: int = DEFAULT_NUM_BLOCKS,
        eps: float = 1e-6,
        key_norm_gain: bool = True,
        output_aggregation: bool = True,
        kernel: str = "auto",
        block_sizes: Sequence[int] | None = None,
        *,
        query: str = "static",
        mixing: str = "attention",
        scoring: str = "softmax",
        key_norm: bool = True,
        heads: int = 1,
        window: None = None,
        block_size_layers: int | None = None,
        query_init_std: float = 0.0,
        fuse_prenorm: bool = True,
    ) -> None:
        if window is not None:
            raise ValueError(f"window={window!r} is a Full AttnRes option (a sliding window over its per-sublayer "
                             "sources); Block AttnRes bounds its sources by num_blocks: use residual=full with "
                             "residual.window, or drop window")
        if block_size_layers is not None:
            if block_sizes is not None or (num_blocks is not DEFAULT_NUM_BLOCKS and num_blocks is not None):
                raise ValueError(f"block_size_layers={block_size_layers!r} sets the blocks itself; drop num_blocks "
                                 "and block_sizes, or drop block_size_layers")
            block_sizes = layer_block_sizes(num_layers, block_size_layers)
        if not (isinstance(query_init_std, (int, float)) and query_init_std >= 0):
            raise ValueError(f"query_init_std={query_init_std!r} must be a number >= 0 (0: zero-initialised queries)")
        sizes = resolve_block_sizes(num_layers, num_blocks, block_sizes)
        super().__init__(d_model, num_layers, eps, key_norm_gain, output_aggregation, kernel, query=query,
                         mixing=mixing, scoring=scoring, key_norm=key_norm, heads=heads, max_sources=len(sizes) + 1,
                         fuse_prenorm=fuse_prenorm)
        self.block_sizes = sizes
        self.num_blocks = len(sizes)
        self.block_size = sizes[0] if len(set(sizes)) == 1 else None  # S, sublayers per block, if equal
        # the first sublayer of each block: where the partial sum is closed into a completed block
        self._starts = tuple(sum(sizes[:n]) for n in range(len(sizes)))
        self._ahead = ahead_blocks(sizes)
        # without gradients the one-pass route reads at most N + 1 sources per sublayer: cheaper than
        # the two-phase plumbing up to 512 tokens at least (experiments/BENCHMARKS.md, "Decoding")
        self.one_pass_tokens = 512
        self.block_size_layers, self.query_init_std = block_size_layers, float(query_init_std)
        if self.query_init_std:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.query_init_std and self.pseudo_query is not None:
            with torch.no_grad():
                self.pseudo_query.normal_(0.0, self.query_init_std)

    def run(self, embedding: Tensor, sublayers: Sequence[Sublayer], sublayer_kwargs: dict[str, Any]) -> Tensor:
        kernel = self.fast_kernel(embedding)
        if kernel is not None:
            mix_one = self.one_pass_mix(embedding, kernel)
            if mix_one is not None:  # decoding: one call per sublayer (DepthAttentionResidual)
                return self.run_one_pass(embedding, sublayers, sublayer_kwargs, mix_one, self._starts)
            return self._run_two_phase(embedding, sublayers, sublayer_kwargs, kernel)
        starts = set(self._starts)
        blocks = [embedding]  # completed blocks, each (B, T, D)
        partial: Tensor | None = None  # b_n^i; None while block n has no output yet
        for index, sublayer in enumerate(sublayers):
            if index > 0 and index in starts:
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
        eps = self.eps
        queries = self.fast_queries(embedding)  # (L + 1, D)
        blocks = SourceStack(embedding, self.num_blocks + 1, eps, kernel)  # completed blocks
        early: tuple[list[Tensor], Tensor] | None = None  # this block's phase 1 but for the newest block
        # a kernel whose merge serves one query at a time would read the newest block once per query
        ahead = self._ahead if merge_queries(kernel) is None else (False,) * self.num_blocks
        # the output's query joins the last phase-1 pass when that reads 2 or more blocks (the
        # reckoning of `ahead_blocks` with S' = 1), and merges the blocks completed since at the end
        last = max(n for n in range(self.num_blocks) if n == 0 or not ahead[n - 1])
        output_early = self.output_aggregation and last >= 1
        early_output: tuple[list[Tensor], Tensor] | None = None
        L = self.num_layers
        for n, (start, S) in enumerate(zip(self._starts, self.block_sizes, strict=True)):
            # each site's pre-norm (weight, eps), fused into its mix, or None (`prenorm_of`); a
            # block's first sublayer is output 0 of the pass that serves its queries
            norms = [self.prenorm_of(sublayers[start + i]) for i in range(S)]
            first = norms[0] or (None, None)
            if early is None:
                # phase 1: the S queries of this block (and of the next, see `ahead_blocks`)
                # against all completed blocks, one pass
                stop = start + S + (self.block_sizes[n + 1] if ahead[n] else 0)
                joins = output_early and n == last  # the output's query rides along
                mine = torch.cat((queries[start:stop], queries[L:])) if joins else queries[start:stop]
                done, done_rms, stacked = blocks.take()
                accs, lse = completed_attention(done, done_rms, mine, eps, kernel, stacked, *first)
                if joins:
                    early_output, accs, lse = (accs[-1:], lse[-1:]), accs[:-1], lse[:-1]
                if ahead[n]:
                    early, accs, lse = (accs[S:], lse[S:]), accs[:S], lse[:S]
            else:  # phase 1 done a block early: the newest completed block merged in
                newest, newest_rms, stacked = blocks.take(n, n + 1)
                accs, lse = merge_completed(*early, newest, newest_rms, queries[start : start + S], eps, kernel,
                                            stacked, *first)
                early = None
            partial: Tensor | None = None
            for i in range(S):
                index = start + i
                if partial is None:
                    h = accs[i]
                else:  # phase 2: fold in this block's partial sum (online softmax)
                    h = merge_partial(accs[i], lse[i], [partial], None, queries[index], eps, kernel, None,
                                      *(norms[i] or (None, None)))
                if norms[i] is None:
                    out = self.call_sublayer(index, sublayers[index], h, sublayer_kwargs)
                else:  # h is the sublayer's pre-norm of the mix already
                    out = sublayers[index].forward_normed(h, **sublayer_kwargs)
                partial = out if partial is None else partial + out
            blocks.append(partial, statistics=start + S < self.num_layers or self.output_aggregation)
        if early_output is None:
            return self.fast_output(blocks, queries, kernel)
        newer, newer_rms, stacked = blocks.take(last + 1, self.num_blocks + 1)
        outs, _ = merge_completed(*early_output, newer, newer_rms, queries[L:], eps, kernel, stacked)
        return outs[0]

    def depth_layout(self) -> tuple[str, list[str], str]:
        cols = ["emb", *(f"block {n}" for n in range(1, self.num_blocks + 1))]
        return (f"Block AttnRes (N={self.num_blocks})", cols,
                "source: the embedding, then each block (in a row, its own block is the partial sum so far)")

    def extra_repr(self) -> str:
        blocks = f"num_blocks={self.num_blocks}"
        if self.block_size_layers is not None:
            blocks += f", block_size_layers={self.block_size_layers}"
        if self.block_size is None:
            blocks += f", block_sizes={list(self.block_sizes)}"
        init = f", query_init_std={self.query_init_std}" if self.query_init_std else ""
        return f"{blocks}, " + super().extra_repr() + init


# -- Kimi K3's AttnRes parameters in and out ---------------------------------------------------------
# The released K3 names site 2 i (decoder layer i, before attention)
# `model.layers.{i}.self_attention_res_{proj,norm}.weight`, site 2 i + 1 (before the MLP)
# `model.layers.{i}.mlp_res_{proj,norm}.weight`, and site L (before the final norm)
# `model.output_attn_res_{proj,norm}.weight`, optionally under `language_model.`; projections (1, D),
# norm weights (D,), stored in bf16. Its logit proj . (v * rsqrt(mean(v^2) + eps)) * norm_weight is
# w . RMSNorm_g(v): a site's projection is row l of `pseudo_query`, its norm weight row l of
# `key_norm_weight`, nothing transposed or rescaled.

_K3_OUTPUT_PROJ = "output_attn_res_proj.weight"
_K3_OUTPUT_NORM = "output_attn_res_norm.weight"
_K3_SITES = ("self_attention", "mlp")  # a layer's two sites, in order: before attention, before the MLP
KIMI_EPS = 1e-5  # K3's rms_norm_eps


def kimi_prefix(state_dict: Mapping[str, Tensor]) -> str:
    """The prefix in front of `layers.` and `output_attn_res_*` in a K3-format state dict:
    "model." or "language_model.model." (any prefix ending in "model." is taken)."""
    found = sorted({k[: -len(_K3_OUTPUT_PROJ)] for k in state_dict if k.endswith("model." + _K3_OUTPUT_PROJ)})
    if len(found) != 1:
        what = "no key" if not found else f"{len(found)} keys ({', '.join(p + _K3_OUTPUT_PROJ for p in found)})"
        raise ValueError(f"a K3-format state dict has one '...model.{_K3_OUTPUT_PROJ}'; found {what}")
    return found[0]


def kimi_names(num_layers: int, prefix: str = "model.") -> list[tuple[str, str]]:
    """(projection key, norm key) of each of the `num_layers + 1` sites, in site order."""
    if num_layers % 2:
        raise ValueError(f"K3 has two sites per decoder layer; num_layers={num_layers} sublayers is odd")
    names = []
    for layer in range(num_layers // 2):
        for site in _K3_SITES:
            base = f"{prefix}layers.{layer}.{site}_res_"
            names.append((base + "proj.weight", base + "norm.weight"))
    names.append((prefix + _K3_OUTPUT_PROJ, prefix + _K3_OUTPUT_NORM))
    return names


def _is_attn_res_key(key: str) -> bool:
    return key.endswith(("_res_proj.weight", "_res_norm.weight"))


def kimi_num_layers(state_dict: Mapping[str, Tensor]) -> tuple[int, int]:
    """(sublayers L, width D) of the AttnRes tensors of a K3-format state dict."""
    prefix = kimi_prefix(state_dict)
    # a dict with "language_model." on some layers only would otherwise read as missing layers
    stray = sorted(k for k in state_dict if _is_attn_res_key(k) and not k.startswith(prefix))
    if stray:
        raise ValueError(f"the K3 state dict's AttnRes keys do not all carry the prefix '{prefix}' (its output's): "
                         f"{len(stray)} do not, e.g. {stray[0]}; rename them to one prefix")
    layers = {int(k[len(prefix) + 7:].split(".", 1)[0]) for k in state_dict
              if k.startswith(prefix + "layers.") and k.endswith("_res_proj.weight")}
    if layers != set(range(len(layers))):
        raise ValueError(f"the K3 state dict's layers with AttnRes tensors are not 0 .. n-1: {sorted(layers)}")
    return 2 * len(layers), state_dict[prefix + _K3_OUTPUT_PROJ].shape[-1]


def _check(residual: BlockAttentionResidual) -> None:
    if not isinstance(residual, BlockAttentionResidual):
        raise TypeError(f"K3's AttnRes is Block AttnRes; got {type(residual).__name__}")
    if residual.pseudo_query is None or residual.key_norm_weight is None:
        raise ValueError("K3's AttnRes has a static pseudo-query and a key-norm gain per site: build the strategy "
                         "with query='static', mixing='attention', key_norm=True and key_norm_gain=True")


@torch.no_grad()
def load_kimi_attn_res(residual: BlockAttentionResidual, state_dict: Mapping[str, Tensor]) -> list[str]:
    """Copy a K3-format state dict's AttnRes tensors into `residual`'s `pseudo_query` and
    `key_norm_weight` rows (cast to their dtype). All 2 (L + 1) tensors must be there with the
    right shapes and finite, under one prefix, and the state dict must have exactly L / 2 layers of them;
    each is checked before any row is copied. Returns the keys read."""
    _check(residual)
    L, D = residual.num_layers, residual.d_model
    layers, width = kimi_num_layers(state_dict)
    if (layers, width) != (L, D):
        raise ValueError(f"the K3 state dict has {layers // 2} layers ({layers} sublayers) of width {width}; the "
                         f"strategy has {L} sublayers of width {D}")
    names = kimi_names(L, kimi_prefix(state_dict))
    missing = [k for pair in names for k in pair if k not in state_dict]
    if missing:
        raise KeyError(f"the K3 state dict lacks {len(missing)} AttnRes tensors, e.g. {missing[0]}")
    # every tensor checked before the first row is copied: a refusal leaves the strategy as it was
    for proj, norm in names:
        for key, shape in ((proj, (1, D)), (norm, (D,))):
            if tuple(state_dict[key].shape) != shape:
                raise ValueError(f"{key} has shape {tuple(state_dict[key].shape)}, expected {shape}")
            if not torch.isfinite(state_dict[key]).all():
                raise ValueError(f"{key} holds NaN or infinite values; the state dict is damaged")
    for row, (proj, norm) in enumerate(names):
        residual.pseudo_query[row].copy_(state_dict[proj][0])
        residual.key_norm_weight[row].copy_(state_dict[norm])
    return [k for pair in names for k in pair]


@torch.no_grad()
def kimi_attn_res_state_dict(residual: BlockAttentionResidual, prefix: str = "model.",
                             dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """`residual`'s pseudo-queries and key-norm gains under K3's names (`prefix` "model." or
    "language_model.model."), projections (1, D) and norm weights (D,), in `dtype` (default
    theirs; K3 stores bfloat16). New tensors, detached."""
    _check(residual)
    dtype = dtype or residual.pseudo_query.dtype
    out = {}
    for row, (proj, norm) in enumerate(kimi_names(residual.num_layers, prefix)):
        out[proj] = residual.pseudo_query[row].detach().to(dtype).clone().unsqueeze(0)
        out[norm] = residual.key_norm_weight[row].detach().to(dtype).clone()
    return out


def kimi_block_attention_residual(state_dict: Mapping[str, Tensor], attn_res_block_size: int,
                                  **options) -> BlockAttentionResidual:
    """The Block AttnRes a K3-format state dict and its config's `attn_res_block_size` (decoder
    layers per block) describe, with its parameters loaded: L and D from the tensors, eps 1e-5
    (K3's `rms_norm_eps`) unless `options` say otherwise, on the CPU in float32."""
    L, D = kimi_num_layers(state_dict)
    residual = BlockAttentionResidual(D, L, block_size_layers=attn_res_block_size, **{"eps": KIMI_EPS, **options})
    load_kimi_attn_res(residual, state_dict)
    return residual
