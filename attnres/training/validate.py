"""Checks of the command line and of the composed config, before anything runs.

Every mistake a user can make on the command line gets one line naming the fix (a
`ConfigError`, printed by `run.user_errors` with exit status 2), and nothing is written.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig

from attnres.training.errors import ConfigError

GROUPS_CHECKED = ("residual", "model", "data", "trainer", "optim", "logger", "callbacks", "experiment", "debug")


def check_command_line(argv: list[str], conf_dir: Path) -> None:
    """Everything that can be checked from the arguments alone, before Hydra sees them."""
    check_group_choices(argv, conf_dir)


def check_group_choices(argv: list[str], conf_dir: Path) -> None:
    """Reject `group=name` overrides that name no config file, listing the choices.

    Hydra would say so too, over several lines and with exit status 1; this says it in
    one line before anything is composed.
    """
    if any(arg.lstrip("+~").startswith("hydra.searchpath") for arg in argv):
        return  # configs from the user's own folders: Hydra knows the choices
    for arg in argv:
        key, sep, values = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS_CHECKED or any(c in values for c in "()[]{}$"):
            continue  # not a group choice, or a sweep expression Hydra will expand itself
        choices = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        for value in values.split(","):  # `residual=standard,block` in a sweep
            if value not in choices and value not in ("", "null"):
                hint = difflib.get_close_matches(value, choices, n=1)
                maybe = f" (did you mean {hint[0]}?)" if hint else ""
                raise ConfigError(f"unknown {key} '{value}'{maybe}; choose one of: {', '.join(choices)}")


def validate_config(cfg: DictConfig) -> None:
    """Values of the composed config (one job's), checked before anything is built or written."""
