"""Every job's config, composed with Hydra's compose API exactly as Hydra will compose it (a
sweep is expanded job by job, as Hydra's basic sweeper does): unknown keys and config options
get a "did you mean".
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.config import naming  # noqa: F401  (registers the resolver that hydra.run.dir uses)
from attnres.config.errors import ConfigError
from attnres.config.job import check_job, check_override_type, check_values
from attnres.config.rules import typed_keys

#: a sweep larger than this has its first job per group combination checked in full, and every
#: value's type; smaller sweeps have every job checked
MAX_JOBS_CHECKED = 256
HYDRA_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


# == 2. every job's config ========================================================================
@contextlib.contextmanager
def hydra_on(conf_dir: Path) -> Iterator[None]:
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
    if not multirun and running:
        tune = first.hydra.runtime.choices.get("tune")
        if tune:
            raise ConfigError(f"tune={tune} tunes the arms of a sweep and a single run has none; add -m "
                              f"(attnres-run -m tune={tune} residual=standard,block seed=0,1,2), or leave tune= out")
        note_builtin_sweep(first, jobs[0])
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


def note_builtin_sweep(cfg: DictConfig, given: Sequence[str]) -> None:
    """A single run of a config whose sweep is built in (`hydra.sweeper.params`: experiment=paper_*)
    says, on stderr, that it trains one job of that sweep and that -m runs them all; nothing when
    the command line picks every swept key itself."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    open_keys = [str(k) for k in params if not any(_sets(line, str(k)) for line in given)]
    if not open_keys:
        return
    counts = [len(str(params[k]).split(",")) for k in params]
    jobs = 1
    for count in counts:
        jobs *= count
    chosen = ", ".join(f"{k}={cfg.hydra.runtime.choices.get(k) or OmegaConf.select(cfg, k, default='?')}"
                       for k in open_keys)
    experiment = cfg.hydra.runtime.choices.get("experiment")
    what = f"experiment={experiment}" if experiment else "this config"
    print(f"attnres-run: note: {what} is a sweep of {jobs} jobs over {', '.join(map(str, params))}; without -m this "
          f"trains one of them ({chosen}); add -m to run them all, or set {open_keys[0]}=... to pick one",
          file=sys.stderr, flush=True)


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
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8) or [
        c for c in leaves if _swapped(leaf, c)][:1]  # `szie`: two letters swapped scores only 0.75
    return [leaves[close[0]]] if close else []


def _swapped(typed: str, key: str) -> bool:
    """Whether `typed` is `key` with two neighbouring letters swapped."""
    diff = [i for i, (a, b) in enumerate(zip(typed, key, strict=False)) if a != b]
    return (len(typed) == len(key) and len(diff) == 2 and diff[1] == diff[0] + 1
            and typed[diff[0]] == key[diff[1]] and typed[diff[1]] == key[diff[0]])


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
