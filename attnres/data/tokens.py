"""Token files on disk: nanoGPT's raw `train.bin` / `val.bin` and modded-nanogpt's headered shards.

`data=tokens data.path=<folder>` reads the `*train*.bin` and `*val*.bin` files of a folder (one file
or many shards each, sorted by name), memory-mapped, never loaded whole. Two formats, told apart
by the first 4 bytes of each file:

- headered (llm.c / modded-nanogpt): a header of 256 int32 (magic, version, token count, unused),
  then the tokens; magic 20240520 version 1 is uint16 (GPT-2 vocabularies), magic 20240801
  version 7 is uint32 (llm.c's LLaMA-3 files). `attnres-prepare` writes these.
- raw (nanoGPT): the tokens alone, uint16 unless `meta.json` says `"dtype": "uint32"` (or the
  vocabulary does not fit in uint16).

The vocabulary size is `data.vocab_size`, else `meta.json`'s `vocab_size`; every file is checked
once against it (its largest token id is cached beside the data cache). Bits per byte need the
UTF-8 length of each token: from `data.tokenizer` or a `tokenizer.json` beside the files (a
Hugging Face `tokenizers` file); without one the run reports `val/loss` (nats per token) only.

Training window i starts at a position drawn from (seed, i) among all positions of all training
shards (a window never crosses a shard boundary); validation is the first `val_tokens` tokens
of the validation files in consecutive windows of `block_size` (a fixed set for every seed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from attnres.config.errors import ConfigError
from attnres.data import corpus
from attnres.data.common import TRAIN_STREAM, StreamDataModule, sample_rng
from attnres.data.shards import (  # noqa: F401 (write_shard, shard_header: the public names stay here too)
    DTYPES,
    HEADER_BYTES,
    HEADER_INTS,
    HEADERED,
    Shard,
    open_shard,
    open_split,
    shard_header,
    write_shard,
)

log = logging.getLogger(__name__)

MAX_CHUNK = 1 << 26  # tokens per read while scanning a file for its largest id


def max_token(shard: Shard, cache_dir: Path) -> int:
    """The largest token id in `shard` (-1 when empty), cached by path, size and mtime."""
    st = os.stat(shard.path)
    key = hashlib.sha256(json.dumps([os.path.abspath(shard.path), st.st_size, st.st_mtime_ns]).encode()).hexdigest()
    cached = cache_dir / "token-max" / f"{key[:24]}.json"
    if cached.is_file():
        try:
            return int(json.loads(cached.read_text())["max"])
        except (ValueError, KeyError, OSError):
            pass
    data, top = shard.tokens(), -1
    for start in range(0, shard.num_tokens, MAX_CHUNK):
        top = max(top, int(data[start : start + MAX_CHUNK].max()))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": shard.path, "max": top}))
        os.replace(tmp, cached)
    except OSError:  # a read-only cache only costs the scan next time
        pass
    return top


def token_byte_lengths(tokenizer_file: str | os.PathLike) -> np.ndarray:
    """UTF-8 bytes of each token id (V,), int64, from a Hugging Face `tokenizer.json`.

    Byte-level vocabularies (GPT-2 style: each character of a token stands for one byte) count
    characters; others count the bytes of `decode([id])`. Special (added) tokens count 0 bytes:
    they are not text."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # a dependency of attnres; a broken install is the user's to fix
        raise ConfigError("bits per byte need the `tokenizers` package; pip install tokenizers") from err
    tok = Tokenizer.from_file(str(tokenizer_file))
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1 if vocab else 0
    lengths = np.zeros(size, dtype=np.int64)
    special = {t.content for t in tok.get_added_tokens_decoder().values()} if hasattr(
        tok, "get_added_tokens_decoder") else set()
    byte_level = _is_byte_level(json.loads(Path(tokenizer_file).read_text()))
    for token, i in vocab.items():
        if token in special:
            continue
        lengths[i] = len(token) if byte_level else len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths


def _is_byte_level(spec: dict) -> bool:
    def has(node: dict | None) -> bool:
        if not node:
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(n) for n in node.get("decoders", []) + node.get("pretokenizers", []))
    return has(spec.get("decoder"))


def _window(data: np.ndarray, offset: int, block_size: int) -> tuple[Tensor, Tensor]:
    chunk = torch.from_numpy(np.array(data[offset : offset + block_size + 1], dtype=np.int64))  # (T + 1,)
    return chunk[:-1], chunk[1:]


