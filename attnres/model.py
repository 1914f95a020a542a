"""A decoder-only Transformer whose residual connection is a plugin.

nanoGPT names (n_layer, n_head, n_embd, block_size, vocab_size, dropout, bias), RMSNorm
pre-norm sublayers, rotary positions, causal attention through
`scaled_dot_product_attention`, a GELU or SwiGLU MLP, optional tied embeddings.
Every attention and every MLP is one sublayer (L = 2 * n_layer) that includes its own
pre-norm; the residual strategy decides what each reads and what the model outputs.
This file knows no particular strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnres import parametrization as param
from attnres.residual import ResidualStrategy, StandardResidual

ResidualFactory = Callable[..., ResidualStrategy]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(head_dim: int, max_len: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each (max_len, head_dim // 2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the head dimension. x: (B, H, T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class KVCache:
    """Keys and values of every attention sublayer, for decoding one token at a time.

    `Transformer.forward(idx, kv_cache=cache)` runs `idx` as the positions `cache.pos ..` that
    follow what the cache holds, appends their keys and values and advances `pos`. The residual
    strategy needs nothing more: a token's depth sources are its own earlier sublayer outputs,
    computed in the same pass, and only attention looks at other positions. Buffers are
    (B, H, max_len, hd) per attention sublayer, allocated at the first write.

    A padded batch (`attnres.hf`) passes a cache object with two more attributes: `positions`
    (B, T), each row's own positions for the T new tokens, and `key_mask` (B, pos + T), False at
    padding. Attention then skips padded keys and each token is rotated by its row's position, so a
    padded row computes what it computes alone. This class has neither (None: no padding).
    """

    positions: Tensor | None = None
    key_mask: Tensor | None = None

    def __init__(self, max_len: int) -> None:
        self.max_len, self.pos = max_len, 0
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def reset(self) -> None:
        self.pos = 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, H, T, hd) at positions pos .. pos + T; return all keys and values so far."""
        T = k.shape[2]
        if self.pos + T > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {self.pos} used, {T} more do not fit")
        if layer not in self.keys or self.keys[layer].shape[0] != k.shape[0]:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = k.new_empty(shape)
            self.values[layer] = v.new_empty(shape)
        self.keys[layer][:, :, self.pos : self.pos + T] = k
        self.values[layer][:, :, self.pos : self.pos + T] = v
        return self.keys[layer][:, :, : self.pos + T], self.values[layer][:, :, : self.pos + T]


class Attention(nn.Module):
    """Sublayer: causal self-attention of RMSNorm(x), with rotary positions."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, eps: float) -> None:
        super().__init__()
        if n_embd % n_head != 0 or (n_embd // n_head) % 2 != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head} into an even head size")
        self.n_head, self.dropout = n_head, dropout
        self.cache_index = 0  # which KVCache slot is this sublayer's (set by the Transformer)
        self.scale: float | None = None  # attention logit scale; None: 1 / sqrt(head size) (mup sets it)
        self.branch_scale: float | None = None  # the output's multiplier; None: 1 (parametrization=mup's depth rule)
        self.norm = RMSNorm(n_embd, eps)
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], kv_cache: KVCache | None = None) -> Tensor:
        return self.forward_normed(self.norm(x), rope, kv_cache)

    def forward_normed(self, x: Tensor, rope: tuple[Tensor, Tensor], kv_cache: KVCache | None = None) -> Tensor:
        """`forward` of an input already through `self.norm`: a residual strategy that fuses the
        pre-norm into its depth mix calls this (`DepthAttentionResidual.prenorm_of`)."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        cos, sin = rope  # the tables at these T positions
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask, causal = None, True
        if kv_cache is not None:
            start = kv_cache.pos
            k, v = kv_cache.update(self.cache_index, k, v)  # (B, H, start + T, hd)
            keys = getattr(kv_cache, "key_mask", None)  # (B, start + T), False at padding
            if keys is not None:  # causal and not padding; a padded query sees its own key (no empty row)
                causal, rows = False, torch.arange(T, device=x.device)
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                mask = mask & keys[:, None, None, :].to(device=x.device, dtype=torch.bool)  # (B, 1, T, start + T)
                mask[:, :, rows, start + rows] = True
            elif start:  # query i (position start + i) sees keys 0 .. start + i
                causal = False
                if T > 1:
                    mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=causal, scale=self.scale)
        y = self.proj(y.transpose(1, 2).reshape(B, T, D))
        return self.resid_dropout(y if self.branch_scale is None else y * self.branch_scale)


