"""`attnres-export RUN_DIR OUT_DIR`: a finished run as a Hugging Face model folder.

    attnres-export outputs/default/<run> hf-model         # then, in Python:
    import attnres.hf; AutoModelForCausalLM.from_pretrained("hf-model")

OUT_DIR gets `model.safetensors` (the checkpoint's weights; a tied LM head is stored once),
`config.json` (`attnres.hf.AttnResConfig`: the Transformer's arguments and the residual strategy,
from the run's `.hydra/config.yaml`), `generation_config.json` and the tokenizer: byte-level for
byte data, the run's `tokenizer.json` for token data (none for the synthetic task). The folder is
written beside OUT_DIR under a temporary name and renamed into place, so it is whole or absent.

Refused in one line, exit status 2, with nothing written: a folder that is not a run, a run that
is still running (its `.run.lock` is held), failed or never ended (no `metrics.json`, or one that
still says "running": killed while it continued), a run without the checkpoint asked for, a damaged
checkpoint or config, an existing OUT_DIR without `--overwrite`, and with it anything but an
earlier export (`folder.py`); a disk that is full or read-only says so (nothing is lost).
The numbers printed beside the checkpoint are the ones that describe it, or none.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from attnres.atomic import DISK_FULL, FILE_MODE, WRITE_ERRORS, read_json
from attnres.config.errors import ConfigError
from attnres.config.moved import update_moved_targets
from attnres.export.folder import check_out, recover_leftovers

PROG = "attnres-export"


def is_running(run_dir: Path) -> bool:
    """Whether a process holds the run's lock (`faults.RunLock`; the kernel frees it when the holder dies)."""
    lock = run_dir / ".run.lock"
    if not lock.is_file():
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def check_run(run_dir: Path, which: str) -> tuple[DictConfig, dict[str, Any], Path]:
    """(the run's config, its metrics.json, the checkpoint) of a run that may be exported."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run folder (no .hydra/config.yaml); pass the folder attnres-run wrote")
    if is_running(run_dir):
        raise ConfigError(f"{run_dir} is still running (another process holds {run_dir / '.run.lock'}); "
                          "export it once it has finished")
    summary = read_summary(run_dir)
    ckpt = run_dir / "checkpoints" / f"{which}.ckpt"
    if not ckpt.is_file():
        raise ConfigError(f"{run_dir} has no checkpoints/{which}.ckpt to export; "
                          + ("try --checkpoint best" if which == "last" else "try --checkpoint last"))
    try:
        cfg = OmegaConf.load(saved)
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{saved} does not parse ({first}); the run's config is damaged: restore it "
                          "(the run's attnres.log starts with its overrides), then export again") from err
    if not isinstance(cfg, DictConfig) or not isinstance(cfg.get("model"), DictConfig):
        raise ConfigError(f"{saved} holds no model section; the run's config is damaged: restore it, then export "
                          "again")
    update_moved_targets(cfg)
    return cfg, summary, ckpt


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run's metrics.json, refused in one line unless it says the run ended (finished or interrupted)."""
    path = run_dir / "metrics.json"
    if not path.exists():
        raise ConfigError(f"{run_dir} never ended (no metrics.json): it was killed or is starting; finish it "
                          f"with attnres-run resume=true (in the same folder), then export it")
    summary = read_json(path)
    status = summary.get("status")
    if not summary or not isinstance(status, str):
        raise ConfigError(f"{path} is empty or damaged (no status); attnres-run resume=true in the same folder "
                          "writes it again from the last checkpoint, then export it")
    if status == "running":
        raise ConfigError(f"{run_dir} did not end: it was continued from {summary.get('resumed_from')} and stopped "
                          "without a word (killed?), so no metrics describe its checkpoints; finish it with "
                          "attnres-run resume=true (the same command), then export it")
    if status == "failed":
        raise ConfigError(f"{run_dir} failed ({summary.get('error') or 'see its attnres.log'}); export a run that "
                          "finished, or train it again (overwrite=true)")
    return summary


