"""The `attnres-run` console script.

In a wheel, `cli.py` and `conf/` are mapped into this package at build time; in a source
checkout (an editable install) they stay at the top of the repository, beside it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GROUP_HELP = {
    "residual": "the residual strategy (block reads the top-level num_blocks)",
    "model": "the Transformer's shape",
    "data": "what it trains on (no download needed)",
    "trainer": "the Lightning Trainer: devices, precision, steps, validation interval",
    "optim": "optimiser, learning-rate schedule, pseudo-query learning rate",
    "logger": "where metrics go",
    "callbacks": "checkpoints, progress, TensorBoard dashboards and HParams",
    "experiment": "named studies that set several groups at once",
    "experiment/paper_ablation": "one row of the paper's Table 4: experiment/paper_ablation@_global_=<row>",
    "debug": "short runs for checking a setup",
    "tune": "with -m: each arm at its own best, searched on tuning seeds (docs/sweeps.md)",
    "hydra/launcher": "how a sweep's jobs run (-m)",
}


def conf_dir() -> Path:
    """conf/ beside cli.py: inside the package in a wheel, at the top of a source checkout."""
    inside = Path(__file__).resolve().parent / "conf"
    return inside if inside.is_dir() else Path(__file__).resolve().parent.parent / "conf"


def help_text(conf: Path) -> str:
    """`attnres-run --help`, read from the YAML files alone (fast: no torch, Lightning or Hydra)."""
    defaults, keys, in_defaults = {}, [], False
    for line in (conf / "config.yaml").read_text().splitlines():
        if line.startswith("defaults:"):
            in_defaults = True
        elif in_defaults and line.startswith("  - ") and ":" in line and "_self_" not in line:
            group, _, rest = line[4:].partition(":")
            defaults[group.replace("override ", "").strip()] = rest.split("#")[0].strip()
        elif line and not line.startswith((" ", "#")):
            in_defaults = line.startswith("defaults:")
            key, _, rest = line.partition(":")
            if key != "hydra":
                keys.append((key, rest.split("#", 1)[1].strip() if "#" in rest else ""))
    lines = [
        "attnres-run: train a Transformer with the residual strategy of your choice, and compare them.",
        "",
        "usage: attnres-run [group=option ...] [key=value ...]     one run",
        "       attnres-run -m key=a,b [key=x,y ...]               a sweep: every combination, in parallel",
        "       attnres-run --cfg job [overrides]                  print the composed config, resolved",
        "       attnres-run --hydra-help                           Hydra's own flags",
        "",
        "config groups (group=option; * the default):",
    ]
    column = max(15, *(len(g) for g in GROUP_HELP))
    for group, what in GROUP_HELP.items():
        options = sorted(f.stem for f in (conf / group).glob("*.yaml"))
        if group == "hydra/launcher":
            options = sorted({*options, "basic"})
        marked = [f"{o}*" if o == defaults.get(group.split("/")[-1], defaults.get(group)) else o for o in options]
        lines.append(f"  {group:<{column}} {what}")
        lines.append(f"  {'':<{column}}   {', '.join(marked)}")
    lines += ["", "top-level keys (key=value):"]
    width = max([15, *(len(key) for key, _ in keys)])
    lines += [f"  {key:<{width}} {what}" for key, what in keys]
    lines += ["", "Override any key inside a group too: optim.optimizer.lr=1e-3, trainer.max_steps=300.",
              "Each YAML file under conf/ documents its keys, their types and defaults."]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 2 and sys.argv[1] in ("--help", "-h"):
        print(help_text(conf_dir()))
        return
    # As with `python -m`, the current folder is importable, so a strategy in ./my_residual.py
    # plugs in with `residual._target_=my_residual.MyResidual`.
    if "" not in sys.path and sys.path[0] != str(Path.cwd()):
        sys.path.insert(0, str(Path.cwd()))
    # A mistaken command is answered before torch and Lightning are imported (seconds on a busy
    # machine): checking it needs Hydra and OmegaConf only, until it builds the parts of a valid one.
    from attnres.config.command import check_command_line
    from attnres.config.errors import user_errors

    with user_errors():
        check_command_line(sys.argv[1:], conf_dir())
    if importlib.util.find_spec("attnres.cli") is not None:
        from attnres import cli
    else:
        path = Path(__file__).resolve().parent.parent / "cli.py"
        spec = importlib.util.spec_from_file_location("attnres_cli", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise SystemExit(f"attnres-run: cannot find cli.py beside the attnres package ({path}); reinstall attnres")
        cli = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = cli
        spec.loader.exec_module(cli)
        # sweep workers cannot import this module by name: send its functions by value
        import cloudpickle

        cloudpickle.register_pickle_by_value(cli)
    cli.main(checked=True)
