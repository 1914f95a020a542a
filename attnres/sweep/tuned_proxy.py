"""A tuned sweep's proxy (`hydra.sweeper.proxy`): the keys its search alone runs with, and the
narrow proxy of hyperparameter transfer.

`+hydra.sweeper.proxy.size=194m` searches at the 194M preset and runs every size at the choice.
`+hydra.sweeper.proxy.width=0.25` (and/or `depth=0.5`) searches on a fraction of that shape: a
quarter of the heads at the same head size (the MLP's set width shrinks with it), half the
layers; and every verdict job then runs under `model.parametrization=mup` with the proxy as its
base (`model.base_width`, `base_n_head`, `base_depth`), so that the learning rate found on the
proxy is the one that transfers (docs/strategies.md#parametrizations). At its own shape the
proxy's "mup" is "standard", so the search runs the plain model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.config.errors import ConfigError

FRACTIONS = ("width", "depth")
#: the keys a fraction proxy sets on every verdict job; the command line must leave them to it
TARGET_KEYS = ("model.parametrization", "model.base_width", "model.base_n_head", "model.base_depth")


def flatten(proxy: Mapping[str, Any] | None, prefix: str = "") -> dict[str, str]:
    """{dotted key: value as an override writes it}: `proxy.model.n_embd=32` arrives nested."""
    out: dict[str, str] = {}
    for key, value in (proxy or {}).items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def fractions(proxy: Mapping[str, str]) -> dict[str, float]:
    """The proxy's width and depth fractions, checked (one line, exit 2, naming the fix)."""
    found = {}
    for name in FRACTIONS:
        if name not in proxy:
            continue
        try:
            value = float(proxy[name])
        except ValueError:
            value = float("nan")
        if not 0 < value <= 1:
            raise ConfigError(f"hydra.sweeper.proxy.{name}={proxy[name]} must be a fraction of the target's "
                              f"{'heads' if name == 'width' else 'layers'} above 0 and at most 1, e.g. 0.25")
        found[name] = value
    return found


def narrow(cfg: DictConfig, found: Mapping[str, float]) -> tuple[list[str], list[str]]:
    """(the search's model overrides, every verdict job's) for the proxy of `cfg`'s model at the
    fractions `found`."""
    model = cfg.model
    n_embd, n_head, n_layer = int(model.n_embd), int(model.n_head), int(model.n_layer)
    head = n_embd // n_head
    heads = max(1, round(n_head * found.get("width", 1.0)))
    layers = max(1, round(n_layer * found.get("depth", 1.0)))
    width = heads * head
    search = [f"model.n_embd={width}", f"model.n_head={heads}", f"model.n_layer={layers}"]
    hidden = OmegaConf.select(cfg, "model.mlp_hidden", default=None)
    if isinstance(hidden, int):
        search.append(f"model.mlp_hidden={max(1, round(hidden * width / n_embd))}")
    blocks, sizes = (OmegaConf.select(cfg, f"residual.{k}", default=None) for k in ("num_blocks", "block_sizes"))
    if isinstance(blocks, int) and sizes is None and (2 * layers) % blocks:
        depth = found.get("depth", 1.0)
        raise ConfigError(f"hydra.sweeper.proxy.depth={depth:g} gives a proxy of {layers} layer{'s' * (layers != 1)} "
                          f"({2 * layers} sublayers), which num_blocks={blocks} does not divide; pick a depth "
                          "fraction whose sublayers the blocks divide")
    target = ["model.parametrization=mup", f"model.base_width={width}", f"model.base_n_head={heads}",
              f"model.base_depth={layers}"]
    return search, target


def describe(search: list[str]) -> str:
    """`222 wide (3 heads) x 6 layers` for the start line."""
    values = dict(o.split("=", 1) for o in search)
    return f"{values['model.n_embd']} wide ({values['model.n_head']} heads) x {values['model.n_layer']} layers"
