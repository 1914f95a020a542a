"""Checks of the command line and of the composed config, before anything runs.

Every mistake a user can make on the command line gets one line naming the fix (a
`ConfigError`, printed by `run.user_errors` with exit status 2), and nothing is written.

`check_command_line(argv, conf_dir)` runs in `cli.main()` before Hydra does, in this order:

1. the shape of the command line: known options, one group of `key=value` overrides, each
   with its `=`, Hydra's override grammar, sweeps only with `-m`, no empty sweep;
2. every job's config, composed with Hydra's compose API exactly as Hydra will compose it
   (a sweep is expanded job by job, as Hydra's basic sweeper does): unknown keys and
   config options get a "did you mean";
3. every overridden value against the type of its default (`overwrite=no` is a string, not
   a boolean), then `validate_config`, the interpolations, the cheap parts built once (the
   data module, the residual strategy, the optimiser and the schedule) and the output folder.

`validate_config(cfg)` checks the values of one composed job config; `cli.train()` calls it
again at the start of every run, sweep jobs included.

Only Hydra and OmegaConf are imported at module level: torch and Lightning are imported by
the checks that need them, so that a command line that is wrong in its shape fails fast.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import itertools
import math
import os
import shlex
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.functional import KERNELS
from attnres.training import naming  # noqa: F401  (registers the resolver that hydra.run.dir uses)
from attnres.training.errors import ConfigError

GROUPS_CHECKED = ("residual", "model", "data", "trainer", "optim", "logger", "callbacks", "experiment", "debug")
#: a sweep larger than this has its first job per group combination checked in full, and every
#: value's type; smaller sweeps have every job checked
MAX_JOBS_CHECKED = 256
HYDRA_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
_ABSENT = object()


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
    with _hydra(conf):
        check_jobs(args.config_name or "config", overrides, multirun, running)


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


def parse_overrides(overrides: Sequence[str], config_loader: Any = None) -> list[Any]:
    """Hydra's `Override` objects; a grammar error is one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create(config_loader=config_loader).parse_overrides(list(overrides))
    except OverrideParseException as err:
        lines = [ln for ln in err.message.splitlines() if ln and not ln.startswith(("See ", "Error parsing"))]
        raise ConfigError(
            f"cannot read the override {err.override}: {lines[0] if lines else err.message}; "
            f"write key=value (quote a value with spaces or commas: key='a, b'), see {HYDRA_GRAMMAR}"
        ) from err


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


# == 2. every job's config ========================================================================
@contextlib.contextmanager
def _hydra(conf_dir: Path) -> Iterator[None]:
    """Hydra initialised on `conf_dir` for the compose API, and cleared again on the way out."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
            yield
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # Hydra sets it again for the real run


def _compose(config_name: str, overrides: Sequence[str]) -> DictConfig:
    from hydra import compose
    from hydra.errors import HydraException

    try:
        return compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise composition_error(err, config_name, overrides) from err


def _unknown_key(err: BaseException) -> str | None:
    """The key a failed composition did not know, if that is why it failed."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = err.__cause__
    return cause.full_key if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key else None


def _sets(override: str, key: str) -> bool:
    """Whether `override` (a command-line string) sets `key` or something inside it."""
    own = override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]
    return own == key or own.startswith(key + ".")


def check_jobs(config_name: str, overrides: list[Any], multirun: bool, running: bool) -> None:
    """Compose the config of every job the command line asks for, and check it."""
    from hydra.core.global_hydra import GlobalHydra

    hydra_overrides = [o.input_line for o in overrides if o.is_hydra_override()]
    task = [o for o in overrides if not o.is_hydra_override()]
    if multirun:
        sweeper = next((o for o in overrides if o.key_or_group == "hydra/sweeper"), None)
        if sweeper is not None and str(sweeper.value()) != "basic":
            _compose(config_name, [*hydra_overrides, *first_values(task)])
            return  # another sweeper draws its own jobs
        loader = GlobalHydra.instance().config_loader()
        jobs = expand_sweep(parse_overrides([o.input_line for o in task], config_loader=loader))
    else:
        jobs = [[o.input_line for o in task]]
    first = _compose(config_name, [*hydra_overrides, *jobs[0]])
    groups = set(first.hydra.runtime.choices)
    parsed: dict[str, Any] = {}

    def structural(line: str) -> bool:
        o = parsed.get(line) or parsed.setdefault(line, parse_overrides([line])[0])
        return o.package is not None or "/" in o.key_or_group or o.key_or_group in groups

    combos: dict[tuple[str, ...], dict[str, Any]] = {}
    checked_types: set[tuple[tuple[str, ...], str]] = set()
    for index, job in enumerate(jobs):
        shape = tuple(line for line in job if structural(line))
        values = [parsed[line] for line in job if not structural(line)]
        combo = combos.get(shape)
        if combo is None:  # a new combination of config options: compose it as Hydra will
            cfg = first if index == 0 else _compose(config_name, [*hydra_overrides, *job])
            combo = combos[shape] = {"cfg": cfg, "values": values, "reference": None, "typed": typed_keys(cfg)}
            if not running:
                continue
            if not all(o.key_or_group in combo["typed"] or o.is_delete() for o in values):
                combo["reference"] = _compose(config_name, [*hydra_overrides, *shape])  # the defaults
        if not running:
            continue
        for o in values:
            if (shape, o.input_line) not in checked_types and o.key_or_group not in combo["typed"]:
                checked_types.add((shape, o.input_line))
                check_override_type(o, combo["reference"])
        if "run_dir" not in combo:  # the first job with these options: everything
            combo["run_dir"] = check_job(combo["cfg"], multirun, check_folder=index == 0 or not multirun)
        elif index < MAX_JOBS_CHECKED:  # another job of a sweep: its values (a large sweep: their types only)
            check_values(combo, values)