class MLP(nn.Module):
    """Sublayer: MLP of RMSNorm(x); GELU (4x wide) or SwiGLU (8/3x wide, rounded to 64), or
    `hidden` wide when given (SwiGLU: the width of each of its two up-projections)."""

    def __init__(self, n_embd: int, activation: str, dropout: float, bias: bool, eps: float,
                 hidden: int | None = None) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"mlp activation must be 'gelu' or 'swiglu', got {activation!r}")
        if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
            raise ValueError(f"mlp_hidden must be a positive integer or None (the default width), got {hidden!r}")
        self.activation = activation
        self.branch_scale: float | None = None  # the output's multiplier; None: 1 (parametrization=mup's depth rule)
        self.norm = RMSNorm(n_embd, eps)
        if hidden is None:
            hidden = 4 * n_embd if activation == "gelu" else 64 * math.ceil(8 * n_embd / 3 / 64)
        self.up = nn.Linear(n_embd, hidden * (2 if activation == "swiglu" else 1), bias=bias)
        self.down = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, kv_cache: KVCache | None = None) -> Tensor:
        return self.forward_normed(self.norm(x))

    def forward_normed(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None,
                       kv_cache: KVCache | None = None) -> Tensor:
        """`forward` of an input already through `self.norm` (as `Attention.forward_normed`)."""
        u = self.up(x)
        if self.activation == "swiglu":
            gate, u = u.chunk(2, dim=-1)
            u = F.silu(gate) * u
        else:
            u = F.gelu(u)
        u = self.down(u)
        return self.dropout(u if self.branch_scale is None else u * self.branch_scale)