class _Shards:
    """Memmaps of shards opened lazily, so datasets pickle cheaply and each worker maps its own."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards, self._maps = shards, None

    def __getitem__(self, k: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [None] * len(self.shards)
        if self._maps[k] is None:
            self._maps[k] = self.shards[k].tokens()
        return self._maps[k]

    def __getstate__(self) -> dict:
        return {"shards": self.shards, "_maps": None}


class TokenTrainWindows(Dataset):
    """Item i: T + 1 tokens at a start drawn from (seed, i) over every position of every shard."""

    def __init__(self, shards: list[Shard], block_size: int, seed: int) -> None:
        self.data, self.block_size, self.seed = _Shards(shards), block_size, seed
        starts = np.array([max(s.num_tokens - block_size, 0) for s in shards], dtype=np.int64)
        self.bounds = np.cumsum(starts)  # window starts of shards 0..k together
        self.num_offsets = int(self.bounds[-1]) if len(starts) else 0

    def __len__(self) -> int:
        return 2**62

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, offset) of sample i."""
        u = int(sample_rng(TRAIN_STREAM, self.seed, i).integers(self.num_offsets))
        k = int(np.searchsorted(self.bounds, u, side="right"))
        return k, u - (int(self.bounds[k - 1]) if k else 0)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        k, offset = self.locate(i)
        return _window(self.data[k], offset, self.block_size)


