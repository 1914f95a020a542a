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


class Attention(nn.Module):
    """Sublayer: causal self-attention of RMSNorm(x), with rotary positions."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, eps: float) -> None:
        super().__init__()
        if n_embd % n_head != 0 or (n_embd // n_head) % 2 != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head} into an even head size")
        self.n_head, self.dropout = n_head, dropout
        self.norm = RMSNorm(n_embd, eps)
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, D)))


class MLP(nn.Module):
    """Sublayer: MLP of RMSNorm(x); GELU (4x wide) or SwiGLU (8/3x wide, rounded to 64)."""

    def __init__(self, n_embd: int, activation: str, dropout: float, bias: bool, eps: float) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"mlp activation must be 'gelu' or 'swiglu', got {activation!r}")
        self.activation = activation
        self.norm = RMSNorm(n_embd, eps)
        hidden = 4 * n_embd if activation == "gelu" else 64 * math.ceil(8 * n_embd / 3 / 64)
        self.up = nn.Linear(n_embd, hidden * (2 if activation == "swiglu" else 1), bias=bias)
        self.down = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        u = self.up(self.norm(x))
        if self.activation == "swiglu":
            gate, u = u.chunk(2, dim=-1)
            u = F.silu(gate) * u
        else:
            u = F.gelu(u)
        return self.dropout(self.down(u))


class Transformer(nn.Module):
    """Decoder-only LM. `residual` is a strategy factory called as
    `residual(d_model=n_embd, num_layers=2 * n_layer)` (a class, or a `functools.partial`
    such as Hydra's `_partial_: true` yields); None means the standard residual."""

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
        tie_embeddings: bool = True,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        residual: ResidualFactory | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("n_layer", n_layer), ("n_head", n_head),
                            ("n_embd", n_embd), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.vocab_size, self.n_layer, self.block_size, self.init_std = vocab_size, n_layer, block_size, init_std
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.embed_dropout = nn.Dropout(dropout)
        self.sublayers = nn.ModuleList()
        for _ in range(n_layer):
            self.sublayers.append(Attention(n_embd, n_head, dropout, bias, norm_eps))
            self.sublayers.append(MLP(n_embd, mlp, dropout, bias, norm_eps))
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
        self, idx: Tensor, targets: Tensor | None = None, return_hidden: bool = False
    ) -> dict[str, Tensor]:
        """idx: (B, T) token ids. Returns {"logits": (B, T, V)}, plus "loss" (mean
        cross-entropy over targets != -100) when `targets` is given and "hidden" (B, T, D),
        the final normalised hidden state, when `return_hidden`."""
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        x = self.embed_dropout(self.embed(idx))  # (B, T, D)
        rope = (self.rope_cos[:T], self.rope_sin[:T])
        hidden = self.norm(self.residual(x, self.sublayers, rope=rope))
        out = {"logits": self.head(hidden)}
        if return_hidden:
            out["hidden"] = hidden
        if targets is not None:
            out["loss"] = F.cross_entropy(out["logits"].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return out