def first_values(overrides: Sequence[Any]) -> list[str]:
    """Each override with the first value of its sweep."""
    lines = []
    for o in overrides:
        if o.is_sweep_override() and o.value_type.name != "GLOB_CHOICE_SWEEP":
            lines.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        elif not o.is_sweep_override():
            lines.append(o.input_line)
    return lines


def expand_sweep(overrides: Sequence[Any]) -> list[list[str]]:
    """The jobs of a sweep, as lists of overrides, in the order Hydra's basic sweeper runs them."""
    per_key: dict[str, list[str]] = {}
    for o in overrides:
        key = o.get_key_element()
        if o.is_sweep_override():
            per_key[key] = [f"{key}={value}" for value in o.sweep_string_iterator()]
            if not per_key[key]:
                raise ConfigError(f"{o.input_line} sweeps over no values, so no job would run; give it at least one")
        else:
            per_key[key] = [f"{key}={o.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*per_key.values())]


def composition_error(err: Exception, config_name: str, overrides: Sequence[str]) -> ConfigError:
    """One line for a failed composition: unknown keys and options get a "did you mean"."""
    from hydra.errors import MissingConfigException

    cause = err.__cause__
    text = str(err)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    if _unknown_key(err):
        return unknown_key_error(_unknown_key(err), config_name, overrides)
    if isinstance(err, MissingConfigException):
        return missing_config_error(err, config_name)
    if first.startswith("Could not append to config. An item is already at"):
        key = first.split("'")[1]
        return ConfigError(f"+{key} adds a key, but {key} already exists; drop the + to change it ({key}=...)")
    if first.startswith("Could not delete from config."):
        key = first.split("'")[1] if "'" in first else "that key"
        return ConfigError(f"~{key} deletes a key that does not exist; remove ~{key} from the command line")
    if "looks like a config group override" in text or "Did you mean to override" in text:
        return ConfigError(f"{' '.join(text.split())}".replace("\n", " "))
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    return ConfigError(f"{first}{': ' + detail if detail else ''}; fix the override on the command line")


def missing_config_error(err: Any, config_name: str) -> ConfigError:
    lines = [ln.strip() for ln in str(err).splitlines()]
    if lines and lines[0].startswith("Cannot find primary config"):
        return ConfigError(f"--config-name {config_name}: there is no {config_name}.yaml in the config folder; "
                           "name a config that exists (the default is config)")
    missing = err.missing_cfg_file or ""
    if "Could not find '" in lines[0]:
        missing = lines[0].split("Could not find '", 1)[1].rstrip("'")
    group, _, name = missing.rpartition("/")
    options = list(err.options or [])
    if not options and "Available options in" in str(err):
        start = next(i for i, ln in enumerate(lines) if ln.startswith("Available options in"))
        for ln in lines[start + 1:]:
            if not ln or ln.startswith("Config search path"):
                break
            options.append(ln)
    if not group:
        return ConfigError(f"{lines[0]}; check the config option names on the command line")
    hint = difflib.get_close_matches(name, options, n=1)
    maybe = f" (did you mean {hint[0]}?)" if hint else ""
    return ConfigError(f"unknown {group} '{name}'{maybe}; choose one of: {', '.join(sorted(options)) or '(none)'}")


def unknown_key_error(key: str, config_name: str, overrides: Sequence[str]) -> ConfigError:
    """`unknown key model.n_layers (did you mean model.n_layer?); ...`, the suggestion drawn
    from the keys of the config composed without the value overrides."""
    from hydra import compose
    from hydra.errors import HydraException

    cfg, attempt, failed = None, list(overrides), key
    for _ in range(8):  # without the override that failed, and any other unknown key
        attempt = [o for o in attempt if not _sets(o, failed)]
        try:
            cfg = compose(config_name, overrides=attempt, return_hydra_config=True)
            break
        except (HydraException, OmegaConfBaseException) as err:
            failed = _unknown_key(err) or ""
            if not failed:
                break
    keys = all_keys(cfg, with_hydra=key.startswith("hydra")) if cfg is not None else {}
    choices = dict(cfg.hydra.runtime.choices) if cfg is not None else {}
    candidates = [*keys, *(group for group in choices if group not in keys)]
    sources = [k for k in candidates if not keys.get(k)]  # not `${...}` copies of other keys
    hint = suggest(key, candidates, sources)
    head, _, leaf = key.partition(".")
    if hint:
        return ConfigError(f"unknown key {key} (did you mean {' or '.join(hint)}?); fix the spelling "
                           "(attnres-run --cfg job lists the keys)")
    if leaf and choices.get(head):
        return ConfigError(f"unknown key {key}: {head}={choices[head]} has no key {leaf}; drop it, or choose a "
                           f"{head} option that has it (attnres-run --cfg job lists the keys; +{key}=... adds it)")
    return ConfigError(f"unknown key {key}; fix the spelling (attnres-run --cfg job lists the keys; "
                       f"+{key}=... adds a new key)")


def all_keys(cfg: DictConfig, with_hydra: bool = False) -> dict[str, bool]:
    """Every dotted key of `cfg`, and whether its value is an interpolation (`${...}`)."""
    out: dict[str, bool] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                name = f"{prefix}{k}"
                out[name] = isinstance(v, str) and "${" in v
                walk(v, name + ".")

    container = OmegaConf.to_container(cfg, resolve=False)
    if not with_hydra:
        container.pop("hydra", None)  # type: ignore[union-attr]
    walk(container, "")
    return out


def suggest(key: str, candidates: Sequence[str], sources: Sequence[str] | None = None) -> list[str]:
    """The keys the user most likely meant: the same last part elsewhere (`lr` ->
    `optim.optimizer.lr`), else a close spelling of the whole key (`model.n_layers`), else a
    close spelling of the last part. The first and last look only at `sources` (keys that
    are not `${...}` copies of others), if given."""
    sources = list(candidates if sources is None else sources)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [c for c in sources if c.rsplit(".", 1)[-1] == leaf and c != key]
    if same_leaf:
        return same_leaf[:3]
    whole = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
    if whole:
        return whole
    leaves = {c.rsplit(".", 1)[-1]: c for c in reversed(sources)}
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8)
    return [leaves[close[0]]] if close else []


