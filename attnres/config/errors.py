"""Errors that are the user's to fix.

`attnres-run` prints a `ConfigError` as one line (no traceback) and exits with status 2;
its message must say what is wrong and name the fix, on one line:
`<what is wrong>; <the fix>`, naming the key as it is written on the command line
(`model.n_layers`, `trainer.max_steps=-5`) and the value or override that fixes it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from hydra.errors import InstantiationException
from omegaconf.errors import MissingMandatoryValue


class ConfigError(ValueError):
    """A bad configuration value, path or checkpoint, explained in one line."""


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn errors that are the user's to fix into one line on stderr and exit status 2.

    `HYDRA_FULL_ERROR=1` re-raises them with the full traceback instead.
    """
    try:
        yield
    except MissingMandatoryValue as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        key = err.full_key or "a required key"
        print(f"attnres-run: error: {key} has no value; set {key}=<value> on the command line", file=sys.stderr)
        sys.exit(2)
    except (ConfigError, InstantiationException) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        cause = err
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(err, InstantiationException) and not isinstance(cause, (ValueError, TypeError, OSError)):
            raise
        hint = "  (HYDRA_FULL_ERROR=1 shows the full trace)" if cause is not err else ""
        print(f"attnres-run: error: {cause}{hint}", file=sys.stderr)
        sys.exit(2)


