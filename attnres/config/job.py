"""One composed job: each overridden value against the type of its default (`overwrite=no` is
a string, not a boolean), its output folder, its interpolations, and the cheap parts (the data
module, the residual strategy, the optimiser and the schedule) built once.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.config import naming, selectors  # noqa: F401  (naming registers the resolver hydra.run.dir uses)
from attnres.config.computation import computation, differences, recorded_computation, refuse_other_computation
from attnres.config.errors import ConfigError
from attnres.config.rules import ABSENT, target_of, validate_config, value_at

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
        default = OmegaConf.select(reference, key, default=ABSENT)
    except OmegaConfBaseException:
        return  # an interpolation in the default: resolution is checked later
    if default is ABSENT or default is None or (isinstance(value, str) and "${" in value):
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
    check_added_keys(cfg)
    with hydra_config(cfg, run_dir):
        resolve_job(cfg)
        check_parts(cfg)
        check_continued_computation(cfg, run_dir)
    return run_dir


#: sections a `+key=value` may add to whatever their keys are: Hydra's own, and the lists of parts
OPEN_SECTIONS = ("hydra", "callbacks", "logger")


def check_added_keys(cfg: DictConfig) -> None:
    """A key added with `+key=value` must be read by something: a part built from a `_target_`
    (which gets it as an argument), an open section, or a `${...}` of another value. Anything
    else (`+foo=bar`, `+sample.tempreature=0`) would be carried along and silently ignored."""
    choices = value_at(cfg, "hydra.runtime.choices")
    texts = None
    for override in value_at(cfg, "hydra.overrides.task") or []:
        text = str(override)
        if not text.startswith("+") or text.startswith("++"):
            continue
        key = text[1:].split("=", 1)[0]
        parts = key.split(".")
        if "@" in key or parts[0] in OPEN_SECTIONS or (isinstance(choices, DictConfig) and key in choices):
            continue  # a config group, or a section whose entries are read whole
        if any(isinstance(value_at(cfg, ".".join(parts[:i] + ["_target_"])), str) for i in range(1, len(parts))):
            continue  # an argument of something instantiated: a wrong one fails there, by name
        if texts is None:
            texts = [v for v in _strings(OmegaConf.to_container(cfg, resolve=False)) if "${" in v]
        if any(re.search(r"\$\{[^}]*\b" + re.escape(parts[0]) + r"\b", v) for v in texts):
            continue  # read by an interpolation (e.g. +ablation={...} with residual.query=${ablation.query})
        known = [k for k in _keys(OmegaConf.to_container(cfg, resolve=False), "") if k != key]
        hint = difflib.get_close_matches(key, known, n=1)
        meant = f" (did you mean {hint[0]}?)" if hint else " (a typo?)"
        raise ConfigError(f"{text}: nothing reads {key}{meant}; drop it, or set a key that exists "
                          "(attnres-run --cfg job lists them)")


def _keys(node: Any, prefix: str) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k != "hydra":
                yield f"{prefix}{k}"
                yield from _keys(v, f"{prefix}{k}.")


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def check_continued_computation(cfg: DictConfig, run_dir: Path) -> None:
    """A resume (`resume=true` on a folder with `last.ckpt`) or a `ckpt_path` continues only under
    the config its checkpoint was trained with (`computation.py`); checked before Hydra writes
    anything, so that a refused resume leaves the run's `.hydra/` as it was."""
    ckpt = value_at(cfg, "ckpt_path")
    if not isinstance(ckpt, str) or not ckpt:
        ckpt = str(run_dir / "checkpoints" / "last.ckpt") if value_at(cfg, "resume") is True else None
    if not ckpt or not Path(ckpt).is_file():
        return
    if value_at(cfg, "mode") in ("train", ABSENT):
        refuse_other_computation(ckpt, recorded_computation(ckpt), computation(cfg))
    else:
        refuse_ignored_model_keys(cfg, ckpt)


