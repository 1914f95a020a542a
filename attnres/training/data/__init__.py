"""Lightning data modules: byte-level LM (stdlib source or your own text), token files, a synthetic task.

Every module is built from keyword arguments (Hydra `_target_`), knows `vocab_size` and `metric`
right after `__init__`, yields `(inputs, targets)` int64 batches (B, T) with -100 where nothing is
scored, draws training sample i from (seed, i) alone (resumable by step), and validates on a
fixed, bounded set. Text modules also know `token_bytes`, the UTF-8 bytes of each token, so that
`val/bpb` is bits per byte of text whatever the tokenizer. See `common.py` for the shared contract.

The names below are loaded on first use (PEP 562): `attnres-prepare` and its encoding workers
import `attnres.training.data.prepare` without Lightning.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "BytesDataModule": "attnres.training.data.bytes",
    "StdlibBytesDataModule": "attnres.training.data.bytes",
    "TextBytesDataModule": "attnres.training.data.bytes",
    "SyntheticDataModule": "attnres.training.data.synthetic",
    "exact_match": "attnres.training.data.synthetic",
    "TokensDataModule": "attnres.training.data.tokens",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnres.training.data' has no attribute {name!r}")
