"""Lightning data modules: byte-level LM (stdlib source or your own text), token files, a synthetic task.

Every module is built from keyword arguments (Hydra `_target_`), knows `vocab_size` and `metric`
right after `__init__`, yields `(inputs, targets)` int64 batches (B, T) with -100 where nothing is
scored, draws training sample i from (seed, i) alone (resumable by step), and validates on a
fixed, bounded set. Text modules also know `token_bytes`, the UTF-8 bytes of each token, so that
`val/bpb` is bits per byte of text whatever the tokenizer. See `common.py` for the shared contract.
"""

from attnres.training.data.bytes import BytesDataModule, StdlibBytesDataModule, TextBytesDataModule
from attnres.training.data.synthetic import SyntheticDataModule, exact_match
from attnres.training.data.tokens import TokensDataModule

__all__ = ["BytesDataModule", "StdlibBytesDataModule", "SyntheticDataModule", "TextBytesDataModule",
           "TokensDataModule", "exact_match"]