# == 3. the values ================================================================================
#: the top-level keys that what `check_parts` builds depends on
PARTS = ("data", "residual", "model", "optim", "num_blocks", "trainer")


def check_values(combo: dict[str, Any], values: Sequence[Any]) -> None:
    """Another job of a sweep: the config of the combination's first job, with this job's values
    set (and set back afterwards: a copy per job would cost more than the checks)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    cfg = combo["cfg"]
    if "job" not in combo:  # the first job's config without its hydra node, to set values in
        user = OmegaConf.to_container(cfg, resolve=False)
        user.pop("hydra", None)  # type: ignore[union-attr]
        combo["job"] = OmegaConf.create(user)
        OmegaConf.set_struct(combo["job"], True)
        combo["first"] = {o.key_or_group: o for o in combo["values"]}
    job, first = combo["job"], combo["first"]
    changed = [o for o in values if o.input_line not in {f.input_line for f in first.values()}]
    if not all(o.type.name == "CHANGE" and o.key_or_group in first for o in changed):  # +, ~: a config of its own
        job = OmegaConf.create(OmegaConf.to_container(job, resolve=False))
        OmegaConf.set_struct(job, True)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(changed, job)
    except Exception as err:  # the same failure that composing this job would have
        raise ConfigError(f"{' '.join(str(err).split())}; fix the override on the command line") from err
    try:
        validate_config(job)
        rebuilt = any(o.key_or_group.split(".", 1)[0] in PARTS for o in changed)  # what check_parts builds or reads
        relinked = any(o.is_delete() or "${" in str(o.get_value_element_as_str()) for o in changed)
        if rebuilt or relinked:
            with hydra_config(cfg, combo["run_dir"]):
                if relinked:
                    resolve_job(job)
                if rebuilt:
                    check_parts(job)
    finally:
        if job is combo["job"]:
            ConfigLoaderImpl._apply_overrides_to_config([first[o.key_or_group] for o in changed], job)


#: bool keys that also take these values (Lightning's own)
BOOL_ALSO = {"trainer.deterministic": ("warn",), "callbacks.checkpoint.save_last": ("link",)}
#: int keys that also take other types
INT_ALSO: dict[str, tuple[type, ...]] = {
    "trainer.overfit_batches": (float,), "trainer.limit_train_batches": (float,), "trainer.limit_val_batches": (float,),
}


def check_override_type(override: Any, reference: DictConfig | None) -> None:
    """An overridden value must have the type of the key's default in `reference` (the config
    composed with the same options but without the value overrides): true/false for a bool,
    a number for a number, a config for a config. (Keys `validate_config` types itself are
    left to it: then no reference is composed.)"""
    key = override.key_or_group
    if override.is_delete() or reference is None or override.is_hydra_override():
        return
    try:
        value = override.value()
        default = OmegaConf.select(reference, key, default=_ABSENT)
    except OmegaConfBaseException:
        return  # an interpolation in the default: resolution is checked later
    if default is _ABSENT or default is None or (isinstance(value, str) and "${" in value):
        return  # a new key (+key=...), a key without a typed default, or an interpolation
    shown = override.input_line.lstrip("+")
    if isinstance(default, bool):
        if not isinstance(value, bool) and value not in BOOL_ALSO.get(key, ()):
            also = "".join(f" or {key}={v}" for v in BOOL_ALSO.get(key, ()))
            raise ConfigError(f"{shown} is not a boolean; write {key}=true or {key}=false{also}")
    elif isinstance(default, int):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, *INT_ALSO.get(key, ())))):
            raise ConfigError(f"{shown} is not an integer; write a whole number, e.g. {key}={default}")
    elif isinstance(default, float):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{shown} is not a number; write e.g. {key}={default}")
    elif isinstance(default, DictConfig) and value is not None and not isinstance(value, dict):
        raise ConfigError(f"{shown}: {key} is a group of settings, not a single value; set one of its keys "
                          f"({key}.<key>=...) or choose a config option")
    elif isinstance(default, ListConfig) and value is not None and not isinstance(value, list):
        raise ConfigError(f"{shown} is not a list; write {key}=[...], e.g. {key}={list(default)}".replace("'", ""))


def check_job(cfg: DictConfig, multirun: bool, check_folder: bool = True) -> Path:
    """All checks of one composed job config (with its `hydra` node), before it runs; the run folder."""
    validate_config(cfg)
    run_dir = output_folder(cfg, multirun, check_parent=check_folder)
    with hydra_config(cfg, run_dir):
        resolve_job(cfg)
        check_parts(cfg)
    return run_dir


def output_folder(cfg: DictConfig, multirun: bool, check_parent: bool = True) -> Path:
    """The run folder Hydra will create for this job, checked to be creatable."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    fix = (f"choose another place with {key}=<folder>" +
           (", or another experiment name with name=<name>" if "${name}" in str(_raw(cfg, key)) else ""))
    try:
        folder = Path(str(OmegaConf.select(cfg, key, throw_on_missing=True)))
        run_dir = folder / str(cfg.hydra.sweep.subdir) if multirun else folder
    except OmegaConfBaseException as err:
        raise ConfigError(f"{key}={_raw(cfg, key)} cannot be resolved ({err.msg.splitlines()[0]}); {fix}") from err
    if check_parent:
        check_creatable(folder, f"the {'sweep' if multirun else 'run'} folder", fix)
    return run_dir


