"""The AttnRes ablations (arXiv 2603.15031, the ablation study of its experiments section),
as options of the AttnRes strategies: checked here, computed by the reference ops of
`attnres.functional`, and shared by Block and Full AttnRes.

| option | values (default first) | what sublayer l computes instead |
|---|---|---|
| `query` | "static", "input" | pseudo-query w_l(x) = x W_l, W_l (D, D), per token |
| `mixing` | "attention", "static" | weights softmax(z_l) of learned logits z_l, one per source |
| `scoring` | "softmax", "sigmoid" | weights sigmoid(logit_i) / sum_j sigmoid(logit_j) |
| `key_norm` | True, False | logits w_l . v_i from the raw sources |
| `heads` | 1, H | H groups of D / H channels, each its own logits and normalisation |
| `window` (Full) | None, W | the embedding and the last W sources only |

The store of reference texts this project reads holds no copy of the paper's ablation
section, so the exact forms below are choices, each made so that the option changes one thing
and reduces to the default at initialisation:

- `query="input"`: the state x is the newest source (Full: the latest output; Block: the
  partial block, or at a block's first sublayer the latest completed block; the output
  aggregation: the last source), taken raw, like the sources the op mixes. W_l starts at
  zero, so step 0 is still the uniform mean; it replaces the static w_l (no bias term).
- `mixing="static"`: z_l starts at zero (the uniform mean). It has no queries and no keys, so
  `query`, `scoring`, `key_norm` and `heads` do not apply to it (a ValueError says so), and it
  owns no key-norm gain. Logits are stored as an (L + 1, S_max) table, row l using its first
  S_l entries (or, with a window, those of the sources it sees).
- `scoring="sigmoid"`: normalised by the sum over sources, so the weights stay a convex
  combination (unnormalised sigmoid weights would let the input's scale grow with depth,
  which is what AttnRes removes) and the recorded rows sum to 1; zero queries still give the
  uniform mean, since every sigmoid is 1/2.
- `key_norm=False`: no RMSNorm, hence no key-norm gain either (`key_norm_gain` is moot).
- `heads=H`: head k's logit is w_l[k] . RMSNorm_k(v_i[k]), the RMS statistic over head k's
  own D / H channels (as per-head QK-norm does), so each head is scale-invariant by itself;
  the gain and query are sliced per head, so H adds no parameters. Recorded weights are the
  mean over heads.
- `window=W`: also for the output aggregation. Recorded rows keep the source columns, with
  weight 0 on the sources outside the window. W >= L hides no source: Full AttnRes exactly.

Any non-default option (a window W < L included) takes the reference path (one attention per
sublayer, plain PyTorch, whatever `kernel` says); the default configuration's fast path is
untouched. Parameters train in `attnres.training.lit.parameter_groups`' groups by name:
`query_proj` with the pseudo-queries (no decay, `query_lr_scale`), `mixing_logits` with the
other strategy parameters (no decay, the model's learning rate).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from attnres.functional import generalized_depth_attention, static_depth_mixing
from attnres.ops.dispatch import SCORINGS, promoted

QUERIES = ("static", "input")
MIXINGS = ("attention", "static")
DEFAULTS = {"query": "static", "mixing": "attention", "scoring": "softmax", "key_norm": True, "heads": 1}


def _choice(name: str, value: object, choices: Sequence[str], meaning: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))} ({meaning}), got {value!r}")


def check_ablations(d_model: int, query: str, mixing: str, scoring: str, key_norm: bool, heads: int) -> None:
    """Raise a one-line ValueError, naming the fix, for an unknown value or a combination
    that means nothing."""
    _choice("query", query, QUERIES, "'input': the pseudo-query is a learned D x D map of the current state")
    _choice("mixing", mixing, MIXINGS, "'static': learned per-source logits, no queries or keys")
    _choice("scoring", scoring, SCORINGS, "'sigmoid': sigmoid scores normalised by their sum")
    if not isinstance(key_norm, bool):
        raise ValueError(f"key_norm must be true or false (RMSNorm on the keys), got {key_norm!r}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d_model % heads:
        valid = ", ".join(str(h) for h in range(1, d_model + 1) if d_model % h == 0)
        raise ValueError(f"heads={heads!r} must divide d_model={d_model} (each head takes d_model / heads channels); "
                         f"valid values: {valid}")
    if mixing == "static":
        moot = [f"{k}={v!r}" for k, v in (("query", query), ("scoring", scoring), ("key_norm", key_norm),
                                          ("heads", heads)) if v != DEFAULTS[k]]
        if moot:
            verb = "means" if len(moot) == 1 else "mean"
            raise ValueError(f"mixing='static' has no queries or keys, so {', '.join(moot)} {verb} nothing with it; "
                             "leave query, scoring, key_norm and heads at their defaults or use mixing='attention'")


def check_window(window: object, num_layers: int) -> int | None:
    """The Full AttnRes window W: None (all sources) or a positive int."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int W (the embedding plus the last W sources; "
                         f"W >= {num_layers} sees them all) or null for no window")
    return window


def options_repr(strategy: nn.Module) -> str:
    """The non-default options as `key=value` pairs (empty for the default configuration)."""
    return "".join(f", {k}={getattr(strategy, k)!r}" for k, v in DEFAULTS.items() if getattr(strategy, k) != v)


def ablated_mix(
    strategy: nn.Module, index: int, sources: Sequence[Tensor], columns: Sequence[int] | None = None
) -> tuple[Tensor, Tensor]:
    """Sublayer `index`'s (h, weights (S, ...)) over `sources` under the strategy's options.
    `columns`: the source index (heatmap column) of each of `sources`, when they are not the
    first S (a window); only the static logits depend on it."""
    sources = promoted(sources)  # under autocast: a float32 embedding, bf16 outputs
    if strategy.mixing == "static":
        row = strategy.mixing_logits[index]  # (S_max,)
        return static_depth_mixing(sources, row[: len(sources)] if columns is None else row[list(columns)])
    if strategy.query == "input":
        state = sources[-1]  # (..., D), the newest source
        query = state.to(strategy.query_proj.dtype) @ strategy.query_proj[index]  # (..., D): x W_l
    else:
        query = strategy.pseudo_query[index]  # (D,)
    gain = None if strategy.key_norm_weight is None else strategy.key_norm_weight[index]
    return generalized_depth_attention(sources, query, gain, strategy.eps, scoring=strategy.scoring,
                                       heads=strategy.heads, key_norm=strategy.key_norm)
