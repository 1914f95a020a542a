"""Errors that are the user's to fix.

`attnres-run` prints a `ConfigError` as one line (no traceback) and exits with status 2;
its message must say what is wrong and name the fix.
"""


class ConfigError(ValueError):
    """A bad configuration value, path or checkpoint, explained in one line."""
