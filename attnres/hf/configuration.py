"""`AttnResConfig`: the Hugging Face config of an `attnres.Transformer` and its residual strategy.

It carries two things, as `attnres-run` composes them:

- `transformer`: the keyword arguments of `attnres.Transformer` (vocab_size, n_layer, n_embd, ...),
  passed through as they are, so a constructor argument added to the Transformer needs nothing here;
- `residual`: the strategy, `{"_target_": "attnres.BlockAttentionResidual", "num_blocks": 8, ...}`,
  the class's import path and its options (conf/residual/*.yaml, resolved; `d_model` and
  `num_layers` come from the model). Any `ResidualStrategy` subclass that imports by that path
  works, the six of conf/residual/ and their ablation options included.

The usual Hugging Face names (`vocab_size`, `hidden_size`, `num_hidden_layers`,
`num_attention_heads`, `max_position_embeddings`, `tie_word_embeddings`) are derived from
`transformer` for tools that read them; `transformer` stays the one place they are set.
"""

from __future__ import annotations

import functools
import inspect
from importlib import import_module
from typing import Any

from transformers import PreTrainedConfig

from attnres.model import Transformer
from attnres.residual import ResidualStrategy

#: what a residual spec holds besides the strategy's options (Hydra's instantiation keys)
HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
STANDARD = {"_target_": "attnres.StandardResidual"}


def transformer_defaults() -> dict[str, Any]:
    """The Transformer's constructor defaults (all but `residual`)."""
    params = inspect.signature(Transformer.__init__).parameters
    return {k: p.default for k, p in params.items()
            if k not in ("self", "residual") and p.default is not inspect.Parameter.empty}


def locate(path: str) -> Any:
    """The object a dotted import path names (`attnres.BlockAttentionResidual`, `pkg.mod.Class`)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise ValueError(f"the residual strategy {path!r} cannot be imported; install the package that defines it")


def residual_factory(spec: dict[str, Any] | None) -> functools.partial:
    """`Strategy(d_model, num_layers)` as the Transformer calls it, from a residual spec."""
    spec = dict(spec or STANDARD)
    target = spec.get("_target_")
    if not isinstance(target, str):
        raise ValueError(f"the residual spec needs a '_target_' naming a ResidualStrategy class, got {spec!r}")
    cls = locate(target)
    if not (isinstance(cls, type) and issubclass(cls, ResidualStrategy)):
        raise ValueError(f"{target} is not a ResidualStrategy subclass")
    return functools.partial(cls, **{k: v for k, v in spec.items() if k not in HYDRA_KEYS})


class AttnResConfig(PreTrainedConfig):
    """Config of `AttnResModel` / `AttnResForCausalLM`; see the module docstring."""

    model_type = "attnres"

    def __init__(self, transformer: dict[str, Any] | None = None, residual: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self.transformer = dict(transformer or {"vocab_size": 256})
        self.residual = dict(residual or STANDARD)
        if "vocab_size" not in self.transformer:
            raise ValueError("AttnResConfig: transformer needs a vocab_size")
        shape = {**transformer_defaults(), **self.transformer}
        self.vocab_size = shape["vocab_size"]
        self.hidden_size = shape["n_embd"]
        self.num_hidden_layers = shape["n_layer"]
        self.num_attention_heads = shape["n_head"]
        self.max_position_embeddings = shape["block_size"]
        kwargs["tie_word_embeddings"] = bool(shape["tie_embeddings"])  # the Transformer decides, not a default
        super().__init__(**kwargs)

    def build_transformer(self) -> Transformer:
        """A freshly initialised `attnres.Transformer` of this shape and strategy."""
        return Transformer(**self.transformer, residual=residual_factory(self.residual))
