"""One run under Lightning: the module, callbacks, faults and checkpoints, the run's life
(`run.train`), its progress and report, eval and sample. `import attnres` does not load it."""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LitLanguageModel": "attnres.training.lit",
    "parameter_groups": "attnres.training.lit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnres.training' has no attribute {name!r}")
