"""Errors that are the user's to fix.

`attnres-run` prints a `ConfigError` as one line (no traceback) and exits with status 2;
its message must say what is wrong and name the fix, on one line:
`<what is wrong>; <the fix>`, naming the key as it is written on the command line
(`model.n_layers`, `trainer.max_steps=-5`) and the value or override that fixes it.
"""


class ConfigError(ValueError):
    """A bad configuration value, path or checkpoint, explained in one line."""