class TokenValWindows(Dataset):
    """Item j: the j-th consecutive window of T inputs (+1 target) from the start of the validation files."""

    def __init__(self, shards: list[Shard], block_size: int, max_windows: int) -> None:
        self.data, self.block_size = _Shards(shards), block_size
        self.index: list[tuple[int, int]] = []
        for k, s in enumerate(shards):
            for w in range(max((s.num_tokens - 1) // block_size, 0)):
                if len(self.index) == max_windows:
                    break
                self.index.append((k, w * block_size))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, j: int) -> tuple[Tensor, Tensor]:
        if not 0 <= j < len(self.index):
            raise IndexError(j)
        k, offset = self.index[j]
        return _window(self.data[k], offset, self.block_size)


class TokensDataModule(StreamDataModule):
    """Pre-tokenized data: `path` is a folder of `*train*.bin` and `*val*.bin` token files (see
    the module docstring for the formats). `val_tokens` input tokens are scored per validation
    (null: `val_batches * batch_size * block_size`)."""

    def __init__(
        self,
        *,
        path: str | None = None,
        block_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        val_batches: int = 16,
        val_tokens: int | None = None,
        vocab_size: int | None = None,
        dtype: str | None = None,
        tokenizer: str | None = None,
        tokens_per_step: int | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(block_size=block_size, batch_size=batch_size, num_workers=num_workers, seed=seed,
                         val_batches=val_batches, tokens_per_step=tokens_per_step)
        if not path:
            raise ConfigError("data.path is not set; set data.path=<folder with train*.bin and val*.bin> "
                              "(attnres-prepare writes one from text)")
        self.path = Path(os.path.expanduser(os.path.expandvars(str(path))))
        if not self.path.is_dir():
            raise ConfigError(f"data.path={str(self.path)!r} is not a folder; point it at the folder holding "
                              "train*.bin and val*.bin (attnres-prepare SRC OUT_DIR writes one)")
        if val_tokens is not None and (not isinstance(val_tokens, int) or isinstance(val_tokens, bool)
                                       or val_tokens < block_size):
            raise ConfigError(f"data.val_tokens={val_tokens!r} must be an integer >= data.block_size={block_size}, "
                              "or null for val_batches * batch_size * block_size")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"data.dtype={dtype!r} is not one of uint16, uint32; or set data.dtype=null")
        self.meta = self._read_meta()
        self.val_tokens = val_tokens if val_tokens is not None else val_batches * batch_size * block_size
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else corpus.default_cache_dir()
        self.vocab_size = self._vocab_size(vocab_size)
        raw = dtype or self.meta.get("dtype") or ("uint16" if self.vocab_size <= 2**16 else "uint32")
        if raw not in DTYPES:
            raise ConfigError(f"{self.path / 'meta.json'}: dtype {raw!r} is not uint16 or uint32; "
                              "fix it or set data.dtype")
        self.raw_dtype = DTYPES[raw]
        self.tokenizer_file = self._tokenizer_file(tokenizer)
        self.metric = "bpb" if self.tokenizer_file else "loss"
        self.token_bytes: Tensor | None = None
        if self.tokenizer_file is None:
            log.warning("data=tokens: no tokenizer.json in %s and data.tokenizer is not set: val/bpb is not "
                        "reported (val/loss only, nats per token)", self.path)
        self.train_shards: list[Shard] | None = None
        self.val_shards: list[Shard] | None = None
        self.setup()  # fail now, before the model, the trainer or its logger exist, on a bad file

    # -- what the folder holds ----------------------------------------------------------------
    def _read_meta(self) -> dict:
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            return {}
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"{meta_path} is not valid JSON ({err}); fix or remove it") from err
        if not isinstance(meta, dict):
            raise ConfigError(f"{meta_path} must hold a JSON object; fix or remove it")
        return meta

    def _vocab_size(self, vocab_size: int | None) -> int:
        if vocab_size is None:
            vocab_size = self.meta.get("vocab_size")
            if vocab_size is None:
                raise ConfigError(f"the vocabulary size of {self.path} is unknown: no meta.json with vocab_size there; "
                                  "set data.vocab_size=<N> (e.g. 50257 for GPT-2 tokens)")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ConfigError(f"data.vocab_size={vocab_size!r} must be a positive integer, e.g. data.vocab_size=50257")
        return vocab_size

    def _tokenizer_file(self, tokenizer: str | None) -> Path | None:
        if tokenizer:
            file = Path(os.path.expanduser(str(tokenizer)))
            if not file.is_file():
                raise ConfigError(f"data.tokenizer={str(file)!r} is not a file; point it at a local tokenizer.json "
                                  "or set data.tokenizer=null")
            return file
        named = self.meta.get("tokenizer_file")
        for candidate in ([self.path / named] if named else []) + [self.path / "tokenizer.json"]:
            if candidate.is_file():
                return candidate
        return None

    def list_files(self) -> tuple[list[str], list[str]]:
        train = sorted(str(p) for p in self.path.glob("*train*.bin"))
        val = sorted(str(p) for p in self.path.glob("*val*.bin"))
        for split, files in (("train", train), ("val", val)):
            if not files:
                raise ConfigError(f"data.path={str(self.path)!r} holds no {split}*.bin file; "
                                  "point it at a folder written by attnres-prepare (or nanoGPT's prepare.py)")
        return train, val

    def describe(self) -> str:
        return f"data.path={str(self.path)!r}"

    # -- building -----------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_shards is not None:
            return
        train_files, val_files = self.list_files()
        train, val = open_split(train_files, self.raw_dtype), open_split(val_files, self.raw_dtype)
        for shard in train + val:
            top = max_token(shard, self.cache_dir)
            if top >= self.vocab_size:
                raise ConfigError(f"{shard.path} holds token id {top}, outside the vocabulary of "
                                  f"{self.vocab_size}; set data.vocab_size>={top + 1} (or fix meta.json)")
        need = self.block_size + 1
        if max((s.num_tokens for s in train), default=0) < need:
            raise ConfigError(f"{self.describe()}: no training file has block_size+1={need} tokens; "
                              "lower data.block_size or add data")
        if max((s.num_tokens for s in val), default=0) < need:
            raise ConfigError(f"{self.describe()}: no validation file has block_size+1={need} tokens; "
                              "lower data.block_size or add validation data")
        if self.tokenizer_file is not None:
            lengths = token_byte_lengths(self.tokenizer_file)
            if len(lengths) < self.vocab_size:
                lengths = np.concatenate([lengths, np.zeros(self.vocab_size - len(lengths), dtype=np.int64)])
            self.token_bytes = torch.from_numpy(lengths[: self.vocab_size])
        self.train_shards, self.val_shards = train, val

    def train_dataset(self) -> TokenTrainWindows:
        self.setup()
        return TokenTrainWindows(self.train_shards, self.block_size, self.seed)

    def val_dataset(self) -> TokenValWindows:
        self.setup()
        return TokenValWindows(self.val_shards, self.block_size, max(1, self.val_tokens // self.block_size))

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (mode=sample); needs the tokenizer."""
        if self.tokenizer_file is None:
            raise ConfigError(f"decoding tokens needs a tokenizer: none in {self.path}; "
                              "set data.tokenizer=<tokenizer.json>")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_file)).decode(ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer_file is None:
            raise ConfigError(f"encoding a prompt needs a tokenizer: none in {self.path}; "
                              "set data.tokenizer=<tokenizer.json>")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_file)).encode(text).ids
