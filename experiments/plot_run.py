"""Render a run's dashboard figures as PNG files from its TensorBoard event files.

    python experiments/plot_run.py outputs/default/residual=block,num_blocks=8   # -> RUN_DIR/plots/
    python experiments/plot_run.py multirun/default                              # every run below it
    python experiments/plot_run.py RUN_DIR --out figures/ --step 500

Each figure is redrawn from the raw array the `depth_dashboard` callback logs beside the image
(tensor summaries `depth/heatmap_data`, `magnitude/plot_data`, `grad_norm/plot_data`, with
their labels as metadata) by the same code that drew the TensorBoard image
(`attnres.training.figures.render`), so the PNGs are those pictures, pixel for pixel:

    heatmap.png     depth-attention weights (AttnRes runs only)
    magnitude.png   RMS of each sublayer's input and output across depth
    grad_norm.png   gradient norm of each Transformer layer

at the last logged step, or the last one at or before `--step`. A run folder is one that holds
a `tb/` folder with event files; given any other folder, every run folder below it is done,
and when two or more of them have the same depth the sweep also gets
`plots/compare_magnitude.png` and `plots/compare_grad_norm.png`, one line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from attnres.training import figures
from attnres.training.summary import short_names

EVENTS = "events.out.tfevents.*"
FILES = {"depth/heatmap": "heatmap.png", "magnitude/plot": "magnitude.png", "grad_norm/plot": "grad_norm.png"}


def find_runs(root: Path) -> list[Path]:
    """`root` itself when it is a run folder, else every run folder below it, sorted."""
    if any((root / "tb").glob(EVENTS)):
        return [root]
    return sorted(tb.parent for tb in root.rglob("tb") if tb.is_dir() and any(tb.glob(EVENTS)))


def read_figure_data(run: Path, step: int | None) -> dict[str, tuple[int, np.ndarray, dict]]:
    """image tag -> (step, raw array, metadata) of each figure the run logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0, "images": 1, "scalars": 1,
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
    """Overlay the runs' output magnitudes and gradient norms when their depths agree."""
    for tag, row, name, ylabel in (("magnitude/plot", 1, "compare_magnitude.png", "output RMS of each sublayer"),
                                   ("grad_norm/plot", None, "compare_grad_norm.png", "gradient norm per layer")):
        runs = {run: data[tag] for run, data in results.items() if tag in data}
        labels = {tuple(meta["labels"]) for _, _, meta in runs.values()}
        if len(runs) < 2 or len(labels) != 1:
            continue
        short = short_names(sorted(runs))
        series = {short[run]: (array[row] if row is not None else array) for run, (_, array, _) in runs.items()}
        xlabel = "sublayer (depth)" if row is not None else "Transformer layer (depth)"
        fig = figures.depth_profile(series, next(iter(labels)), f"{len(runs)} runs, last logged step\n{ylabel}",
                                    ylabel, xlabel)
        out.mkdir(parents=True, exist_ok=True)
        figures.save_png(fig, out / name)
        print(f"sweep: wrote {out / name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a run folder (holding tb/) or a sweep folder holding run folders")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: <run>/plots)")
    parser.add_argument("--step", type=int, default=None, help="draw the last logged step at or before this one")
    args = parser.parse_args(argv)
    root: Path = args.folder
    runs = find_runs(root) if root.is_dir() else []
    if not runs:
        print(f"plot_run.py: error: no TensorBoard event files under {root} "
              f"(expected {root}/tb/{EVENTS} or {root}/<run>/tb/{EVENTS})", file=sys.stderr)
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
