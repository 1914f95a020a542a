"""Lightning data modules: byte-level LM (stdlib source or your own text) and a synthetic task.

Every module is built from keyword arguments (Hydra `_target_`), knows `vocab_size` and `metric`
right after `__init__`, yields `(inputs, targets)` int64 batches (B, T) with -100 where nothing is
scored, draws training sample i from (seed, i) alone (resumable by step), and validates on a
fixed, bounded set. See `common.py` for the shared contract.
"""

from attnres.training.data.bytes import BytesDataModule, StdlibBytesDataModule, TextBytesDataModule
from attnres.training.data.synthetic import SyntheticDataModule, exact_match

__all__ = ["BytesDataModule", "StdlibBytesDataModule", "SyntheticDataModule", "TextBytesDataModule", "exact_match"]