def _raw(cfg: DictConfig, key: str) -> Any:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return node._get_node(leaf)._value() if isinstance(node, DictConfig) and leaf in node else None


def check_creatable(folder: Path, what: str, fix: str) -> None:
    """`folder` exists as a writable folder or can be made: probed with a temporary folder in
    its nearest existing ancestor, removed at once (a root user passes permission bits)."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"cannot create {what} {folder}: {existing} is a file, not a folder; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".attnres-probe-", dir=existing))
    except OSError as err:
        raise ConfigError(f"cannot create {what} {folder}: {existing} does not take new folders "
                          f"({err.strerror}); {fix}") from err


@contextlib.contextmanager
def hydra_config(cfg: DictConfig, run_dir: Path) -> Iterator[None]:
    """`${hydra:...}` resolvable while checking `cfg`, as in the job (with its output folder)."""
    from hydra.core.hydra_config import HydraConfig

    OmegaConf.set_readonly(cfg.hydra, False)
    cfg.hydra.runtime.output_dir = str(run_dir.absolute())
    HydraConfig.instance().set_config(cfg)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = None
        OmegaConf.set_readonly(cfg.hydra, False)


def resolve_job(cfg: DictConfig) -> None:
    """Every interpolation of the job config resolves (`~model.n_layer` breaks `${model.n_layer}`)."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        for key in cfg:
            if key != "hydra":
                node = cfg._get_node(key)
                if isinstance(node, (DictConfig, ListConfig)):
                    OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
                else:
                    cfg[key]
    except MissingMandatoryValue:
        raise  # user_errors says which key needs a value
    except OmegaConfBaseException as err:
        where = err.full_key or "a key"
        raise ConfigError(f"{where}: {err.msg.splitlines()[0]}; fix or remove that ${{...}} reference, "
                          "or keep the key it points to") from err


