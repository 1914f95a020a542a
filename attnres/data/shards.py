"""Token shard files, without torch: the headered format (llm.c / modded-nanogpt) and raw files.

`attnres-prepare` writes these and `data=tokens` reads them (see `tokens.py` for the formats).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from attnres.config.errors import ConfigError

HEADER_INTS = 256  # int32 values in a shard header
HEADER_BYTES = HEADER_INTS * 4
#: magic -> (version, token dtype) of the headered formats
HEADERED = {20240520: (1, np.dtype(np.uint16)), 20240801: (7, np.dtype(np.uint32))}
DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}


@dataclass(frozen=True)
class Shard:
    """One token file: where its tokens start, their dtype and how many there are."""

    path: str
    offset: int  # bytes before the first token (the header)
    dtype: str
    num_tokens: int

    def tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.num_tokens,))


def write_shard(path: str | os.PathLike, tokens: np.ndarray, headered: bool = True) -> None:
    """Write `tokens` (uint16 or uint32) as a headered shard, or raw with `headered=False` (tests, tools)."""
    tokens = np.ascontiguousarray(tokens)
    with open(path, "wb") as f:
        if headered:
            f.write(shard_header(tokens.dtype, len(tokens)).tobytes())
        f.write(tokens.tobytes())


def shard_header(dtype: np.dtype, num_tokens: int) -> np.ndarray:
    magic = next(m for m, (_, d) in HEADERED.items() if d == np.dtype(dtype))
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = magic, HEADERED[magic][0], num_tokens
    return header


def open_shard(path: str, raw_dtype: np.dtype, expect_headered: bool | None = None) -> Shard:
    """Read `path`'s header (or none) and check its size. `expect_headered`: True when the other
    files of the folder are headered (a different first int32 is then a wrong magic, not a raw file)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(HEADER_BYTES), dtype=np.int32)
    magic = int(head[0]) if len(head) else None
    if magic in HEADERED:
        version, dtype = HEADERED[magic]
        if len(head) < HEADER_INTS:
            raise ConfigError(f"{path}: truncated shard ({size} bytes, shorter than its {HEADER_BYTES}-byte header); "
                              "prepare it again")
        if int(head[1]) != version:
            raise ConfigError(f"{path}: shard version {int(head[1])} with magic {magic}, expected {version}; "
                              "write it with attnres-prepare or the llm.c / modded-nanogpt tools")
        num_tokens = int(head[2])
        if size != HEADER_BYTES + num_tokens * dtype.itemsize:
            raise ConfigError(f"{path}: truncated shard: its header says {num_tokens} tokens "
                              f"({HEADER_BYTES + num_tokens * dtype.itemsize} bytes) but the file has {size} bytes; "
                              "copy or prepare it again")
        return Shard(path, HEADER_BYTES, dtype.name, num_tokens)
    if expect_headered:
        raise ConfigError(f"{path}: wrong magic {magic} (headered shards start with "
                          f"{' or '.join(map(str, HEADERED))}) while the other files here are headered; "
                          "remove it or prepare it again")
    if size % raw_dtype.itemsize:
        raise ConfigError(f"{path}: {size} bytes is not a whole number of {raw_dtype.name} tokens (truncated?); "
                          "copy it again, or set data.dtype to the dtype it was written with")
    return Shard(path, 0, raw_dtype.name, size // raw_dtype.itemsize)


def open_split(paths: list[str], raw_dtype: np.dtype) -> list[Shard]:
    """Shards of one split; all headered or all raw."""
    firsts = []
    for p in paths:
        with open(p, "rb") as f:
            first = np.frombuffer(f.read(4), dtype=np.int32)
        firsts.append(int(first[0]) if len(first) else None)
    headered = any(m in HEADERED for m in firsts)
    return [open_shard(p, raw_dtype, expect_headered=headered) for p in paths]
