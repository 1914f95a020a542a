"""Render a run's dashboard figures as PNG files from its TensorBoard event files (`attnres-plot`).

    attnres-plot outputs/default/residual=block,num_blocks=8   # -> RUN_DIR/plots/
    attnres-plot multirun/default                              # every run below it
    attnres-plot RUN_DIR --out figures/ --step 500

(`python -m attnres.results.plot_run` and `python experiments/plot_run.py` in a clone are the same.)

Each figure is redrawn from the raw array the `depth_dashboard` callback logs beside the image
(tensor summaries `depth/heatmap_data`, `magnitude/plot_data`, `grad_norm/plot_data`, with
their labels as metadata) by the same code that drew the TensorBoard image
(`attnres.results.figures.render`), so the PNGs are those pictures, pixel for pixel:

    heatmap.png     depth-attention weights (AttnRes runs only)
    magnitude.png   RMS of each sublayer's input and output across depth
    grad_norm.png   gradient norm of each Transformer layer

at the last logged step, or the last one at or before `--step`. A run folder is one that holds
TensorBoard event files (or, from older versions, a `tb/` folder holding them); given any
other folder, every run folder below it is done, and when two or more of them have the same
depth the sweep also gets

    compare_magnitude.png   two panels over depth: each sublayer's input RMS, then its output RMS
    compare_grad_norm.png   the gradient norm of each Transformer layer

in `plots/`, one line per run, coloured by strategy (the seeds of one strategy in shades of
its colour), the legend beside the panels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from attnres.results import figures
from attnres.results.summary import short_names

EVENTS = "events.out.tfevents.*"
FILES = {"depth/heatmap": "heatmap.png", "magnitude/plot": "magnitude.png", "grad_norm/plot": "grad_norm.png"}


def events_dir(run: Path) -> Path:
    """Where a run's event files are: the run folder itself, or `tb/` in runs of older versions."""
    return run / "tb" if not any(run.glob(EVENTS)) and any((run / "tb").glob(EVENTS)) else run


def find_runs(root: Path) -> list[Path]:
    """`root` itself when it is a run folder, else every run folder below it, sorted."""
    if any(events_dir(root).glob(EVENTS)):
        return [root]
    folders = {f.parent for f in root.rglob(EVENTS)}
    return sorted({f.parent if f.name == "tb" and not any(f.parent.glob(EVENTS)) else f for f in folders})


def read_figure_data(run: Path, step: int | None) -> dict[str, tuple[int, np.ndarray, dict]]:
    """image tag -> (step, raw array, metadata) of each figure the run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events_dir(run)), size_guidance={"tensors": 0, "images": 1, "scalars": 1,
                                                           "histograms": 1, "compressedHistograms": 1})
    acc.Reload()
    found = {}
    for tag, data_tag in figures.FIGURE_TAGS.items():
        if data_tag not in acc.Tags()["tensors"]:
            continue
        events = [e for e in acc.Tensors(data_tag) if step is None or e.step <= step]
        if not events:
            continue
        event = max(events, key=lambda e: e.step)
        proto = event.tensor_proto
        shape = [d.size for d in proto.tensor_shape.dim]
        array = np.asarray(proto.float_val, dtype=np.float32).reshape(shape)
        meta = json.loads(acc.SummaryMetadata(data_tag).plugin_data.content)
        found[tag] = (event.step, array, meta)
    return found


def plot_run(run: Path, out: Path, step: int | None) -> dict[str, tuple[int, np.ndarray, dict]]:
    data = read_figure_data(run, step)
    if not data:
        print(f"{run}: no dashboard data in its event files (was the depth_dashboard callback on?); skipped")
        return data
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for tag, (at, array, meta) in data.items():
        figures.save_png(figures.render(tag, array, meta, at), out / FILES[tag])
        written.append(f"{FILES[tag]} (step {at})")
    print(f"{run}: wrote {', '.join(written)} to {out}")
    return data


def compare(results: dict[str, dict], out: Path) -> None:
    """Overlay the runs' magnitudes (input and output RMS) and gradient norms when their depths agree."""
    for tag, name, panels, xlabel in (
        ("magnitude/plot", "compare_magnitude.png",
         ((0, "input RMS (what each sublayer reads)"), (1, "output RMS (what it writes)")), "sublayer (depth)"),
        ("grad_norm/plot", "compare_grad_norm.png", ((None, "gradient norm per layer"),),
         "Transformer layer (depth)"),
    ):
        runs = {run: data[tag] for run, data in results.items() if tag in data}
        labels = {tuple(meta["labels"]) for _, _, meta in runs.values()}
        if len(runs) < 2 or len(labels) != 1:
            continue
        short = short_names(sorted(runs))
        order = sorted(runs, key=lambda run: (_strategy_rank(runs[run][2]["strategy"]), short[run]))
        strategies = {short[run]: runs[run][2]["strategy"] for run in order}
        series = [(ylabel, {short[run]: (runs[run][1][row] if row is not None else runs[run][1]) for run in order})
                  for row, ylabel in panels]
        what = "RMS of each sublayer's input and output" if len(panels) > 1 else panels[0][1]
        steps = sorted({at for at, _, _ in runs.values()})
        at = f"step {steps[0]}" if len(steps) == 1 else "last logged step"
        fig = figures.compare_profiles(series, strategies, next(iter(labels)), f"{len(runs)} runs, {at}\n{what}",
                                       xlabel)
        out.mkdir(parents=True, exist_ok=True)
        figures.save_png(fig, out / name)
        print(f"sweep: wrote {out / name}")


def _strategy_rank(strategy: str) -> tuple[int, str]:
    """Standard first, then Block AttnRes by N, then Full, then anything else."""
    if strategy.startswith("Standard"):
        return 0, ""
    if strategy.startswith("Block"):
        digits = "".join(ch for ch in strategy if ch.isdigit())
        return 1, digits.zfill(6)
    return (2, "") if strategy.startswith("Full") else (3, strategy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path,
                        help="a run folder (holding event files) or a sweep folder holding run folders")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: <run>/plots)")
    parser.add_argument("--step", type=int, default=None, help="draw the last logged step at or before this one")
    args = parser.parse_args(argv)
    root: Path = args.folder
    if not root.is_dir():
        print(f"{parser.prog}: error: no such folder: {root.resolve()} (give a run folder, or a sweep folder "
              "holding run folders: the path the end of the run printed)", file=sys.stderr)
        return 2
    runs = find_runs(root)
    if not runs:
        print(f"{parser.prog}: error: no TensorBoard event files under {root} "
              f"(expected {root}/{EVENTS} or {root}/<run>/{EVENTS})", file=sys.stderr)
        return 2
    results = {}
    for run in runs:
        name = "." if run == root else str(run.relative_to(root))
        target = run / "plots" if args.out is None else (args.out if run == root else args.out / name)
        data = plot_run(run, target, args.step)
        if data:
            results[name] = data
    if len(runs) > 1:
        compare(results, args.out or root / "plots")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