def check_parts(cfg: DictConfig) -> None:
    """Build the cheap parts once, with their own checks: attnres's data module (not a text
    corpus folder, which would be walked twice), the residual strategy, the optimiser on a
    dummy parameter and the schedule at step 0. Their errors become one line."""
    from hydra.utils import instantiate

    cache = _get(cfg, "data.cache_dir")
    if isinstance(cache, str) and cache and _target(cfg, "data").startswith("attnres.training.data."):
        check_creatable(Path(cache).expanduser(), "the data cache folder",
                        "set data.cache_dir=<a writable folder>, or data.cache_dir=null for ~/.cache/attnres")
    data_target = str(OmegaConf.select(cfg, "data._target_", default=""))
    path = OmegaConf.select(cfg, "data.path", default=None)
    if data_target.startswith("attnres.training.data.") and not (path and os.path.isdir(str(path))):
        _build("data", lambda: instantiate(cfg.data))
    if str(OmegaConf.select(cfg, "residual._target_", default="")).startswith("attnres.") and \
            isinstance(_get(cfg, "model.n_embd"), int) and isinstance(_get(cfg, "model.n_layer"), int):
        _build("residual", lambda: instantiate(cfg.residual)(d_model=cfg.model.n_embd,
                                                             num_layers=2 * cfg.model.n_layer))
    if str(OmegaConf.select(cfg, "optim.optimizer._target_", default="")).startswith("torch.optim."):
        import torch

        _build("optim.optimizer", lambda: instantiate(cfg.optim.optimizer)([torch.nn.Parameter(torch.zeros(1))]))
    steps = _get(cfg, "optim.total_steps") or _get(cfg, "trainer.max_steps")
    schedule = OmegaConf.select(cfg, "optim.schedule")
    if isinstance(steps, int) and steps >= 1 and str(OmegaConf.select(cfg, "optim.schedule._target_", default="")) \
            .startswith("attnres.training.schedules.") and schedule is not None:
        _build("optim.schedule", lambda: instantiate(schedule)(0, total_steps=steps))


def _build(what: str, build: Callable[[], Any]) -> None:
    from hydra.errors import InstantiationException

    try:
        build()
    except ConfigError:
        raise
    except InstantiationException as err:
        cause = err
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise ConfigError(str(cause)) from err
        raise ConfigError(f"{what}: {' '.join(str(cause).split())}; fix its settings on the command line") from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{what}: {' '.join(str(err).split())}; fix its settings on the command line") from err


# == validate_config: the values of one job =========================================================
def _get(cfg: DictConfig, key: str) -> Any:
    """The resolved value at `key`, or _ABSENT; a broken interpolation is one line."""
    try:
        return OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{key}: {err.msg.splitlines()[0]}; fix that ${{...}} reference") from err


def _target(cfg: DictConfig, section: str) -> str:
    value = _get(cfg, f"{section}._target_")
    return value if isinstance(value, str) else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Rule:
    """One key's type and range; `problem(value)` says what is wrong with a value, or None."""

    def __init__(self, kind: str, low: float | None = None, high: float | None = None, *, open_low: bool = False,
                 open_high: bool = False, choices: Sequence[Any] = (), also: Sequence[Any] = (),
                 nullable: bool = False, example: Any = None, hint: str = "") -> None:
        self.kind, self.low, self.high, self.open_low, self.open_high = kind, low, high, open_low, open_high
        self.choices, self.also, self.nullable, self.example = tuple(choices), tuple(also), nullable, example
        self.hint = hint

    def problem(self, value: Any) -> str | None:
        if value is None and self.nullable or any(type(value) is type(v) and value == v for v in self.also):
            return None
        if self.kind == "bool":
            return None if isinstance(value, bool) else "is not a boolean"
        if self.kind == "choice":
            return None if value in self.choices else "is not one of the choices"
        if not (_is_int(value) if self.kind == "int" else _is_number(value)):
            return "is not an integer" if self.kind == "int" else "is not a number"
        below = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        above = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        return "is out of range" if below or above else None

    def wanted(self, key: str) -> str:
        if self.hint:
            return self.hint.format(key=key)
        also = "".join(f" or {key}={_show(v)}" for v in self.also)
        if self.kind == "bool":
            return f"write {key}=true or {key}=false{also}"
        if self.kind == "choice":
            return f"choose one of: {', '.join(map(str, self.choices))}"
        noun = "an integer" if self.kind == "int" else "a number"
        lo = None if self.low is None else f"{'>' if self.open_low else '>='} {_number(self.low)}"
        hi = None if self.high is None else f"{'<' if self.open_high else '<='} {_number(self.high)}"
        bound = " and ".join(b for b in (lo, hi) if b)
        extra = "".join(f" (or {_show(v)})" for v in self.also if not isinstance(v, bool))
        extra += " (or null)" if self.nullable else ""
        example = f", e.g. {key}={self.example}" if self.example is not None else ""
        return f"set {key} to {noun}{' ' + bound if bound else ''}{extra}{example}"


BOOL = Rule("bool")
TRAINERS = ("pytorch_lightning.Trainer", "pytorch_lightning.trainer.trainer.Trainer", "lightning.pytorch.Trainer",
            "lightning.Trainer")
