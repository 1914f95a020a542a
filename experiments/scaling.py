"""Compute equivalence from a sweep over model sizes, strategies and seeds.

    attnres-run -m experiment=scaling_ladder          # or any sweep over sizes x residual x seed
    python experiments/scaling.py multirun/scaling_ladder

For each run: training FLOPs C = 6 N tokens + 6 n_layer T D tokens (attnres/results/scaling.py
says why). Per strategy: a fit L(C) = a (C / C0)^-b + c over the model sizes. For each AttnRes
size: the multiple of its compute at which the standard baseline's fit reaches the same loss,
with a 95% bootstrap interval over seeds, and their geometric mean over sizes. Writes
scaling.md, scaling.csv and scaling.png into the sweep folder and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from attnres.atomic import atomic_write, read_json
from attnres.results.scaling import (
    PowerLaw,
    bootstrap_multipliers,
    cells_from_runs,
    fit_power_law,
    geometric_mean,
    multipliers,
    training_flops,
)
from attnres.results.summary import collect_rows

BASELINE = "standard"


def run_record(row: dict[str, Any], metric: str) -> dict[str, Any] | None:
    """A finished run's strategy, size, seed, compute and loss, or None when it lacks them."""
    path = Path(row["path"])
    metrics, cfg_file = read_json(path / "metrics.json"), path / ".hydra" / "config.yaml"
    if not cfg_file.is_file() or metrics.get("status") != "finished":
        return None
    cfg = OmegaConf.load(cfg_file)
    n_layer, width = int(OmegaConf.select(cfg, "model.n_layer")), int(OmegaConf.select(cfg, "model.n_embd"))
    seq_len = int(OmegaConf.select(cfg, "data.block_size"))
    params = metrics.get("non_embedding_parameters")
    if params is None:  # a run from before metrics.json recorded it: the transformer's own count
        params = 12 * n_layer * width * width
    tokens = metrics.get("tokens_seen") or 0
    return {"strategy": str(row.get("residual")), "size": f"{n_layer}x{width}", "parameters": int(params),
            "seed": row.get("seed"), "status": "finished", metric: metrics.get("metrics", {}).get(metric),
            "compute": training_flops(params, tokens, n_layer, seq_len, width), "tokens": tokens}


def _fmt_interval(interval: tuple[float, float] | None) -> str:
    return "not reached in most resamples" if interval is None else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("sweep_dir", type=Path, help="the folder of a sweep over model sizes (and strategies, seeds)")
    parser.add_argument("--metric", default="val/loss", help="final metric to fit (default val/loss; val/bpb "
                                                             "gives the same multipliers for byte data)")
    parser.add_argument("--samples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"scaling: {args.sweep_dir} is not a folder; pass the folder `attnres-run -m` wrote, "
              "e.g. multirun/scaling_ladder", file=sys.stderr)
        return 2
    if args.samples < 100:
        print("scaling: --samples must be at least 100 for a 95% interval", file=sys.stderr)
        return 2
    try:
        result = analyse(args.sweep_dir, args.metric, args.samples)
    except NotEnoughSizesError as err:
        print(f"scaling: {err}", file=sys.stderr)
        return 2
    print("\n".join(result["summary"]))
    fit = result["baseline_fit"]
    print(f"-> {args.sweep_dir / 'scaling.md'}, scaling.csv, scaling.png (fit of {BASELINE}: a={fit.a:.4g}, "
          f"b={fit.b:.4g}, c={fit.c:.4g})")
    return 0


class NotEnoughSizesError(ValueError):
    pass