def _given_model_keys(cfg: DictConfig, recorded: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """{recorded key: (this command's value, the override that gave it)} for the command's overrides
    of the model and the residual strategy: `residual=full` is its `_target_`, `model=gpt-small`
    every key of the model, `num_blocks=4` and `model.n_embd=64` themselves."""
    current = computation(cfg)
    given: dict[str, tuple[Any, str]] = {}
    for text in value_at(cfg, "hydra.overrides.task") or []:
        key = str(text).split("=", 1)[0].lstrip("+~")
        if key == "residual":
            given["residual._target_"] = (current.get("residual._target_"), str(text))
        elif key == "model":
            given.update({k: (v, str(text)) for k, v in current.items() if k.startswith("model.")})
        elif key == "num_blocks":
            given["residual.num_blocks"] = (value_at(cfg, "num_blocks"), str(text))
        elif key.startswith(("residual.", "model.")):
            given.update({k: (v, str(text)) for k, v in current.items() if k == key or k.startswith(key + ".")})
    return {k: v for k, v in given.items() if k in recorded}


def refuse_ignored_model_keys(cfg: DictConfig, ckpt: str) -> None:
    """`mode=eval` and `mode=sample` use the checkpoint's own model and residual strategy: a command
    that asks for another one would be answered about the checkpoint's without saying so."""
    if not any(str(o).split("=", 1)[0].lstrip("+~").startswith(("residual", "model", "num_blocks"))
               for o in value_at(cfg, "hydra.overrides.task") or []):
        return
    recorded = recorded_computation(ckpt) or {}
    given = _given_model_keys(cfg, recorded)
    differ = [k for k, (value, _) in given.items() if differences({k: recorded[k]}, {k: value})]
    if differ:
        named = ", ".join(f"{k} ({recorded[k]} there, {given[k][0]} here)" for k in differ)
        drop = " ".join(dict.fromkeys(given[k][1] for k in differ))
        raise ConfigError(
            f"mode={value_at(cfg, 'mode')} uses the model and residual strategy checkpoint {ckpt} was trained with, "
            f"not this command's: {named}; drop {drop} from the command"
        )


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


#: what a run writes before its first step (Hydra's .hydra/ and the log: about 10 KB), with room to spare
PROBE_BYTES = 64 * 1024


def check_creatable(folder: Path, what: str, fix: str) -> None:
    """`folder` exists as a writable folder or can be made, on a disk with room for a run's first
    files: probed with a temporary folder in its nearest existing ancestor and PROBE_BYTES written
    into it, removed at once (a root user passes permission bits, not a full or read-only disk)."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"cannot create {what} {folder}: {existing} is a file, not a folder; {fix}")
    try:
        probe = tempfile.mkdtemp(prefix=".attnres-probe-", dir=existing)
    except OSError as err:
        raise ConfigError(f"cannot create {what} {folder}: {existing} does not take new folders "
                          f"({err.strerror}); {fix}") from err
    try:
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise ConfigError(f"cannot write {what} {folder}: {existing} takes no new files ({err.strerror}); free some "
                          f"space there, or {fix[0].lower() + fix[1:]}") from err
    finally:
        shutil.rmtree(probe, ignore_errors=True)


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
        raise ConfigError(selectors.explain(cfg, err) or f"{where}: {err.msg.splitlines()[0]}; fix or remove that "
                          "${...} reference, or keep the key it points to") from err


def check_parts(cfg: DictConfig) -> None:
    """Build the cheap parts once, with their own checks: attnres's data module (not a text
    corpus folder, which would be walked twice), the residual strategy, the optimiser on a
    dummy parameter and the schedule at step 0. Their errors become one line."""
    from hydra.utils import instantiate

    cache = value_at(cfg, "data.cache_dir")
    if isinstance(cache, str) and cache and target_of(cfg, "data").startswith("attnres.data."):
        check_creatable(Path(cache).expanduser(), "the data cache folder",
                        "set data.cache_dir=<a writable folder>, or data.cache_dir=null for ~/.cache/attnres")
    data_target = str(OmegaConf.select(cfg, "data._target_", default=""))
    path = OmegaConf.select(cfg, "data.path", default=None)
    if data_target.startswith("attnres.data.") and not (path and os.path.isdir(str(path))):
        _build("data", lambda: instantiate(cfg.data))
    if str(OmegaConf.select(cfg, "residual._target_", default="")).startswith("attnres.") and \
            isinstance(value_at(cfg, "model.n_embd"), int) and isinstance(value_at(cfg, "model.n_layer"), int):
        _build("residual", lambda: instantiate(cfg.residual)(d_model=cfg.model.n_embd,
                                                             num_layers=2 * cfg.model.n_layer))
    if str(OmegaConf.select(cfg, "optim.optimizer._target_", default="")).startswith("torch.optim."):
        import torch

        _build("optim.optimizer", lambda: instantiate(cfg.optim.optimizer)([torch.nn.Parameter(torch.zeros(1))]))
    steps = value_at(cfg, "optim.total_steps") or value_at(cfg, "trainer.max_steps")
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