#: (section whose _target_ must start with one of these, or "" for the top level) -> {key: rule}
RULES: dict[tuple[str, tuple[str, ...]], dict[str, Rule]] = {
    ("", ()): {
        "seed": Rule("int", 0, 2**32 - 1, example=0),
        "num_blocks": Rule("int", 1, example=4),
        "compile": BOOL, "resume": BOOL, "overwrite": BOOL, "keep_freed_memory": BOOL,
        "mode": Rule("choice", choices=("train", "eval", "sample")),
    },
    ("sample", ()): {
        "max_new_tokens": Rule("int", 1, example=200), "temperature": Rule("number", 0, example=0.8),
        "top_k": Rule("int", 1, nullable=True, example=50), "num_samples": Rule("int", 1, example=1),
    },
    ("model", ("attnres.Transformer",)): {
        "n_layer": Rule("int", 1, example=8), "n_head": Rule("int", 1, example=4),
        "n_embd": Rule("int", 1, example=96), "block_size": Rule("int", 1, example=128),
        "dropout": Rule("number", 0, 1, open_high=True, example=0.0), "bias": BOOL, "tie_embeddings": BOOL,
        "mlp": Rule("choice", choices=("gelu", "swiglu")), "norm_eps": Rule("number", 0, open_low=True, example=1e-6),
        "init_std": Rule("number", 0, open_low=True, example=0.02),
    },
    ("residual", ("attnres.",)): {
        "eps": Rule("number", 0, open_low=True, example=1e-6), "key_norm_gain": BOOL, "output_aggregation": BOOL,
        "kernel": Rule("choice", choices=KERNELS),
    },
    ("data", ("attnres.training.data.",)): {
        "block_size": Rule("int", 1, example=128), "batch_size": Rule("int", 1, example=16),
        "num_workers": Rule("int", 0, example=0), "val_batches": Rule("int", 1, example=16),
        "val_fraction": Rule("number", 0, 1, open_low=True, open_high=True, example=0.05),
        "max_files": Rule("int", 1, nullable=True, example=100), "num_symbols": Rule("int", 2, example=8),
        "num_hops": Rule("int", 1, example=2), "num_pairs": Rule("int", 2, nullable=True, example=8),
        "num_queries": Rule("int", 1, nullable=True, example=8),
        "val_tokens": Rule("int", 1, nullable=True, example=1048576),
        "vocab_size": Rule("int", 1, nullable=True, example=50257),
        "tokens_per_step": Rule("int", 1, nullable=True, example=524288),
        "dtype": Rule("choice", choices=("uint16", "uint32"), nullable=True),
    },
    ("trainer", TRAINERS): {
        "max_steps": Rule("int", 1, also=(-1,), example=1500),
        "val_check_interval": Rule("int", 1, example=250),
        "accumulate_grad_batches": Rule("int", 1, example=1),
        "log_every_n_steps": Rule("int", 0, example=10),
        "num_sanity_val_steps": Rule("int", -1, example=0),
        "gradient_clip_val": Rule("number", 0, nullable=True, example=1.0),
        "enable_progress_bar": BOOL, "enable_model_summary": BOOL,
        "deterministic": Rule("bool", also=("warn",)),
        "fast_dev_run": Rule("int", 0, also=(True, False),
                             hint="write {key}=true, {key}=false or a number of batches (e.g. {key}=2)"),
    },
    ("optim.optimizer", ("torch.optim.",)): {
        "lr": Rule("number", 0, example=3e-3), "weight_decay": Rule("number", 0, example=0.1),
        "eps": Rule("number", 0, example=1e-8), "momentum": Rule("number", 0, example=0.9),
    },
    ("optim.schedule", ("attnres.training.schedules.",)): {
        "warmup_steps": Rule("int", 0, example=100), "min_lr_ratio": Rule("number", 0, 1, example=0.1),
        "decay_fraction": Rule("number", 0, 1, example=0.2),
    },
    ("optim", ()): {
        "query_lr_scale": Rule("number", 0, example=0.1), "total_steps": Rule("int", 1, nullable=True, example=1500),
    },
    ("callbacks.depth_dashboard", ("attnres.training.callbacks.",)): {
        "every_n_steps": Rule("int", 1, example=100), "probe_size": Rule("int", 1, example=8), "histograms": BOOL,
    },
    ("callbacks.checkpoint", ("pytorch_lightning.callbacks.", "lightning.pytorch.callbacks.")): {
        "save_last": Rule("bool", also=("link",)), "save_top_k": Rule("int", -1, example=1),
        "auto_insert_metric_name": BOOL, "enable_version_counter": BOOL,
    },
    ("callbacks.progress_bar", ("attnres.training.run.",)): {"refresh_rate": Rule("int", 0, example=10)},
    ("logger.tensorboard", ("pytorch_lightning.loggers.", "lightning.pytorch.loggers.",
                            "attnres.training.callbacks.")): {"default_hp_metric": BOOL},
}


def _active_rules(cfg: DictConfig) -> Iterator[tuple[str, Rule]]:
    for (section, targets), rules in RULES.items():
        if section and _get(cfg, section) is _ABSENT:
            continue
        if targets and not _target(cfg, section).startswith(targets):
            continue
        for key, rule in rules.items():
            yield (f"{section}.{key}" if section else key), rule


def typed_keys(cfg: DictConfig) -> set[str]:
    """The keys whose type `validate_config` checks in this config."""
    return {key for key, _ in _active_rules(cfg)} | {
        "name", "ckpt_path", "trainer.precision", "trainer.accelerator", "trainer.devices", "trainer.strategy",
        "optim.optimizer.betas",
    }


