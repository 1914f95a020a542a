"""Byte corpora on disk: list text files, split them, concatenate them once into a uint8 cache.

The cache is two flat files of bytes (train, validation) that the data modules memory-map, so a
corpus of many GB is read once to build it and never held in memory. A cache file is named by a
hash of everything it depends on (file list, sizes, mtimes, split) so a changed corpus gets a new
cache, and is written to a temporary file in the same folder then `os.replace`d, so a crash or a
concurrent job never leaves a half-written cache under the final name.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

CACHE_VERSION = 1
SEPARATOR = b"\n\n"  # between two files of the same split
CHUNK = 1 << 20  # bytes per read while copying
PROGRESS_EVERY = 256 << 20  # log progress every this many bytes
STALE_TEMP_S = 3600  # a build's temporary file untouched this long was left by a killed process


@dataclass(frozen=True)
class SourceFile:
    rel: str  # posix path relative to the corpus root: what the split hashes
    path: str  # absolute path
    size: int
    mtime_ns: int


def default_cache_dir() -> Path:
    """$ATTNRES_CACHE, else $XDG_CACHE_HOME/attnres, else ~/.cache/attnres."""
    if os.environ.get("ATTNRES_CACHE"):
        return Path(os.environ["ATTNRES_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnres"


def in_validation(rel: str, val_fraction: float) -> bool:
    """A file's split: a stable hash of its relative path alone, so it never changes with the file set."""
    return zlib.crc32(rel.encode("utf-8")) / 2**32 < val_fraction


def stat_file(root: str, path: str) -> SourceFile:
    st = os.stat(path)
    return SourceFile(Path(os.path.relpath(path, root)).as_posix(), os.path.abspath(path), st.st_size, st.st_mtime_ns)


def walk_files(root: str, suffix: str = "", skip_dirs: frozenset[str] = frozenset()) -> list[SourceFile]:
    """Files under `root` ending in `suffix`, sorted by relative path; hidden files and dirs skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffix) and not f.startswith(".")]
    return sorted((stat_file(root, p) for p in found), key=lambda f: f.rel)


def glob_files(pattern: str) -> tuple[str, list[SourceFile]]:
    """Files matching `pattern` (`**` recurses), relative to the pattern's fixed leading folders."""
    parts = Path(pattern).parts
    fixed = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    root = str(Path(*parts[:fixed])) if fixed else "."
    matches = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    return root, sorted((stat_file(root, p) for p in matches), key=lambda f: f.rel)


def cache_key(root: str, files: list[SourceFile], split: str, val_fraction: float) -> str:
    spec = {
        "version": CACHE_VERSION,
        "root": os.path.abspath(root),
        "files": [(f.rel, f.size, f.mtime_ns) for f in files],
        "split": split,
        "val_fraction": val_fraction,
        "separator": SEPARATOR.hex(),
    }
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _copy_utf8(src: str, dst, start: int = 0, stop: int | None = None) -> bool:
    """Append bytes [start, stop) of `src` to `dst` if the whole file is UTF-8; else append nothing."""
    mark = dst.tell()
    decoder = codecs.getincrementaldecoder("utf-8")()
    pos = 0
    try:
        with open(src, "rb") as f:
            while chunk := f.read(CHUNK):
                decoder.decode(chunk)  # validates the whole file, also the part not copied
                lo, hi = max(start - pos, 0), len(chunk) if stop is None else min(stop - pos, len(chunk))
                if lo < hi:
                    dst.write(chunk[lo:hi])
                pos += len(chunk)
            decoder.decode(b"", final=True)
        return True
    except UnicodeDecodeError:
        dst.seek(mark)
        dst.truncate()
        return False