def analyse(sweep_dir: Path, metric: str = "val/loss", samples: int = 2000,
            rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Fit, multipliers and intervals of a sweep; writes scaling.md, .csv and .png into it.
    `rows` (of `collect_rows`, from any folders) replaces the sweep's own runs.
    Returns summary (lines), baseline_fit, fits, geomean {strategy: x}, intervals, and multipliers
    {(strategy, size): x or None}."""
    rows = collect_rows(sweep_dir) if rows is None else rows
    records = [r for r in (run_record(row, metric) for row in rows) if r]
    cells = cells_from_runs(records, metric)
    baseline = [c for c in cells if c.strategy == BASELINE]
    others = [c for c in cells if c.strategy != BASELINE]
    sizes = sorted({c.size for c in baseline})
    if len(sizes) < 3:
        raise NotEnoughSizesError(f"{sweep_dir} has finished residual=standard runs at {len(sizes)} model size(s); "
                             "the fit a*C^-b + c needs at least 3 (run experiment=scaling_ladder, or sweep "
                             "model.n_embd / model.n_layer with residual=standard among the strategies)")

    fits: dict[str, PowerLaw | None] = {}
    for strategy in sorted({c.strategy for c in cells}):
        mine = [c for c in cells if c.strategy == strategy]
        try:
            fits[strategy] = fit_power_law([c.mean_compute for c in mine], [c.mean_loss for c in mine])
        except ValueError:
            fits[strategy] = None
    base_fit, found = multipliers(baseline, others)
    intervals = bootstrap_multipliers(baseline, others, samples=samples)

    lines = [f"# Compute equivalence: {sweep_dir.name}", "",
             f"C = 6 N tokens + 6 n_layer T D tokens (FLOPs; N non-embedding parameters). Fit per strategy: "
             f"{metric} = a (C / C0)^-b + c. Multiplier: the compute at which the {BASELINE} fit reaches an "
             f"AttnRes point's {metric}, over that point's compute (> 1: AttnRes matches a baseline trained "
             "with more compute). Intervals: 95% bootstrap over seeds.", ""]
    summary, geomean = [], {}
    for strategy in sorted({c.strategy for c in others}):
        values = [found[(c.strategy, c.size)] for c in others if c.strategy == strategy]
        if all(v is not None for v in values):
            mean = geomean[strategy] = geometric_mean(values)
            summary.append(f"{strategy} vs {BASELINE}: {mean:.2f}x compute (geometric mean over {len(values)} sizes, "
                           f"95% bootstrap {_fmt_interval(intervals.get(strategy))})")
        else:
            summary.append(f"{strategy} vs {BASELINE}: at some sizes its loss is below the baseline fit's "
                           "irreducible term: no multiplier there (see the table)")
    lines += [f"- {s}" for s in summary]
    lines += ["", f"| strategy | size | N | seeds | compute (FLOPs) | {metric} | multiplier | 95% interval |",
              "|---|---|---|---|---|---|---|---|"]
    table = []
    for c in cells:
        m = found.get((c.strategy, c.size))
        row = {"strategy": c.strategy, "size": c.size, "parameters": c.parameters, "seeds": len(c.loss),
               "compute": c.mean_compute, metric: c.mean_loss, "multiplier": m,
               "ci": intervals.get((c.strategy, c.size)) if c.strategy != BASELINE else None}
        table.append(row)
        mult = "" if c.strategy == BASELINE else ("below the fit's floor" if m is None else f"{m:.2f}x")
        ci = "" if c.strategy == BASELINE else _fmt_interval(row["ci"])
        lines.append(f"| {c.strategy} | {c.size} | {c.parameters:,} | {len(c.loss)} | {c.mean_compute:.3g} | "
                     f"{c.mean_loss:.4f} | {mult} | {ci} |")
    lines += ["", "| strategy | a | b | c (irreducible) | C0 |", "|---|---|---|---|---|"]
    for strategy, fit in fits.items():
        lines.append(f"| {strategy} | " + (" | ".join(f"{v:.4g}" for v in (fit.a, fit.b, fit.c, fit.c0))
                                           if fit else "fewer than 3 sizes | | | ") + " |")
    out = sweep_dir
    atomic_write(out / "scaling.md", lambda f: f.write(("\n".join(lines) + "\n").encode()))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["strategy", "size", "parameters", "seeds", "compute", metric,
                                                "multiplier", "ci_low", "ci_high"])
    writer.writeheader()
    for row in table:
        ci = row.pop("ci")
        writer.writerow({**row, "ci_low": ci[0] if ci else "", "ci_high": ci[1] if ci else ""})
    atomic_write(out / "scaling.csv", lambda f: f.write(buffer.getvalue().encode()))
    _plot(out / "scaling.png", records, cells, fits, metric, " / ".join(summary))
    return {"summary": summary, "baseline_fit": base_fit, "fits": fits, "geomean": geomean, "intervals": intervals,
            "multipliers": found}


def _plot(path: Path, records, cells, fits, metric: str, title: str) -> None:
    import numpy as np

    from attnres.results.figures import new_figure, strategy_colours

    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    names = sorted(fits)
    for name, colour in zip(names, strategy_colours(names), strict=True):
        runs = [r for r in records if r["strategy"] == name and r.get(metric) is not None]
        ax.scatter([r["compute"] for r in runs], [r[metric] for r in runs], s=12, color=colour, alpha=0.45)
        mine = [c for c in cells if c.strategy == name]
        ax.scatter([c.mean_compute for c in mine], [c.mean_loss for c in mine], s=40, color=colour,
                   edgecolors="black", linewidths=0.6, label=f"{name} (mean over seeds)", zorder=3)
        if fits[name] is not None:
            xs = np.geomspace(min(c.mean_compute for c in mine) / 1.5, max(c.mean_compute for c in mine) * 1.5, 100)
            fit = fits[name]
            ax.plot(xs, fit(xs), color=colour, linewidth=1.2,
                    label=f"{name}: {fit.a:.3g} (C/{fit.c0:.2g})^-{fit.b:.3g} + {fit.c:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 2.5, not 2.5 x 10^0
        axis(FormatStrFormatter("%.2f"))
    ax.set_xlabel("training compute C (FLOPs)", fontsize=9)
    ax.set_ylabel(f"final {metric}", fontsize=9)
    ax.set_title(title, fontsize=8, wrap=True)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write(path, lambda f: f.write(buffer.getvalue()))


if __name__ == "__main__":
    sys.exit(main())
