"""Run folder names: `${attnres.run_id:${hydra.job.override_dirname}}` in conf/config.yaml, for
single runs (`hydra.run.dir`) and sweep jobs (`hydra.sweep.subdir`) alike.

A name is one flat folder: the overrides as given (`num_blocks=8,residual=block`), except that
a value holding a path (`data.path=/data/a/corpus.txt`) becomes its last part plus a short hash
of the whole value (`data.path=corpus.txt-3f2a9c1e`), and a name longer than `MAX_BYTES` is
cut and ends with a hash of the whole. The same overrides always give the same name.

Registered on import (config.compose, config.job and training.run import this module), so that
every process that composes or runs a job has it.
"""

from __future__ import annotations

import hashlib
import re

from omegaconf import OmegaConf

from attnres.config import costs  # noqa: F401  (registers ${attnres.steps:...} too, which experiments use)

MAX_BYTES = 200  # well under the 255 bytes most file systems allow in one name
HASH_CHARS = 8
# Hydra joins the overrides with "," and writes each as key=value; a value may hold a "," too
# (`x=[1,2]`), so split only where a key follows
NEXT_OVERRIDE = re.compile(r",(?=[+~]{0,2}[A-Za-z_][\w.\-/@]*=)")
_UNSAFE = re.compile(r"[^\w.+\-]")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]


def _flat(text: str) -> str:
    """`text` without "/": its last non-empty part (only safe characters), then a hash of it all."""
    if "/" not in text:
        return text
    parts = [p for p in text.split("/") if p not in ("", ".", "..")]
    readable = _UNSAFE.sub("", parts[-1] if parts else "").lstrip(".")[:64]
    return f"{readable}-{_digest(text)}" if readable else _digest(text)


def split_overrides(name: str) -> list[str]:
    """The `key=value` items of a run folder name or an `override_dirname` (a value may hold a ",")."""
    return NEXT_OVERRIDE.split(name)


def run_id(override_dirname: str) -> str:
    """The folder name of a run from Hydra's `override_dirname` ("defaults" when empty)."""
    if not override_dirname:
        return "defaults"
    items = []
    for item in split_overrides(override_dirname):
        key, sep, value = item.partition("=")
        items.append(f"{key.replace('/', '.')}{sep}{_flat(value)}" if sep else _flat(item))
    name = ",".join(items)
    if name.startswith("."):  # never a hidden folder, nor "." or ".."
        name = "_" + name
    if len(name.encode()) > MAX_BYTES:
        head = name.encode()[: MAX_BYTES - HASH_CHARS - 1].decode(errors="ignore")
        name = f"{head}-{_digest(override_dirname)}"
    return name


if not OmegaConf.has_resolver("attnres.run_id"):
    OmegaConf.register_new_resolver("attnres.run_id", run_id)
