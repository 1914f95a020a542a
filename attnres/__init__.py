"""attnres: Attention Residuals (Kimi Team, arXiv 2603.15031) in plain PyTorch.

`import attnres` loads only torch: functional ops, residual strategies (drop-in modules),
`TransformerEncoder` (torch's, with `residual=`) and the Transformer. The Lightning/Hydra
runner lives apart, by concern: `attnres.config` (checking and composing a command),
`attnres.training` (one run), `attnres.sweep` (many runs) and `attnres.results` (summaries,
verdicts, figures), with `cli.py` on top; docs/layout.md draws the house.

The names below are loaded on first use (PEP 562), so that `attnres-run --help`, which only
reads the config files, starts without importing torch.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BlockAttentionResidual": "attnres.residual",
    "DenseFormerResidual": "attnres.residual",
    "DepthAttentionResidual": "attnres.residual",
    "DepthRecord": "attnres.residual",
    "FullAttentionResidual": "attnres.residual",
    "HyperConnectionResidual": "attnres.residual",
    "ManifoldHyperConnectionResidual": "attnres.residual",
    "ResidualStrategy": "attnres.residual",
    "StandardResidual": "attnres.residual",
    "TransformerEncoder": "attnres.residual",
    "Transformer": "attnres.model",
}

__all__ = sorted([*_EXPORTS, "functional"])


def __getattr__(name: str) -> Any:
    if name == "functional":
        return import_module("attnres.functional")
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'attnres' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
