"""OUT_DIR of `attnres-export`: what `--overwrite` may replace (an earlier export, nothing else: not
a run, not a folder inside one, not a folder of other files), and what an export killed midway left
beside it (a half-written folder, an earlier export moved aside), cleaned up or restored by the next.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from pathlib import Path

from attnres.atomic import read_json
from attnres.config.errors import ConfigError

#: what attnres-export (transformers' save_pretrained) writes into OUT_DIR: `--overwrite` replaces a
#: folder that holds these only (and an attnres config.json), never anything else
EXPORT_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def enclosing_run(folder: Path) -> Path | None:
    """The run folder (one holding `.hydra/config.yaml`) that is `folder` or holds it, if any."""
    for candidate in (folder, *folder.parents):
        if (candidate / ".hydra" / "config.yaml").is_file():
            return candidate
    return None


def not_an_export(out: Path) -> str | None:
    """Why `--overwrite` must not replace `out`, or None when it holds an earlier export and nothing else."""
    if out.is_symlink():
        return "it is a symbolic link"
    if read_json(out / "config.json").get("model_type") != "attnres":
        return "it has no attnres config.json"
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir()
                    if p.is_dir() or not (p.name in EXPORT_FILES or SHARD.fullmatch(p.name)))
    if others:
        return f"it holds {', '.join(others[:3])}{' and more' if len(others) > 3 else ''}, which no export writes"
    return None


def check_out(out: Path, run_dir: Path, overwrite: bool) -> None:
    """Refuse an OUT_DIR that is or lies in a run folder, or that exists and is not an earlier export."""
    full = Path(os.path.abspath(out))
    if full == Path(os.path.abspath(run_dir)) or Path(os.path.abspath(run_dir)).is_relative_to(full):
        what = "is the run folder itself" if full == Path(os.path.abspath(run_dir)) else f"holds the run {run_dir}"
        raise ConfigError(f"OUT_DIR {out} {what}; pass another OUT_DIR")
    run = enclosing_run(full.resolve()) or enclosing_run(full)
    if run is not None:
        where = "is a run folder" if run == full.resolve() or run == full else f"lies inside the run folder {run}"
        raise ConfigError(f"OUT_DIR {out} {where}; pass an OUT_DIR outside every run folder (an export there would "
                          "mix with the run's own files)")
    blocked = next((p for p in full.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError(f"OUT_DIR {out} cannot be made: {blocked} is a file, not a folder; pass another OUT_DIR")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ConfigError(f"{out} is a file; pass another OUT_DIR")
        if not overwrite:
            raise ConfigError(f"{out} exists; pass --overwrite to replace it, or another OUT_DIR")
        why = not_an_export(out)
        if why:
            raise ConfigError(f"{out} is not an earlier export ({why}); --overwrite replaces only a folder "
                              "attnres-export wrote: pass another OUT_DIR")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_leftovers(out: Path) -> list[str]:
    """What an export killed midway left beside OUT_DIR: a half-written `.OUT.export-PID.tmp` is
    removed; an earlier export moved aside as `.OUT.replaced-PID.tmp` goes back to OUT_DIR when
    OUT_DIR is absent (killed between the two renames of --overwrite), else it is removed. Only a
    dead process's leftovers are touched. Returns a line per thing done."""
    done = []
    if not out.parent.is_dir():
        return done
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*-*.tmp")):
        kind, _, pid = path.name[len(out.name) + 2:-len(".tmp")].rpartition("-")
        if kind not in ("export", "replaced") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "replaced" and not out.exists() and not out.is_symlink():
            os.replace(path, out)
            done.append(f"restored the earlier export {out}, which process {pid} had moved aside and was stopped "
                        "before it put the new one in place")
        else:
            shutil.rmtree(path)
            what = "a half-written export" if kind == "export" else "an earlier export already replaced"
            done.append(f"removed {path}: {what}, left by process {pid}, which was stopped midway")
    return done
