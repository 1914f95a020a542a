"""Lightning data modules: byte-level LM (stdlib source or your own text), token files, a synthetic
task; all share `common.py`'s contract. Names load on first use (attnres-prepare needs no Lightning)."""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "BytesDataModule": "attnres.data.bytes",
    "StdlibBytesDataModule": "attnres.data.bytes",
    "TextBytesDataModule": "attnres.data.bytes",
    "SyntheticDataModule": "attnres.data.synthetic",
    "exact_match": "attnres.data.synthetic",
    "TokensDataModule": "attnres.data.tokens",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnres.data' has no attribute {name!r}")