def remove_stale_temps(cache_dir: Path) -> None:
    """Delete temporary files of builds that were killed (SIGKILL skips their cleanup): any
    `.*.tmp` not written to for STALE_TEMP_S. A live build writes continuously, so its files
    stay fresh and are left alone."""
    cutoff = time.time() - STALE_TEMP_S
    for tmp in cache_dir.glob(".*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                log.info("removed %s, left by an interrupted cache build", tmp)
        except FileNotFoundError:  # another process removed it first
            pass


def build_cache(
    root: str,
    files: list[SourceFile],
    val_fraction: float,
    cache_dir: Path,
    name: str,
    skipped_level: int = logging.WARNING,
) -> tuple[Path, Path]:
    """The (train, val) cache files for this corpus, built unless they exist already.

    Several files: a file goes to validation when `in_validation(rel)`. One file: the last
    `val_fraction` of its bytes is validation. Files that are not UTF-8 are skipped (logged at
    `skipped_level`).
    """
    split = "position" if len(files) == 1 else "crc32-path"
    key = cache_key(root, files, split, val_fraction)
    train_path, val_path = cache_dir / f"{name}-{key}.train.u8", cache_dir / f"{name}-{key}.val.u8"
    if train_path.exists() and val_path.exists():
        return train_path, val_path

    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(cache_dir)
    total = sum(f.size for f in files)
    log.info("building %s byte cache: %d files, %.1f MB from %s", name, len(files), total / 1e6, root)
    t0, copied, next_report, skipped = time.perf_counter(), 0, PROGRESS_EVERY, []
    temps = [tempfile.NamedTemporaryFile(dir=cache_dir, prefix=f".{name}-{key}.", suffix=".tmp", delete=False)
             for _ in range(2)]
    try:
        train_out, val_out = temps
        if split == "position":
            cut = files[0].size - round(files[0].size * val_fraction)
            if _copy_utf8(files[0].path, train_out, 0, cut):
                _copy_utf8(files[0].path, val_out, cut)
            else:
                skipped.append(files[0].rel)
        else:
            for f in files:
                out = val_out if in_validation(f.rel, val_fraction) else train_out
                mark = out.tell()
                if mark:
                    out.write(SEPARATOR)
                if not _copy_utf8(f.path, out):
                    out.seek(mark)
                    out.truncate()
                    skipped.append(f.rel)
                copied += f.size
                if copied >= next_report:
                    log.info("  %.0f%% (%.1f MB)", 100 * copied / max(total, 1), copied / 1e6)
                    next_report += PROGRESS_EVERY
        for out in temps:
            out.flush()
            os.fsync(out.fileno())
            out.close()
            os.chmod(out.name, 0o644)  # temporary files are private (0600); a cache is shared
        os.replace(val_out.name, val_path)  # val first: a cache counts as present once train exists too
        os.replace(train_out.name, train_path)
    finally:
        for out in temps:
            out.close()
            if os.path.exists(out.name):
                os.unlink(out.name)
    if skipped:
        log.log(skipped_level, "skipped %d file(s) that are not UTF-8 text: %s%s", len(skipped),
                ", ".join(skipped[:5]), ", ..." if len(skipped) > 5 else "")
    log.info("%s cache built in %.1f s: train %d bytes, val %d bytes", name, time.perf_counter() - t0,
             train_path.stat().st_size, val_path.stat().st_size)
    return train_path, val_path


def byte_counts(data: np.ndarray, chunk: int = 64 << 20) -> np.ndarray:
    """Counts of each byte value (256,), int64, read in chunks so a memmap is never loaded whole."""
    counts = np.zeros(256, dtype=np.int64)
    for start in range(0, len(data), chunk):
        counts += np.bincount(data[start : start + chunk], minlength=256)
    return counts


def unigram_bits_per_byte(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy in bits per byte on `val` of an add-one smoothed unigram byte model fit on `train`."""
    p = (byte_counts(train) + 1) / (len(train) + 256)
    val_counts = byte_counts(val)
    return float(-(val_counts * np.log2(p)).sum() / val_counts.sum())