def validate_config(cfg: DictConfig) -> None:
    """Values of the composed config (one job's), checked before anything is built or written.

    Works on a job config with or without its `hydra` node, resolved or not. Sections whose
    `_target_` was swapped for another class are left to that class.
    """
    blocks = _get(cfg, "residual.num_blocks") is not _ABSENT and _target(cfg, "residual").startswith("attnres.")
    for key, rule in _active_rules(cfg):
        if key == "num_blocks" and blocks:
            continue  # check_residual names the values that divide the sublayers
        value = _get(cfg, key)
        if value is not _ABSENT and rule.problem(value) is not None:
            raise ConfigError(f"{key}={_show(value)} {rule.problem(value)}; {rule.wanted(key)}")
    check_top_level(cfg)
    if _target(cfg, "model") == "attnres.Transformer":
        check_model(cfg)
    if _target(cfg, "residual").startswith("attnres."):
        check_residual(cfg)
    if _target(cfg, "trainer") in TRAINERS:
        check_trainer(cfg)
    if _target(cfg, "optim.optimizer").startswith("torch.optim."):
        betas = _get(cfg, "optim.optimizer.betas")
        if betas is not _ABSENT and not (isinstance(betas, (list, ListConfig)) and len(betas) == 2 and
                                         all(_is_number(b) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"optim.optimizer.betas={_show(betas)} must be two numbers in [0, 1); "
                              "e.g. optim.optimizer.betas=[0.9,0.95]")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return "''" if value == "" else str(value).replace("'", "").replace(" ", "")


def check_top_level(cfg: DictConfig) -> None:
    name = _get(cfg, "name")
    if name is not _ABSENT:
        parts = str(name).split("/")
        if name is None or not str(name).strip() or str(name).startswith("/") or ".." in parts or "." in parts:
            raise ConfigError(f"name={_show(name)} is not a folder name; "
                              "set name=<experiment name>, e.g. name=baseline (no '..', not absolute)")
    ckpt = _get(cfg, "ckpt_path")
    if ckpt not in (_ABSENT, None) and not Path(str(ckpt)).expanduser().is_file():
        raise ConfigError(f"ckpt_path={ckpt} is not a file; pass the path of a .ckpt written by attnres-run")
    if _get(cfg, "resume") is True and _get(cfg, "overwrite") is True:
        raise ConfigError("resume=true and overwrite=true contradict each other; pass only one of them")


def check_model(cfg: DictConfig) -> None:
    n_embd, n_head = _get(cfg, "model.n_embd"), _get(cfg, "model.n_head")
    if _is_int(n_embd) and _is_int(n_head) and (n_embd % n_head or (n_embd // n_head) % 2):
        good = math.ceil(n_embd / (2 * n_head)) * 2 * n_head
        raise ConfigError(
            f"model.n_embd={n_embd} must split into model.n_head={n_head} heads of an even size "
            f"(a multiple of 2 * n_head = {2 * n_head}); set e.g. model.n_embd={good}"
        )


def check_residual(cfg: DictConfig) -> None:
    blocks, n_layer = _get(cfg, "residual.num_blocks"), _get(cfg, "model.n_layer")
    sizes = _get(cfg, "residual.block_sizes")
    if sizes not in (_ABSENT, None) and _is_int(n_layer) and n_layer >= 1:
        layers = 2 * n_layer
        listed = list(sizes) if isinstance(sizes, (list, tuple, ListConfig)) else None
        if not listed or not all(_is_int(n) and n >= 1 for n in listed) or sum(listed) != layers:
            raise ConfigError(f"residual.block_sizes={_show(sizes)} must be positive integers summing to the {layers} "
                              f"sublayers (2 per transformer layer); e.g. residual.block_sizes=[{layers - 1},1]")
        if _is_int(blocks) and blocks != len(listed):
            raise ConfigError(f"num_blocks={blocks} disagrees with residual.block_sizes, which lists {len(listed)} "
                              f"blocks; set num_blocks={len(listed)}")
        return _check_kernel(cfg)
    if blocks is not _ABSENT and _is_int(n_layer) and n_layer >= 1:
        layers = 2 * n_layer
        valid = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
        if not _is_int(blocks):
            raise ConfigError(f"num_blocks={_show(blocks)} is not an integer; set num_blocks to one that divides the "
                              f"{layers} sublayers (2 per transformer layer): {valid}")
        if blocks < 1 or layers % blocks:
            raise ConfigError(f"num_blocks={blocks} must divide the {layers} sublayers (2 per transformer layer), "
                              f"or give unequal blocks with residual.block_sizes=[...]; valid values: {valid}")
    _check_kernel(cfg)


def _check_kernel(cfg: DictConfig) -> None:
    if _get(cfg, "residual.kernel") == "triton":
        fix = "use residual.kernel=auto (Triton on CUDA, fused PyTorch elsewhere) or residual.kernel=torch"
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(f"residual.kernel=triton needs the triton package (pip install 'attnres[triton]'); "
                              f"{fix}")
        if os.environ.get("TRITON_INTERPRET") != "1":
            if not _cuda_available():
                raise ConfigError(f"residual.kernel=triton needs a CUDA GPU and none is visible; {fix}")
            if _get(cfg, "trainer.accelerator") == "cpu":
                raise ConfigError(f"residual.kernel=triton needs the model on a GPU, but trainer.accelerator=cpu; "
                                  f"{fix}, or set trainer.accelerator=gpu")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _precisions() -> list[str]:
    try:
        import typing

        from lightning_fabric.connector import _PRECISION_INPUT_INT, _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

        names = [*typing.get_args(_PRECISION_INPUT_STR), *typing.get_args(_PRECISION_INPUT_STR_ALIAS)]
        return ["auto", *names, *map(str, typing.get_args(_PRECISION_INPUT_INT))]
    except ImportError:  # another Lightning: its own check will do
        return []


def check_trainer(cfg: DictConfig) -> None:
    max_steps = _get(cfg, "trainer.max_steps")
    if max_steps == -1 and _get(cfg, "optim.total_steps") in (None, _ABSENT):
        raise ConfigError("trainer.max_steps=-1 (no limit) leaves the learning-rate schedule without a length; "
                          "set trainer.max_steps to a number of steps, or optim.total_steps=<steps>")
    precision = _get(cfg, "trainer.precision")
    allowed = _precisions()
    if precision is not _ABSENT and allowed and str(precision) not in allowed:
        raise ConfigError(f"trainer.precision={precision} is not a precision; choose one of: auto, 32-true, "
                          f"bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true")
    accelerator = _get(cfg, "trainer.accelerator")
    gpu = accelerator in ("gpu", "cuda") or accelerator == "auto" and _cuda_available()
    if accelerator is not _ABSENT and not isinstance(accelerator, str):
        raise ConfigError(f"trainer.accelerator={_show(accelerator)} is not an accelerator; "
                          "use trainer.accelerator=auto, cpu or gpu")
    if isinstance(accelerator, str) and accelerator not in ("auto", "cpu"):
        from pytorch_lightning.accelerators import AcceleratorRegistry

        names = sorted(AcceleratorRegistry.available_accelerators())
        if accelerator not in ("gpu", *names):
            raise ConfigError(f"trainer.accelerator={accelerator} is not an accelerator; "
                              f"use trainer.accelerator=auto, cpu or gpu ({', '.join(['auto', 'gpu', *names])})")
        if accelerator in ("gpu", "cuda"):
            usable = _cuda_available() or accelerator == "gpu" and AcceleratorRegistry["mps"]["accelerator"] \
                .is_available()
        else:
            try:
                usable = AcceleratorRegistry[accelerator]["accelerator"].is_available()
            except Exception:  # an accelerator whose library is missing (tpu without torch_xla)
                usable = False
        if not usable:
            raise ConfigError(f"trainer.accelerator={accelerator} but no {accelerator.upper()} is available on this "
                              "machine; use trainer.accelerator=cpu or trainer.accelerator=auto (or trainer=cpu)")
    devices = _get(cfg, "trainer.devices")
    if devices is not _ABSENT:
        check_devices(devices, gpu)
    strategy = _get(cfg, "trainer.strategy")
    if isinstance(strategy, str) and strategy != "auto":
        from pytorch_lightning.strategies import StrategyRegistry

        names = StrategyRegistry.available_strategies()
        if strategy not in names:
            close = difflib.get_close_matches(strategy, names, n=1)
            maybe = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"trainer.strategy={strategy} is not a strategy{maybe}; use trainer=ddp or trainer=fsdp, "
                              "or trainer.strategy=auto")
        if strategy.startswith(("fsdp", "deepspeed")) and not gpu:
            raise ConfigError(f"trainer.strategy={strategy} needs GPUs and this run is on the CPU; "
                              "use trainer=ddp (gloo on the CPU) or trainer=auto")


def check_devices(devices: Any, gpu: bool) -> None:
    fix = "set trainer.devices to a number of devices >= 1, or trainer.devices=auto"
    if devices == "auto":
        return
    if isinstance(devices, (list, ListConfig)):
        if gpu and devices and all(_is_int(d) and d >= 0 for d in devices):
            return
        raise ConfigError(f"trainer.devices={_show(devices)} is not a list of GPU indices; {fix}")
    text = str(devices).strip()
    if isinstance(devices, str) and gpu and text and all(part.strip().isdigit() for part in text.split(",")):
        return  # "0,1": GPU indices
    try:
        count = int(text) if not isinstance(devices, (bool, float)) else None
    except ValueError:
        count = None
    if count is None or count < 1 and not (gpu and count == -1):
        raise ConfigError(f"trainer.devices={_show(devices)} is invalid; {fix}")
    if gpu and count > 0:
        import torch

        have = torch.cuda.device_count()
        if have and count > have:
            raise ConfigError(f"trainer.devices={count} but this machine has {have} GPU(s); "
                              f"set trainer.devices={have} or fewer (or trainer.devices=auto)")
