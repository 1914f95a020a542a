"""Causal routing probes on a run's checkpoint: which sources and which sublayers it uses (`attnres-probe`).

    attnres-probe outputs/default/<run>            # one run
    attnres-probe multirun/NAME                    # every run of a sweep
    attnres-probe RUN --batches 16 --mode mean --ckpt best

(`python -m attnres.training.probe_runs` and `python experiments/probe_routing.py` in a clone are
the same.)

Rebuilds each run's model and data from its `.hydra/config.yaml`, loads the checkpoint
(`--ckpt`: last, best or a path; default last), and runs `attnres.probes.probe_routing` on
the first `--batches` validation batches (the fixed evaluation set; default 4). It writes, per
run (the names and pictures of the `routing_probes` callback):

    probes.json               every number: clean loss, mass, source effects, rank correlations,
                              top-source agreement, layer effects, labels, seconds
    plots/routing.png         mass heatmap | knock-out heatmap | per-sublayer rank correlation
                              (strategies with source knock-outs: Block and Full AttnRes)
    plots/layer_knockout.png  change in loss when each sublayer's output is removed
    TensorBoard               the same images and raw arrays (probe/routing, probe/layer_knockout,
                              *_data) in an event file of the run folder, at the checkpoint's step;
                              a rerun replaces the event file of the previous one

Given a folder holding several runs, the knock-out heatmaps share one colour scale (so their
colours compare), and `plots/compare_layer_knockout.png` overlays the runs' layer knock-out
curves, coloured by strategy (runs of the same depth).

`--reuse` takes a run's `probes.json` instead of probing again when it is newer than the
checkpoint and was measured with the same --batches, --mode and --ckpt (to redraw, or to add
runs to a sweep's comparison without probing the others again).

Exit status: 0 when every run was probed, 1 when some were skipped (said why, one line
each), 2 for a bad command line or a folder without runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

EVENTS_SUFFIX = ".probe_routing"  # the event files this command writes (and replaces on a rerun)


class SkipRun(Exception):  # noqa: N818  (a run left out, reported in one line)
    """This run cannot be probed; the message says why and what to do."""


def find_runs(root: Path) -> list[Path]:
    """`root` itself when it is a run folder (it holds `.hydra/`), else every run folder below it."""
    from attnres.results.summary import find_job_dirs

    return [root] if (root / ".hydra").is_dir() else find_job_dirs(root)


def checkpoint_path(run: Path, ckpt: str) -> Path:
    if ckpt in ("last", "best"):
        path = run / "checkpoints" / f"{ckpt}.ckpt"
    else:
        path = Path(ckpt)
    if not path.is_file():
        raise SkipRun(f"no checkpoint {path} (train the run first, or pick another with --ckpt last|best|PATH)")
    return path


def load_run(run: Path, ckpt: str, device: str) -> tuple[Any, Any, int]:
    """(model on `device`, data module set up for validation, the checkpoint's global step)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from attnres.config import naming  # noqa: F401  (the resolver the saved config may name)

    config = run / ".hydra" / "config.yaml"
    try:
        cfg = OmegaConf.load(config)
        datamodule = instantiate(cfg.data)
        datamodule.prepare_data()
        datamodule.setup("validate")
        model = instantiate(cfg.model, vocab_size=datamodule.vocab_size, residual=instantiate(cfg.residual))
    except Exception as err:  # a config of another version, a strategy module that is not importable...
        raise SkipRun(f"cannot rebuild the model from {config}: {type(err).__name__}: {err}") from err
    path = checkpoint_path(run, ckpt)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items() if k.startswith("model.")}
        model.load_state_dict(weights)
    except Exception as err:
        raise SkipRun(f"cannot load {path} into the run's model: {type(err).__name__}: {err}") from err
    return model.to(device), datamodule, int(state.get("global_step", 0))


def replace_events(run: Path) -> Any:
    """A SummaryWriter into the run folder, after removing this command's earlier event files."""
    from torch.utils.tensorboard import SummaryWriter

    for old in run.glob(f"events.out.tfevents.*{EVENTS_SUFFIX}"):
        old.unlink(missing_ok=True)
    return SummaryWriter(str(run), filename_suffix=EVENTS_SUFFIX)


def requested(args: argparse.Namespace) -> dict[str, bool]:
    return {"sources": not args.no_sources, "layers": not args.no_layers}


def reusable(run: Path, args: argparse.Namespace) -> tuple[Any, int] | None:
    """(probe, step) from the run's probes.json when --reuse may take it, else None."""
    from attnres.atomic import read_json
    from attnres.probes import RoutingProbe
    from attnres.training.routing import PROBE_JSON

    saved = read_json(run / PROBE_JSON)
    try:
        ckpt = checkpoint_path(run, args.ckpt)
        fresh = (run / PROBE_JSON).stat().st_mtime > ckpt.stat().st_mtime
        same = ((saved["batches"], saved["mode"], saved.get("checkpoint"), saved.get("requested"))
                == (args.batches, args.mode, args.ckpt, requested(args)))
        return (RoutingProbe.from_dict(saved), int(saved["step"])) if fresh and same else None
    except (OSError, KeyError, TypeError, ValueError, SkipRun):
        return None


