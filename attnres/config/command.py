"""The shape of the command line, checked before Hydra sees it.

Every mistake a user can make on the command line gets one line naming the fix (a
`ConfigError`, printed by `errors.user_errors` with exit status 2), and nothing is written.
`check_command_line(argv, conf_dir)` runs in `cli.main()` before Hydra does, in this order:

1. the shape of the command line (here): known options, one group of `key=value` overrides,
   each with its `=`, Hydra's override grammar, sweeps only with `-m`, no empty sweep;
2. every job's config, composed as Hydra will compose it (`compose.py`);
3. every overridden value against the type of its default, then the job's values (`job.py`,
   `rules.py`), the interpolations, the cheap parts built once and the output folder.

Only Hydra and OmegaConf are imported at module level: torch and Lightning are imported by
the checks that need them, so that a command line that is wrong in its shape fails fast.
"""

from __future__ import annotations

import difflib
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnres.config import on_demand
from attnres.config.compose import check_jobs, hydra_on, parse_overrides
from attnres.config.errors import ConfigError

GROUPS_CHECKED = ("residual", "model", "data", "trainer", "optim", "logger", "callbacks", "experiment", "debug", "tune")


# == 1. the shape of the command line =================================================================
def check_command_line(argv: list[str], conf_dir: Path) -> None:
    """Everything that can be checked before Hydra runs: the arguments, and the config of
    every job they ask for. Raises ConfigError (or omegaconf's MissingMandatoryValue, which
    `user_errors` words too); writes nothing.

    A failure of the checks themselves (a bug here, or a Hydra they do not know) is not the
    user's mistake: the command line then goes to Hydra unchecked (`HYDRA_FULL_ERROR=1`
    raises it instead)."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        _check_command_line(argv, conf_dir)
    except (ConfigError, MissingMandatoryValue):
        raise
    except Exception:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise


def _check_command_line(argv: list[str], conf_dir: Path) -> None:
    args = parse_arguments(argv)
    if args is None or args.help or args.hydra_help or args.shell_completion or args.experimental_rerun:
        return  # Hydra prints something and exits, or re-runs a pickled job: nothing to check
    check_missing_equals(args.overrides)
    conf = config_folder(args, conf_dir)
    if args.config_dir is None:  # (an added folder may hold more options)
        check_group_choices(args.overrides, conf)
    overrides = parse_overrides(args.overrides)
    if args.config_dir is not None:
        if not Path(args.config_dir).is_dir():
            raise ConfigError(f"--config-dir {args.config_dir} is not a folder; name a folder of configs")
        return  # Hydra adds that folder to its search path itself; its configs are not known here
    multirun = args.multirun or any(
        o.key_or_group == "hydra.mode" and str(o.value()).upper() == "MULTIRUN" for o in overrides
    )
    check_sweeps(overrides, multirun)
    running = args.cfg is None and args.info is None  # --cfg and --info only print
    with hydra_on(conf):
        check_jobs(args.config_name or "config", overrides, multirun, running)
        if running and not multirun:
            on_demand.refuse_run_alone(args.config_name or "config", overrides)


def parse_arguments(argv: Sequence[str]) -> Any:
    """Hydra's own argument parser, with its errors as ConfigError; None for `--version`."""
    if "--version" in argv:
        return None
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        if message.startswith("argument --info/-i: invalid choice"):  # `--info key=value`: read as its value
            raise ConfigError(f"--info took {message.split(': ')[2].split(' (')[0]} as what to show; write "
                              "--info all (or config, defaults, defaults-tree, plugins, searchpath), or put "
                              "--info after the overrides")
        raise ConfigError(f"{message}; see attnres-run --hydra-help for the options")

    parser.error = error  # type: ignore[method-assign]  # argparse would print the usage and exit
    args, extra = parser.parse_known_args(list(argv))
    flags = sorted({s for action in parser._actions for s in action.option_strings})
    for arg in extra:
        if arg.startswith("-") and arg not in ("-", "--"):
            stripped = arg.lstrip("-")
            if "=" in stripped and stripped.split("=", 1)[0].replace(".", "").replace("_", "").isalnum():
                hint = f" (did you mean the override {stripped}, without dashes?)"
            else:
                close = difflib.get_close_matches(arg.split("=")[0], flags, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"unknown option {arg}{hint}; the options are -m/--multirun, --cfg job|hydra|all, --info, --help "
                "and the others attnres-run --hydra-help lists, and overrides are key=value"
            )
    loose = [arg for arg in extra if not arg.startswith("-") or arg in ("-", "--")]
    if loose:  # argparse reads the overrides as one group: `a=1 -m b=2` leaves b=2 over
        before = [a for a in argv[: list(argv).index(loose[0])] if a.startswith("-")]
        rest = list(argv)
        for arg in [*args.overrides, *loose]:
            rest.remove(arg)
        fixed = " ".join(shlex.quote(a) for a in ["attnres-run", *rest, *args.overrides, *loose])
        raise ConfigError(
            f"{loose[0]} comes after {before[-1] if before else 'an option'}, apart from the other overrides; "
            f"write the options first, then all the overrides: {fixed}"
        )
    commands = [name for name, on in (
        ("--run", args.run), ("-m/--multirun", args.multirun), ("--cfg", args.cfg is not None),
        ("--info", args.info is not None), ("--shell-completion", args.shell_completion),
    ) if on]
    if len(commands) > 1:
        raise ConfigError(f"{' and '.join(commands)} cannot be combined; pass only one of them")
    if args.resolve and args.cfg is None and not args.help:
        raise ConfigError("--resolve only works with --cfg (or --help); e.g. attnres-run --cfg job --resolve")
    return args