def model_spec(cfg: DictConfig, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Transformer's keyword arguments, the residual spec) of the run, resolved."""
    from attnres.hf.configuration import locate
    from attnres.model import Transformer

    model = OmegaConf.to_container(cfg.model, resolve=True)
    target = model.pop("_target_", None)
    if not isinstance(target, str) or not (isinstance(cls := locate(target), type) and issubclass(cls, Transformer)):
        raise ConfigError(f"model._target_={target} is not attnres.Transformer: only its models export")
    model.pop("_partial_", None)
    embed = state.get("model.embed.weight")
    if embed is None:
        raise ConfigError("the checkpoint holds no model.embed.weight; it was not written by attnres-run")
    residual = OmegaConf.to_container(cfg.residual, resolve=True) if cfg.get("residual") else None
    if residual:
        residual.pop("_partial_", None)  # the Transformer fills in d_model and num_layers
    return {**model, "vocab_size": int(embed.shape[0])}, residual


def tokenizer_of(cfg: DictConfig, given: str | None) -> tuple[Any, str]:
    """(a `tokenizers.Tokenizer` or None, where it came from) for the run's data."""
    from tokenizers import Tokenizer

    from attnres.hf.configuration import locate
    from attnres.hf.tokenization import byte_tokenizer

    if given:
        if not Path(given).is_file():
            raise ConfigError(f"--tokenizer {given} is not a file; pass a tokenizer.json")
        return Tokenizer.from_file(given), given
    data = cfg.get("data") or {}
    try:
        cls = locate(str(data.get("_target_")))
    except ValueError:
        cls = None
    from attnres.data.bytes import BytesDataModule
    from attnres.data.tokens import TokensDataModule

    if isinstance(cls, type) and issubclass(cls, BytesDataModule):
        return byte_tokenizer(), "byte-level (token i = byte i of UTF-8 text)"
    if isinstance(cls, type) and issubclass(cls, TokensDataModule):
        # where TokensDataModule looks: data.tokenizer, meta.json's tokenizer_file, tokenizer.json in data.path
        folder = Path(os.path.expanduser(os.path.expandvars(str(data.get("path") or "."))))
        meta = read_json(folder / "meta.json")
        candidates = [data.get("tokenizer"), meta.get("tokenizer_file") and folder / meta["tokenizer_file"],
                      folder / "tokenizer.json"]
        for file in (Path(os.path.expanduser(str(c))) for c in candidates if c):
            if file.is_file():
                return Tokenizer.from_file(str(file)), str(file)
        return None, f"none: no tokenizer.json found for data.path={folder} (pass --tokenizer FILE to add one)"
    return None, f"none: {data.get('_target_')} has no text tokenizer (pass --tokenizer FILE to add one)"


def prepare_export(cfg: DictConfig, ckpt: Path, tokenizer: str | None) -> tuple[Any, Any, dict[str, Any]]:
    """(the Hugging Face model with the checkpoint's weights, the tokenizer or None, what they are),
    built in memory: a refusal here leaves nothing on disk."""
    from attnres.hf import AttnResConfig, AttnResForCausalLM
    from attnres.training.checkpoints import load_checkpoint

    loaded = load_checkpoint(ckpt)
    state = loaded.get("state_dict") if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {ckpt} has no 'state_dict'; it was not written by attnres-run")
    transformer, residual = model_spec(cfg, state)
    config = AttnResConfig(transformer=transformer, residual=residual)
    try:
        model = AttnResForCausalLM(config)
    except (TypeError, ValueError, ImportError, AttributeError) as err:
        raise ConfigError(f"the model its run's config describes cannot be built ({err}); the run's "
                          f".hydra/config.yaml was changed? export the run whose config wrote {ckpt}") from err
    weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    problem = state_mismatch(model.transformer.state_dict(), weights)
    if problem:
        raise ConfigError(f"checkpoint {ckpt} does not match the model its run's config describes ({problem}); "
                          "export it from its own run folder (was its .hydra/config.yaml changed?)")
    model.transformer.load_state_dict(weights, strict=True)
    tok, source = tokenizer_of(cfg, tokenizer)
    if tok is not None and tok.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise ConfigError(f"the tokenizer {source} has {tok.get_vocab_size(with_added_tokens=True)} tokens but the "
                          f"model {config.vocab_size}; pass the tokenizer the run was trained with (--tokenizer FILE)")
    dtype = next(model.parameters()).dtype
    return model, tok, {
        "parameters": model.transformer.num_parameters(), "dtype": str(dtype).removeprefix("torch."),
        "residual": (residual or {}).get("_target_", "attnres.StandardResidual"), "tokenizer": source,
        "step": loaded.get("global_step"), "vocab_size": config.vocab_size, "tied": bool(config.tie_word_embeddings),
        "best_score": best_score(loaded)}


def best_score(loaded: dict[str, Any]) -> tuple[str, float] | None:
    """(the monitored metric, its best value) that the checkpoint's ModelCheckpoint records, if any."""
    for key, state in (loaded.get("callbacks") or {}).items():
        score = state.get("best_model_score") if isinstance(state, dict) and "ModelCheckpoint" in str(key) else None
        if score is not None and state.get("monitor"):
            return str(state["monitor"]), float(score)
    return None


def state_mismatch(expected: dict[str, Any], given: dict[str, Any], shown: int = 3) -> str:
    """What differs between the model's state dict and the checkpoint's, naming the keys; "" when nothing."""
    def names(keys: list[str]) -> str:
        return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")

    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = [f"{k} is {list(given[k].shape)} in the checkpoint, {list(expected[k].shape)} in the config"
              for k in sorted(set(expected) & set(given)) if tuple(given[k].shape) != tuple(expected[k].shape)]
    parts = ([f"{len(missing)} key(s) missing from the checkpoint: {names(missing)}"] if missing else []) \
        + ([f"{len(unexpected)} key(s) the config has no place for: {names(unexpected)}"] if unexpected else []) \
        + ([f"{len(shapes)} shape(s) differ: {'; '.join(shapes[:shown])}"] if shapes else [])
    return "; ".join(parts)


def write_export(model: Any, tok: Any, out: Path) -> None:
    """The Hugging Face folder of `model` and `tok` (None: no tokenizer) into `out`, a new folder."""
    from transformers import GenerationConfig
    from transformers.utils.logging import disable_progress_bar

    from attnres.hf.tokenization import save_tokenizer

    out.mkdir()
    special = save_tokenizer(tok, out, model.config.max_position_embeddings) if tok is not None else {}
    model.generation_config = GenerationConfig(**special)
    disable_progress_bar()  # "Writing model shards" says nothing here
    model.save_pretrained(str(out))
    for file in out.iterdir():  # safetensors' own writes are private (0600); these are for sharing
        os.chmod(file, FILE_MODE)


def export(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False, checkpoint: str = "last",
           tokenizer: str | None = None, say: Any = None) -> dict[str, Any]:
    """Export the run in `run_dir` to `out_dir`; returns what was written. Raises ConfigError (one
    line) on a refusal, before anything is written. `say(line)` hears what was cleaned up of an
    earlier export that was killed midway."""
    run_dir, out = Path(run_dir).expanduser(), Path(out_dir).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder; pass the run folder attnres-run wrote (outputs/<name>/<run>)")
    for line in recover_leftovers(out):
        (say or print)(line)
    check_out(out, run_dir, overwrite)
    cfg, summary, ckpt = check_run(run_dir, checkpoint)
    model, tok, info = prepare_export(cfg, ckpt, tokenizer)  # every refusal is before the first write
    made = [p for p in reversed(out.absolute().parents) if not p.exists()]  # folders above OUT_DIR, made here
    tmp = out.parent / f".{out.name}.export-{os.getpid()}.tmp"
    aside = out.parent / f".{out.name}.replaced-{os.getpid()}.tmp"
    done = placing = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_export(model, tok, tmp)
        if overwrite and out.exists():
            os.replace(out, aside)
        placing = True
        os.replace(tmp, out)  # onto a folder that appeared meanwhile (another export): ENOTEMPTY, refused below
        done = True
    except Exception as err:  # noqa: BLE001 (safetensors reports a full disk as SafetensorError, not OSError)
        err = write_failure(err, tmp)
        if placing and err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ConfigError(f"{out} appeared while this export was written (another export at the same time?): "
                              "it is left as it is and nothing of this one was kept; pass --overwrite to replace "
                              "it, or another OUT_DIR") from err
        what = "the disk is full" if err.errno in DISK_FULL else f"cannot write there ({err.strerror})"
        kept = f"{out} is as it was" if out.exists() else f"{out} was not made"
        fix = "free some space" if err.errno in DISK_FULL else "pass an OUT_DIR you can write to" \
            if err.errno in WRITE_ERRORS else "pass another OUT_DIR"
        raise ConfigError(f"{what}{' writing ' + str(err.filename) if err.filename else ''}: nothing was exported "
                          f"and nothing lost ({kept}); {fix}, then export again") from err
    finally:
        for leftover in (tmp, aside):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                shutil.rmtree(leftover)
        for folder in reversed(made if not done else []):
            with contextlib.suppress(OSError):
                folder.rmdir()
    shown = checkpoint_metrics(summary, info, checkpoint)
    return {**info, "run": str(run_dir), "checkpoint": str(ckpt), "out": str(out), "status": summary.get("status"),
            "metrics": shown}


def write_failure(err: Exception, path: Path) -> OSError:
    """`err` as the OSError of a write the system refused (a full or read-only disk, no permission,
    a file where a folder belongs); re-raises anything else. safetensors' writer says "(os error 28)"
    in a SafetensorError."""
    if isinstance(err, OSError) and err.errno is not None:
        return err
    code = re.search(r"os error (\d+)", str(err))
    if code:
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path))
    raise err


