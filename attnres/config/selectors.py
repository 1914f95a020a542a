"""A key whose value picks an entry of a table in the config (`experiment=paper_*`: `scale=` picks
a row of `scales`, `size=` one of `sizes.<scale>`, through `${sizes.${scale}.${size}}`). A value
that names no entry breaks that interpolation deep inside another key; `explain` turns the error
into one line naming the key the user typed and its valid values.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from omegaconf import DictConfig
from omegaconf.errors import InterpolationKeyError

from attnres.config.errors import ConfigError

MISSING = re.compile(r"Interpolation key '([^']+)' not found")


def _raw(cfg: DictConfig, key: str) -> Any:
    """The value at top-level `key` as written (None for a table or an interpolation)."""
    node = cfg._get_node(key)
    value = node._value() if node is not None and not isinstance(node, DictConfig) else None
    return None if isinstance(value, str) and "${" in value else value


def explain(cfg: DictConfig, err: Exception) -> str | None:
    """One line for an interpolation `a.b.c` that breaks because a top-level key's value names no
    entry of the table `a` (or `a.b`), or for one whose resolver refused its arguments with a
    ConfigError of its own (`budget=abc`); None when the error is something else."""
    cause: BaseException | None = err
    seen: set[int] = set()
    while cause is not None and not isinstance(cause, ConfigError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if cause is not None and not isinstance(cause, ConfigError):
        cause = None
    if cause is not None:  # a resolver of ours (attnres.steps, ...) refused its arguments: its words name the fix
        return str(cause)
    match = MISSING.search(str(err)) if isinstance(err, InterpolationKeyError) else None
    if match is None:
        return None
    node: Any = cfg
    parts = match.group(1).split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            table = ".".join(parts[:depth]) or "the config"
            valid = [str(k) for k in node.keys()]
            users = [k for k in cfg.keys() if k != "hydra" and str(_raw(cfg, str(k))) == part]
            if not users or not valid:
                return None
            key = users[0]
            close = difflib.get_close_matches(part, valid, n=1) or difflib.get_close_matches(
                part.lower(), [v.lower() for v in valid], n=1)
            hint = f"did you mean {key}={close[0]}?" if close else f"pick one, e.g. {key}={valid[0]}"
            return f"{key}={part} is not one of {', '.join(valid)} (the entries of {table}); {hint}"
        node = node._get_node(part)
    return None