class Transformer(nn.Module):
    """Decoder-only LM. `residual` is a strategy factory called as
    `residual(d_model=n_embd, num_layers=2 * n_layer)` (a class, or a `functools.partial`
    such as Hydra's `_partial_: true` yields); None means the standard residual. `mlp_hidden`
    sets the MLP's hidden width (None: 4 n_embd for GELU, 8/3 n_embd rounded up to 64 for SwiGLU).

    `parametrization="mup"` scales init, forward multipliers and learning rates with the width
    against `base_width` and with the depth against `base_depth` (`attnres.parametrization`; None:
    the model's own, where "mup" computes what "standard" computes) with `base_n_head` heads (None:
    n_head); `depth_alpha` is the exponent of the residual branches' multiplier
    (base_depth / n_layer) ** depth_alpha."""

    def __init__(
        self,
        vocab_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 256,
        dropout: float = 0.0,
        bias: bool = False,
        mlp: Literal["gelu", "swiglu"] = "gelu",
        mlp_hidden: int | None = None,
        tie_embeddings: bool = True,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        residual: ResidualFactory | None = None,
        parametrization: str = "standard",
        base_width: int | None = None,
        base_depth: int | None = None,
        depth_alpha: float = 1.0,
        base_n_head: int | None = None,
    ) -> None:
        super().__init__()
        param.check(parametrization, base_width, base_depth, depth_alpha, base_n_head)
        for name, value in (("vocab_size", vocab_size), ("n_layer", n_layer), ("n_head", n_head),
                            ("n_embd", n_embd), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.vocab_size, self.n_layer, self.block_size, self.init_std = vocab_size, n_layer, block_size, init_std
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.embed_dropout = nn.Dropout(dropout)
        self.sublayers = nn.ModuleList()
        for layer in range(n_layer):
            self.sublayers.append(Attention(n_embd, n_head, dropout, bias, norm_eps))
            self.sublayers[-1].cache_index = layer
            self.sublayers.append(MLP(n_embd, mlp, dropout, bias, norm_eps, mlp_hidden))
        self.norm = RMSNorm(n_embd, norm_eps)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(n_embd // n_head, block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        for sublayer in self.sublayers:  # scaled init of the projections into the residual stream (GPT-2)
            out_proj = sublayer.proj if isinstance(sublayer, Attention) else sublayer.down
            nn.init.normal_(out_proj.weight, mean=0.0, std=init_std / math.sqrt(2 * n_layer))
        # Built last and without drawing random numbers, so every strategy gets the same
        # weights from the same seed.
        self.residual = (residual or StandardResidual)(d_model=n_embd, num_layers=2 * n_layer)
        self.parametrization, self.output_scale = parametrization, None  # logits' multiplier; None: 1
        self.base_width, self.base_depth, self.depth_alpha = base_width or n_embd, base_depth or n_layer, depth_alpha
        self.base_n_head = base_n_head or n_head
        self.roles: dict[str, param.Role] = {}
        if parametrization == "mup":
            self._apply_mup(dict(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, block_size=block_size,
                                 dropout=dropout, bias=bias, mlp=mlp, mlp_hidden=mlp_hidden,
                                 tie_embeddings=tie_embeddings, norm_eps=norm_eps, init_std=init_std,
                                 residual=residual))

    def _apply_mup(self, shape: dict) -> None:
        """parametrization="mup" (`attnres.parametrization`): the roles against the base model,
        the hidden matrices' init rescaled (no random numbers drawn), the forward multipliers."""
        n_embd, n_head, heads = self.embed.embedding_dim, shape["n_head"], self.base_n_head
        if self.base_width % heads or (self.base_width // heads) % 2:
            raise ValueError(f"base_width={self.base_width} must split into {heads} heads of even size (base_n_head, "
                             "null: n_head); give a base_width that does, or base_n_head")
        base_shape = {**shape, "n_head": heads,  # the same model narrower: a set MLP width shrinks with it
                      "mlp_hidden": param.scaled(shape["mlp_hidden"], self.base_width / n_embd)}
        base = param.base_model(lambda n_embd: Transformer(n_embd=n_embd, **base_shape), self.base_width)
        self.roles = param.roles(self, base, self.n_layer / self.base_depth, self.depth_alpha)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if self.roles[name].init != 1.0:
                    p.mul_(self.roles[name].init)
        if self.base_width != n_embd:
            self.output_scale = self.base_width / n_embd
        branch = param.branch_multiplier(self.n_layer, self.base_depth, self.depth_alpha)
        for sublayer in self.sublayers:
            if isinstance(sublayer, Attention) and self.base_width // heads != n_embd // n_head:
                sublayer.scale = param.attention_scale(n_embd // n_head, self.base_width // heads)
            if branch != 1.0 and hasattr(sublayer, "branch_scale"):
                sublayer.branch_scale = branch

    def lr_scales(self, muon_adjust_lr_fn: str | None = None, muon: bool = False) -> dict[int, float]:
        """Each parameter's learning-rate factor (by `id`), the ones that differ from 1: none under
        parametrization="standard". `muon`: the hidden matrices train with Muon under
        `muon_adjust_lr_fn` (`attnres.parametrization.muon_factor`)."""
        scales = {}
        for name, p in self.named_parameters():
            role = self.roles.get(name)
            if role is None:
                continue
            factor = param.muon_factor(role, muon_adjust_lr_fn) if muon else role.adam_lr
            if factor != 1.0:
                scales[id(p)] = factor
        return scales

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.init_std)

    def num_parameters(self, exclude_residual: bool = False, exclude_embedding: bool = False) -> int:
        """Parameters, tied weights counted once. `exclude_embedding` leaves out the token
        embedding and the LM head (the N of scaling laws: Kaplan et al. 2020, section 2.1)."""
        params = {id(p): p for p in self.parameters()}
        dropped = [*(self.residual.parameters() if exclude_residual else ()),
                   *((self.embed.weight, self.head.weight) if exclude_embedding else ())]
        for p in dropped:
            params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, return_hidden: bool = False,
        kv_cache: KVCache | None = None,
    ) -> dict[str, Tensor]:
        """idx: (B, T) token ids. Returns {"logits": (B, T, V)}, plus "loss" (mean
        cross-entropy over targets != -100) when `targets` is given and "hidden" (B, T, D),
        the final normalised hidden state, when `return_hidden`. With `kv_cache`, `idx` are the
        positions after those the cache holds (see `KVCache`)."""
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        positions = getattr(kv_cache, "positions", None)  # (B, T) in a padded batch (see KVCache)
        length = start + T if positions is None else int(positions.max()) + 1
        if length > self.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size={self.block_size}")
        x = self.embed_dropout(self.embed(idx))  # (B, T, D)
        if positions is None:
            rope = (self.rope_cos[start : start + T], self.rope_sin[start : start + T])  # (T, hd / 2)
        else:
            rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))  # (B, 1, T, hd / 2)
        kwargs: dict = {"rope": rope}
        if kv_cache is not None:  # passed only when decoding, so custom sublayers need not know it
            kwargs["kv_cache"] = kv_cache
        hidden = self.norm(self.residual(x, self.sublayers, **kwargs))
        if kv_cache is not None:
            kv_cache.pos += T
        logits = self.head(hidden)
        out = {"logits": logits if self.output_scale is None else logits * self.output_scale}
        if return_hidden:
            out["hidden"] = hidden
        if targets is not None:
            out["loss"] = F.cross_entropy(out["logits"].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return out

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 use_cache: bool = True, generator: torch.Generator | None = None) -> Tensor:
        """Continue `idx` (B, T0) by `max_new_tokens` tokens; returns (B, T0 + max_new_tokens).

        temperature 0 is greedy decoding; `top_k` keeps the k likeliest tokens. Each step reads the
        last `block_size` tokens at most (positions restart when the window slides, as a full
        forward over them would). With `use_cache` the steps reuse a `KVCache` and compute one
        token each until the window slides; without, every step is a full forward (the reference)."""
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        seq, window = idx, self.block_size
        cache = KVCache(window) if use_cache else None
        logits = self(seq[:, -window:], kv_cache=cache)["logits"][:, -1]
        for _ in range(max_new_tokens):
            nxt = self._pick(logits, temperature, top_k, generator)  # (B, 1)
            seq = torch.cat((seq, nxt), dim=1)
            if cache is not None and cache.pos < window:
                logits = self(nxt, kv_cache=cache)["logits"][:, -1]
            else:  # no cache, or a full one: the window slides
                if cache is not None:
                    cache.reset()
                logits = self(seq[:, -window:], kv_cache=cache)["logits"][:, -1]
        return seq

    @staticmethod
    def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
        logits = logits.float()
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
