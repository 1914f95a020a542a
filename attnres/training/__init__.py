"""The experiment runner's library: Lightning module, data modules, schedules, callbacks, sweeps.

Imports Lightning (lazily: `attnres.training.sweep`, which Hydra imports at start-up to find
its launcher, must not pay for it); `import attnres` alone does not load this package.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ConfigError": "attnres.training.errors",
    "LitLanguageModel": "attnres.training.lit",
    "parameter_groups": "attnres.training.lit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnres.training' has no attribute {name!r}")
