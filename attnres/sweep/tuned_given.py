"""`hydra.sweeper.method=given`: a tuned sweep whose arms' values are already known, so no search runs.

An earlier search (or a paper) chose each arm's values; the verdict is what is wanted now, with
more seeds, seeds on demand, or another margin. `hydra.sweeper.given` maps each arm's label (as the
start line and summary name it: `standard`, `block`, `block N=4`) to its values:

    attnres-run -m tune=lr residual=standard,block hydra.sweeper.method=given \
        'hydra.sweeper.given={standard:{optim.optimizer.lr:0.024},block:{optim.optimizer.lr:0.012}}'

Each arm's values then enter the verdict stage exactly as a search's choice does (`tuned.py`): as a
multiple of the arm's configured value, so a value carries to another size the same way. The sweep
cannot check how the values were chosen: the summary says they were given, and a verdict seed that
was one of the earlier search's seeds is the user's to avoid (`tuning_seeds` still refuses its own).

Functions of the sweeper, as `tuned_grid.py`'s are: this module imports nothing of `tuned.py`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres.config.errors import ConfigError
from attnres.results import tuning

METHOD = "given"
EXAMPLE = "'hydra.sweeper.given={standard:{optim.optimizer.lr:0.024},block:{optim.optimizer.lr:0.012}}'"


def given_keys(given: Mapping[str, Any]) -> list[str]:
    """The keys the arms' values set, in the order first given (the sweeper's 'searched' keys)."""
    keys: list[str] = []
    for values in given.values():
        for key in values if isinstance(values, Mapping) else ():
            if str(key) not in keys:
                keys.append(str(key))
    return keys


def check_settings(given: Any) -> None:
    """One line (exit 2) for a `given` that names no values: before any config is composed."""
    if not isinstance(given, Mapping) or not given:
        raise ConfigError("hydra.sweeper.method=given needs each arm's values in hydra.sweeper.given, e.g. " + EXAMPLE)
    for label, values in given.items():
        if not isinstance(values, Mapping) or not values:
            raise ConfigError(f"hydra.sweeper.given.{label} is not a {{key: value}} map of the arm's values, e.g. "
                              + EXAMPLE)
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"hydra.sweeper.given.{label}.{key}={value} must be a number above 0 (the value "
                                  "the arm runs at), e.g. " + EXAMPLE)


def place(given: Mapping[str, Mapping[str, Any]], groups: Sequence[dict[str, Any]]) -> None:
    """Each arm's given values as its centre (what its verdict runs at) and their ratio to its
    configured values; an arm without values, or values for no arm, refused in one line."""
    labels = [g["label"] for g in groups]
    for name in given:
        if name not in labels:
            close = difflib.get_close_matches(str(name), labels, n=1)
            maybe = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"hydra.sweeper.given names {name}, which is no arm of this sweep{maybe}; its arms: "
                              f"{', '.join(labels)}")
    keys = given_keys(given)
    for group in groups:
        values = given.get(group["label"])
        if values is None:
            raise ConfigError(f"hydra.sweeper.given has no values for the arm {group['label']}; give every arm "
                              f"its values (the arms: {', '.join(labels)}), e.g. " + EXAMPLE)
        lacking = [k for k in keys if k not in values]
        if lacking:
            raise ConfigError(f"hydra.sweeper.given.{group['label']} lacks {', '.join(lacking)}, which another arm "
                              "sets; give every arm the same keys (an arm at its configured value: give that value)")
        configured = dict(group["centre"])
        group.update(configured=configured, given=True, initial_trials=0, trials=[],
                     centre={k: float(values[k]) for k in keys},
                     centre_ratio={k: float(values[k]) / float(configured[k]) for k in keys})


def choose(sweep_dir: Path, state: dict[str, Any]) -> bool:
    """The search stage of method=given: nothing runs; each arm's choice is its given values."""
    for group in state["groups"]:
        group.update(exponents=[0], extended={"down": 0, "up": 0}, means={}, chosen=0, chosen_multiplier=1.0,
                     chosen_values=dict(group["centre"]), chosen_mean=None, edge=None)
    tuning.write_state(sweep_dir, state)
    return True


def describe(groups: Sequence[Mapping[str, Any]]) -> str:
    """The start line's words for the arms' values: `standard at optim.optimizer.lr=0.024, block at ...`."""
    return ", ".join(f"{g['label']} at " + ", ".join(f"{k}={tuning.format_value(v)}" for k, v in g["centre"].items())
                     for g in groups)