def probe_run(run: Path, args: argparse.Namespace) -> tuple[Any, int]:
    import torch

    from attnres.probes import probe_routing
    from attnres.training.routing import evaluation_batches

    model, datamodule, step = load_run(run, args.ckpt, args.device)
    batches = evaluation_batches(datamodule, args.batches)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") and args.bf16
                else torch.autocast("cpu", enabled=False))
    try:
        with autocast:
            probe = probe_routing(model, batches, mode=args.mode, sources=not args.no_sources,
                                  layers=not args.no_layers, max_stack=args.max_stack)
    except ValueError as err:  # a non-finite intact loss, say
        raise SkipRun(str(err)) from err
    return probe, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a run folder (holding .hydra/) or a folder of runs (a sweep)")
    parser.add_argument("--batches", type=int, default=4, help="validation batches in the evaluation set (default 4)")
    parser.add_argument("--mode", choices=("remove", "mean"), default="remove",
                        help="remove: drop the source and renormalise (default); mean: its mean over tokens")
    parser.add_argument("--ckpt", default="last", help="last (default), best, or a checkpoint path")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, cuda:1, ...")
    parser.add_argument("--bf16", action="store_true", help="on CUDA, run under bf16 autocast")
    parser.add_argument("--max-stack", type=int, default=16,
                        help="at most this many copies of a batch in one pass (default 16; lower it for memory)")
    parser.add_argument("--no-sources", action="store_true", help="skip the source knock-outs")
    parser.add_argument("--no-layers", action="store_true", help="skip the layer knock-outs")
    parser.add_argument("--reuse", action="store_true",
                        help="use a run's probes.json when it is newer than the checkpoint and has the same settings")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.max_stack < 1:
        parser.error(f"--max-stack must be >= 1, got {args.max_stack}")
    if args.no_sources and args.no_layers:
        parser.error("--no-sources and --no-layers leave nothing to measure; drop one")
    root: Path = args.folder
    if not root.is_dir():
        parser.error(f"{root} is not a folder; give a run folder (holding .hydra/) or a sweep folder")
    runs = find_runs(root)
    if not runs:
        parser.error(f"no run folders under {root} (a run folder holds .hydra/config.yaml)")
    ckpt = args.ckpt
    if ckpt not in ("last", "best") and len(runs) > 1:
        parser.error("--ckpt PATH names one checkpoint; give it with one run folder, or use last / best")
    import torch  # after the cheap checks: a wrong command line fails fast

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; use --device cpu")

    from attnres.atomic import atomic_write
    from attnres.results import figures
    from attnres.results.summary import short_names
    from attnres.training.routing import write_probes

    results: dict[Path, tuple[Any, int]] = {}
    for run in runs:
        start = time.perf_counter()
        kept = reusable(run, args) if args.reuse else None
        try:
            results[run] = kept or probe_run(run, args)
        except SkipRun as why:
            print(f"{run}: skipped: {why}", file=sys.stderr)
            continue
        probe = results[run][0]
        how = "from its probes.json" if kept else f"{time.perf_counter() - start:.1f} s"
        print(f"{run}: {probe.strategy}, clean loss {probe.clean_loss:.4f} on {probe.tokens} tokens, {how}")
    # one colour scale for every knock-out heatmap of the folder
    effects = [np.abs(p.source_effect[np.isfinite(p.source_effect)]) for p, _ in results.values()
               if p.source_effect is not None]
    effects = [e for e in effects if e.size]
    limit = float(max(e.max() for e in effects)) if effects else None
    extra = {"evaluation_set": f"the first {args.batches} validation batches", "checkpoint": ckpt,
             "requested": requested(args)}
    for run, (probe, step) in results.items():
        writer = replace_events(run)
        try:
            written = write_probes(probe, run, step, writer, effect_limit=limit if len(results) > 1 else None,
                                   extra=extra)
        finally:
            writer.close()
        print(f"{run}: wrote {', '.join(str(p.relative_to(run)) for p in written)}")
        rho = probe.rank_correlation()
        if rho is not None:
            shown = ", ".join(f"{label} {r:+.2f}" for label, r in zip(probe.row_labels, rho, strict=True)
                              if np.isfinite(r))
            print(f"  mass-vs-effect rank correlation per sublayer: {shown or 'no row has 3 sources'}")
        print("  layer knock-out (nats): " + ", ".join(f"{label} {v:+.3f}" for label, v in
                                                       zip(probe.layer_labels, probe.layer_effect, strict=True))
              if probe.layer_effect is not None else "  no layer knock-outs (--no-layers)")
    curves = {run: p for run, (p, _) in results.items() if p.layer_effect is not None}
    depths = {tuple(p.layer_labels) for p in curves.values()}
    if len(curves) > 1 and len(depths) == 1:
        names = short_names(sorted(str(r.relative_to(root)) for r in curves))
        series = {names[str(r.relative_to(root))]: p.layer_effect for r, p in sorted(curves.items())}
        strategies = {names[str(r.relative_to(root))]: p.strategy for r, p in sorted(curves.items())}
        tokens = sorted({p.tokens for p in curves.values()})
        title = (f"{len(curves)} runs, {tokens[0] if len(tokens) == 1 else 'their'} validation tokens\n"
                 "layer knock-out: change in loss when one sublayer's output is removed")
        fig = figures.compare_profiles([("loss(without it) - loss (nats)", series)], strategies,
                                       next(iter(depths)), title, "sublayer removed (depth)", signed=True)
        out = root / "plots" / "compare_layer_knockout.png"
        atomic_write(out, lambda f: fig.savefig(f, dpi=figures.DPI, format="png"))
        print(f"sweep: wrote {out}")
    elif len(curves) > 1:
        print("sweep: runs of different depths; no compare_layer_knockout.png")
    if not results:
        return 1
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
