"""Run folder names: `${attnres.run_id:${hydra.job.override_dirname},${ckpt_path},${mode}}` in
conf/config.yaml, for single runs (`hydra.run.dir`) and sweep jobs (`hydra.sweep.subdir`) alike.

A name is one flat folder: the overrides as given (`num_blocks=8,residual=block`), led by the keys
a sweep varies (`SWEPT_ENV`: `residual=block,seed=1,model.n_layer=2,num_blocks=2` for
`-m residual=standard,block seed=0,1,2 model.n_layer=2 num_blocks=2`, so that TensorBoard's run
list, which cuts long names, shows what differs between the runs first), except that
a value holding a path (`data.path=/data/a/corpus.txt`) becomes its last part plus a short hash
of the whole value (`data.path=corpus.txt-3f2a9c1e`), and a name longer than `MAX_BYTES` is
cut and ends with a hash of the whole. The same overrides always give the same name.

Registered on import (config.compose, config.job and training.run import this module), so that
every process that composes or runs a job has it.
"""

from __future__ import annotations

import hashlib
import os
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


#: the keys the sweep of this process varies, comma-separated, in the command line's order: set by
#: `attnres-run -m` before Hydra plans the jobs (`set_swept_keys`), inherited by the sweep's workers
SWEPT_ENV = "ATTNRES_SWEPT_KEYS"


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys (as run folder names write them) that command-line overrides sweep: `a,b`, range(),
    choice(), glob(). Hydra's own parser reads them, as the sweeper will."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except Exception:  # noqa: BLE001  (a malformed override: Hydra refuses it in its own words later)
        return []
    keys = [o.get_key_element().lstrip("+~").replace("/", ".") for o in parsed if o.is_sweep_override()]
    on_demand = any(o.get_key_element().lstrip("+~") == "seeds.on_demand"
                    and str(o.value()).lower() in ("true", "1", "yes") for o in parsed)
    return keys + ["seed"] if on_demand and "seed" not in keys else keys  # the design picks the seeds


def set_swept_keys(overrides: list[str]) -> None:
    """Lead every job folder of this process's sweep with the keys `overrides` sweep."""
    os.environ[SWEPT_ENV] = ",".join(swept_keys(overrides))


def _leading(items: list[str]) -> list[str]:
    """`items` (key=value) with the swept keys first, in the command line's order; the rest as they were."""
    swept = [k for k in os.environ.get(SWEPT_ENV, "").split(",") if k]
    rank = {key: i for i, key in enumerate(swept)}
    return sorted(items, key=lambda item: rank.get(item.partition("=")[0].lstrip("+~"), len(rank)))


def _checkpoint(ckpt_path: str) -> str:
    """`from=RUN.last-<hash>` for RUN/checkpoints/last.ckpt: the run and the file a checkpoint came from."""
    parts = [p for p in str(ckpt_path).split("/") if p not in ("", ".", "..")]
    stem = parts[-1].removesuffix(".ckpt") if parts else ""
    run = parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else (parts[-2] if len(parts) >= 2 else "")
    readable = _UNSAFE.sub("", (f"{run}.{stem}" if run else stem).replace("=", "-")).lstrip(".")[:64]
    return f"from={readable}-{_digest(str(ckpt_path))}" if readable else f"from={_digest(str(ckpt_path))}"


def run_id(override_dirname: str, ckpt_path: str | None = None, mode: str | None = None) -> str:
    """The folder name of a run from Hydra's `override_dirname` ("defaults" when empty). A run that
    uses a checkpoint without training it (mode=eval, mode=sample) leads with the checkpoint it read
    (`from=RUN.last-<hash>`): what differs between two samples is the model, not the prompt."""
    items = []
    if mode in ("eval", "sample") and ckpt_path:
        items.append(_checkpoint(ckpt_path))
    if not override_dirname and not items:
        return "defaults"
    for item in split_overrides(override_dirname) if override_dirname else []:
        key, sep, value = item.partition("=")
        items.append(f"{key.replace('/', '.')}{sep}{_flat(value)}" if sep else _flat(item))
    name = ",".join(_leading(items))
    if name.startswith("."):  # never a hidden folder, nor "." or ".."
        name = "_" + name
    if len(name.encode()) > MAX_BYTES:
        head = name.encode()[: MAX_BYTES - HASH_CHARS - 1].decode(errors="ignore")
        whole = override_dirname if len(items) == len(split_overrides(override_dirname or "")) and override_dirname \
            else f"{items[0]},{override_dirname}"  # a checkpoint's name leads: it is part of the whole
        name = f"{head}-{_digest(whole)}"
    return name


if not OmegaConf.has_resolver("attnres.run_id"):
    OmegaConf.register_new_resolver("attnres.run_id", run_id)
