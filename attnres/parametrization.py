"""How `attnres.Transformer`'s init, forward multipliers and per-parameter learning rates change
with its width and depth: `parametrization="standard"` (today's model, the default) or `"mup"`
(the Maximal Update Parametrization for width, Yang et al., "Tensor Programs V", 2022, with
CompleteP's residual-branch multiplier for depth, Dey et al., arXiv 2505.01618, 2025).

Under "mup" the model is compared with its *base*: the same model at `base_width` (and, for the
depth rules, `base_depth` layers). At the base shape "mup" computes what "standard" computes and
trains with the same learning rates, so the hyperparameters tuned there are the ones to carry to
wider and deeper models. The derivation of each rule is in docs/strategies.md#parametrizations;
in short, with m = n_embd / base_width and m_L = n_layer / base_depth:

Each parameter's role, its init std, forward multiplier and learning-rate factors (Adam; Muon):

- `embedding` (token embedding): init, forward and lr unchanged (on AdamW under Muon).
- `readout` (LM head, tied or not): the logits x 1/m; init and lr unchanged.
- `hidden` (attention and MLP matrices): init std x sqrt(fan_in0 / fan_in); Adam lr x
  fan_in0 / fan_in x m_L^(alpha - 1); Muon lr x sqrt(fan_in0 / fan_in) (match_rms_adamw) or x 1
  (original), times m_L^(alpha - 1).
- `vector` (sublayer norm gains, biases; the final norm without the depth factor): lr x
  m_L^(alpha - 1).
- attention logits: scale 1 / sqrt(d_head0) x d_head0 / d_head (1 / d_head, equal at the base).
- sublayer outputs: x m_L^(-alpha).
- `contracted` (a residual strategy's parameter contracted with the hidden state over k width axes:
  pseudo-queries k = 1, input-dependent query maps k = 2, hyper-connections' dynamic weights
  k = 1): init std and lr x (width0 / width)^k (a zero init stays zero; `query_init_std`'s random
  queries shrink, as a readout's init does).
- `elementwise` (gains a strategy names in `elementwise_parameters`: key-norm gains) and `scalar`
  (no width axis: static mixing logits, DenseFormer's and HC's static weights): unchanged.

Roles are found by building the base model on the meta device and comparing shapes: an axis
whose size differs from the base's is a width axis. A strategy of one's own needs nothing more,
except to name its element-wise gains in `elementwise_parameters`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

PARAMETRIZATIONS = ("standard", "mup")
MUON_ADJUSTMENTS = ("match_rms_adamw", "original")


@dataclass(frozen=True)
class Role:
    """One parameter's place in the parametrization: its `role` (table above), the factor on its
    init std, and the factors on its learning rate under AdamW and under Muon."""

    role: str
    init: float = 1.0
    adam_lr: float = 1.0
    muon_lr: float = 1.0


def check(parametrization: str, base_width: int | None, base_depth: int | None, depth_alpha: float,
          base_n_head: int | None = None) -> None:
    if parametrization not in PARAMETRIZATIONS:
        raise ValueError(f"parametrization must be one of {', '.join(PARAMETRIZATIONS)}, got {parametrization!r}")
    for name, value in (("base_width", base_width), ("base_depth", base_depth), ("base_n_head", base_n_head)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or null (the model's own), got {value!r}")
    if isinstance(depth_alpha, bool) or not isinstance(depth_alpha, (int, float)) or not 0 <= depth_alpha <= 1:
        raise ValueError(f"depth_alpha must be a number from 0 to 1 (1: CompleteP, 0.5: depth-muP, 0: no depth "
                         f"scaling), got {depth_alpha!r}")
    if parametrization == "standard" and (base_width, base_depth, base_n_head) != (None, None, None):
        raise ValueError("base_width, base_depth and base_n_head belong to parametrization=mup; with "
                         "parametrization=standard leave them null")


def scaled(width: int | None, ratio: float) -> int | None:
    """A set width (the MLP's `mlp_hidden`) at `ratio` times the model's width; None stays None
    (the default MLP width follows n_embd by itself)."""
    return None if width is None else max(1, round(width * ratio))


def branch_multiplier(n_layer: float, base_depth: float, depth_alpha: float) -> float:
    """CompleteP's residual-branch multiplier (base_depth / n_layer) ** depth_alpha: 1 at the base
    depth; under "mup" on every sublayer output, and the rule of residual=depth_scaled's control."""
    return (base_depth / n_layer) ** depth_alpha


def attention_scale(head_dim: int, base_head_dim: int) -> float:
    """muP's attention logit scale: 1 / d_head (Tensor Programs V, section 4), equal to the standard
    1 / sqrt(d_head) at the base head size."""
    return 1.0 / math.sqrt(base_head_dim) * base_head_dim / head_dim


def base_model(build: Callable[..., nn.Module], base_width: int) -> nn.Module:
    """The model at the base width, on the meta device (no memory, no random numbers drawn)."""
    with torch.device("meta"):
        return build(n_embd=base_width)


def roles(model: nn.Module, base: nn.Module, depth_mult: float, depth_alpha: float) -> dict[str, Role]:
    """Each named parameter's role under "mup" (tied weights once, by their first name), from
    `model` against `base`, the same model at the base width."""
    base_params = dict(base.named_parameters())
    head = getattr(model, "head", None)
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    embed = getattr(model, "embed", None)
    embed_ids = {id(p) for p in embed.parameters()} if isinstance(embed, nn.Module) else set()
    residual = getattr(model, "residual", None)
    residual_ids = {id(p) for p in residual.parameters()} if isinstance(residual, nn.Module) else set()
    elementwise = set(getattr(residual, "elementwise_parameters", ()))
    depth = depth_mult ** (depth_alpha - 1.0)
    linear = {f"{name}.weight": module for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and module is not head}
    out: dict[str, Role] = {}
    for name, p in model.named_parameters():
        if id(p) in embed_ids:
            out[name] = Role("embedding")
        elif id(p) in head_ids:
            out[name] = Role("readout")
        elif name in linear:
            ratio = base_params[name].shape[1] / p.shape[1]  # fan_in0 / fan_in
            out[name] = Role("hidden", math.sqrt(ratio), ratio * depth, depth)  # muon_lr: times the adjustment's factor
        elif id(p) in residual_ids:
            short = name.removeprefix("residual.").split(".")[0]
            ratio = math.prod(b / s for s, b in zip(p.shape, base_params[name].shape, strict=True) if s != b)
            if short in elementwise:
                out[name] = Role("elementwise")
            elif ratio == 1.0:
                out[name] = Role("scalar")
            else:
                out[name] = Role("contracted", ratio, ratio, ratio)  # a readout's init: zero stays zero
        else:  # norm gains and biases of the sublayers, the final norm
            out[name] = Role("vector", 1.0, depth if name.startswith("sublayers.") else 1.0, 1.0)
    return out


def muon_factor(role: Role, adjust_lr_fn: str | None) -> float:
    """The Muon learning-rate factor of a hidden matrix: Muon's orthogonalised update has spectral
    norm lr x sqrt(max(rows, cols)) x 0.2 under match_rms_adamw, so the spectral condition (an
    update of size O(1) in the operator norm) asks for lr x sqrt(fan_in0 / fan_in); under the
    original adjustment it is lr x sqrt(max(1, rows / cols)), already O(1), so x 1."""
    if role.role != "hidden":
        return role.adam_lr
    width = role.init if (adjust_lr_fn or "original") == "match_rms_adamw" else 1.0  # init = sqrt(fan_in0 / fan_in)
    return width * role.muon_lr