def check_missing_equals(overrides: Sequence[str]) -> None:
    """`attnres-run residual block` or `attnres-run seed`: an override without its `=`."""
    for i, arg in enumerate(overrides):
        if "=" in arg or arg.startswith("~"):
            continue
        following = list(overrides[i + 1:])
        if following[:1] == ["="] and len(following) > 1:
            fix = f"{arg}={following[1]}"
        elif following and "=" not in following[0]:
            fix = f"{arg}={following[0]}"
        else:
            fix = f"{arg}=<value>"
        raise ConfigError(f"'{arg}' has no '=' (an override is key=value); write {fix}")


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


def config_folder(args: Any, conf_dir: Path) -> Path:
    """The primary config folder: `--config-path` (relative to cli.py, as in Hydra) or conf/."""
    if args.config_path is None:
        return conf_dir
    path = Path(args.config_path)
    folder = path if path.is_absolute() else conf_dir.parent / path
    if not folder.is_dir():
        raise ConfigError(f"--config-path {args.config_path}: no folder {folder}; name a folder of configs")
    return folder


def check_sweeps(overrides: Sequence[Any], multirun: bool) -> None:
    """Sweep values only with `-m`, never over Hydra's own settings, never empty."""
    for o in overrides:
        if not o.is_sweep_override():
            continue
        key = o.get_key_element()
        if not multirun:
            if o.value_type.name == "SIMPLE_CHOICE_SWEEP":
                raise ConfigError(
                    f"{o.input_line} lists several values, which is a sweep; add -m to run one job per value "
                    f"(attnres-run -m ... {o.input_line}), write {key}=[...] for a list, or quote it for a string"
                )
            raise ConfigError(f"{o.input_line} is a sweep; add -m to run one job per value (attnres-run -m ...)")
        if o.is_hydra_override():
            raise ConfigError(f"{o.input_line}: a sweep cannot vary Hydra's own settings; give {key} one value")
        if o.value_type.name == "INTERVAL_SWEEP":
            raise ConfigError(
                f"{o.input_line}: the basic sweeper cannot enumerate an interval; list the values instead "
                f"(e.g. {key}=0.1,0.2,0.3) or use range(start,stop,step)"
            )
        if o.value_type.name != "GLOB_CHOICE_SWEEP" and not list(o.sweep_string_iterator()):
            example = f"{key}=range(0,3) (range's end is excluded)" if o.value_type.name == "RANGE_SWEEP" \
                else f"{key}=a,b"
            raise ConfigError(f"{o.input_line} sweeps over no values, so no job would run; give it at least one, "
                              f"e.g. {example}")


