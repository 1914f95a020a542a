"""What attnres-prepare reads: the source's files (stdlib, a file, a folder or a glob), cut into
tasks of at most `CHUNK_BYTES` at newlines, and read back as documents (text, JSONL, Parquet),
each with the split it belongs to.
"""


from __future__ import annotations

import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attnres.config.errors import ConfigError
from attnres.data import corpus

log = logging.getLogger("attnres.prepare")


CHUNK_BYTES = 8 << 20  # a task: at most this much of one file (cut after a newline)
STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Task:
    """A piece of one source file: bytes [start, stop) of a text or JSONL file, or a Parquet row group."""

    path: str
    rel: str
    kind: str  # text | jsonl | parquet
    start: int
    stop: int  # byte offset, or row group + 1 for parquet
    split: str  # text files: "train" | "val"; jsonl / parquet: "doc" (per document)
    last: bool  # the file's last piece: an end-of-text token follows it (text files)
    nbytes: int  # bytes of the source file this task covers (for progress)


# -- the source ----------------------------------------------------------------------------------
def kind_of(path: str) -> str:
    suffix = Path(path).suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def list_source(src: str, max_files: int | None = None) -> tuple[str, list[corpus.SourceFile]]:
    if src == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        files = corpus.walk_files(root, ".py", STDLIB_SKIP)
    elif os.path.isfile(src):
        root = os.path.dirname(os.path.abspath(src))
        files = [corpus.stat_file(root, src)]
    elif os.path.isdir(src):
        root, files = src, corpus.walk_files(src)
    else:
        root, files = corpus.glob_files(src)
    files = files[:max_files]
    if not files:
        raise ConfigError(f"SRC={src!r} matches no file; give `stdlib`, a file, a folder or a glob of text, "
                          ".jsonl or .parquet files")
    return root, files


def _cuts(path: str, size: int) -> list[int]:
    """Offsets that cut `path` into pieces of about CHUNK_BYTES, each right after a newline."""
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + CHUNK_BYTES < size:
            f.seek(cuts[-1] + CHUNK_BYTES)
            f.readline()
            at = f.tell()
            if at >= size:
                break
            cuts.append(at)
    return cuts + [size]


def make_tasks(files: list[corpus.SourceFile], val_fraction: float) -> list[Task]:
    tasks: list[Task] = []
    single_text = len(files) == 1 and kind_of(files[0].path) == "text"
    for f in files:
        kind = kind_of(f.path)
        if kind == "parquet":
            groups = _parquet(f.path).num_row_groups
            tasks += [Task(f.path, f.rel, kind, g, g + 1, "doc", g == groups - 1, f.size // max(groups, 1))
                      for g in range(groups)]
            continue
        cuts = _cuts(f.path, f.size)
        if single_text:  # the last val_fraction of its bytes, cut after a newline, is validation
            val_at = _cuts_at(f.path, f.size - round(f.size * val_fraction))
            cuts = sorted({*cuts, val_at})
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if kind == "jsonl":
                split = "doc"
            elif single_text:
                split = "val" if a >= val_at else "train"
            else:
                split = "val" if corpus.in_validation(f.rel, val_fraction) else "train"
            last = b == f.size or (single_text and b == val_at)
            tasks.append(Task(f.path, f.rel, kind, a, b, split, last, b - a))
    return tasks


def _cuts_at(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(max(offset, 0))
        if offset > 0:
            f.readline()
        return f.tell()


def _parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ConfigError(f"{path}: reading .parquet needs pyarrow; pip install pyarrow "
                          "(or pip install 'attnres[parquet]')") from err
    return pq.ParquetFile(path)


def documents(task: Task, text_field: str) -> Iterator[tuple[str, bytes]]:
    """(split, UTF-8 text) of each document of a task; raises UnicodeDecodeError on a text piece that is not UTF-8."""
    if task.kind == "parquet":
        table = _parquet(task.path).read_row_group(task.start, columns=[text_field])
        for text in table.column(text_field).to_pylist():
            if text:
                data = text.encode("utf-8")
                yield _doc_split(data), data
        return
    with open(task.path, "rb") as f:
        f.seek(task.start)
        data = f.read(task.stop - task.start)
    if task.kind == "text":
        data.decode("utf-8")  # validates
        yield task.split, data
        return
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{task.rel}: a line after byte {task.start} (#{number} of its piece) is not JSON "
                              f"({err}); fix the file or leave it out") from err
        text = doc.get(text_field) if isinstance(doc, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{task.rel}: a document has no string field {text_field!r}; "
                              "pass --text-field <name of the text field>")
        if text:
            data = text.encode("utf-8")
            yield _doc_split(data), data


_VAL_FRACTION = 0.05


def _doc_split(data: bytes) -> str:
    return "val" if zlib.crc32(data) / 2**32 < _VAL_FRACTION else "train"