def checkpoint_metrics(summary: dict[str, Any], info: dict[str, Any], which: str) -> dict[str, Any]:
    """The validation numbers that describe the exported checkpoint: metrics.json's when it was written
    at the checkpoint's step, the best score the checkpoint records for `best`, else none."""
    if which == "last" and summary.get("steps") == info.get("step"):
        validated = summary.get("validation_step")  # an interrupted run: its last validation may be older
        if validated is not None and validated != info.get("step"):
            info["validated_at"] = validated
        return summary.get("metrics") or {}
    best = info.get("best_score")
    return {f"{best[0]} (best)": best[1]} if which == "best" and best else {}


def describe(info: dict[str, Any]) -> str:
    shown = ", ".join(f"{k} {v:.4f}" for k, v in info["metrics"].items()
                      if k.startswith("val/") and isinstance(v, (int, float)))
    if shown and info.get("validated_at") is not None:
        shown += f" (its last validation, at step {info['validated_at']})"
    status = info["status"] + (f" at step {info['step']}" if info.get("step") is not None else "")
    return "\n".join([
        f"exported {info['checkpoint']} ({status}{'; ' + shown if shown else ''})",
        f"  model        {info['out']}  ({info['parameters']:,} parameters, {info['dtype']}, "
        f"{info['residual'].rsplit('.', 1)[-1]}, vocabulary {info['vocab_size']:,}"
        f"{', tied embeddings' if info['tied'] else ''})",
        f"  tokenizer    {info['tokenizer']}",
        f"  load it      import attnres.hf; AutoModelForCausalLM.from_pretrained({json.dumps(info['out'])})",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description="Export an attnres-run run as a Hugging Face model "
                                     "folder (safetensors, config.json, generation_config.json, tokenizer).")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (outputs/<name>/<run>)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--checkpoint", choices=("last", "best"), default="last",
                        help="which checkpoint of the run (default: last)")
    parser.add_argument("--tokenizer", metavar="FILE", default=None,
                        help="a tokenizer.json to ship instead of the run's own")
    args = parser.parse_args(argv)
    try:
        info = export(args.run_dir, args.out_dir, overwrite=args.overwrite, checkpoint=args.checkpoint,
                      tokenizer=args.tokenizer, say=lambda line: print(f"{PROG}: {line}", file=sys.stderr))
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except ImportError as err:
        print(f"{PROG}: error: {err.name or err} is not installed; pip install 'attnres[hf]'", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: `export` has already removed what it had written
        print(f"{PROG}: interrupted; nothing was exported ({args.out_dir} is as it was)", file=sys.stderr)
        sys.exit(130)
    print(describe(info))


if __name__ == "__main__":
    main()
