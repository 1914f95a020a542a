"""Rebuild a sweep's summary.csv, summary.md and summary.png from its run folders (`attnres-summarize`).

    attnres-summarize multirun/<name>
    attnres-summarize multirun/a multirun/b --out multirun/ab   # several sweeps as one
    attnres-summarize multirun/<name> --margin 1% --margin-points 2   # judged against other margins

(`python -m attnres.results.summarize` and `python experiments/summarize.py` in a clone are the same.)

Useful after editing runs, after a sweep whose own process died before its end, or to pair runs
that several sweeps made (a baseline sweep and the sweeps of its variants). The counts name each
status as the summary does ("timed out", "cancelled", ...); exit status 0, or 2 for a bad folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnres.config import margins
from attnres.config.errors import ConfigError
from attnres.results import tuning
from attnres.results.summary import (
    collect_rows,
    find_job_dirs,
    format_counts,
    margin_from_runs,
    primary_metric,
    status_counts,
    verdict_lines,
    write_sweep_summary,
)
from attnres.results.tuned_summary import write_tuned_summary
from attnres.results.verdict import Margin, comparisons


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dirs", type=Path, nargs="+", help="a sweep folder, e.g. multirun/default (or several)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the summary of several sweeps (default: the one sweep folder)")
    parser.add_argument("--margin", default=None, metavar="SHARE",
                        help="the smallest difference that matters for losses and bpb, a share of the baseline's "
                             "mean, e.g. 0.5%% (default: the runs' verdict.margin)")
    parser.add_argument("--margin-points", default=None, metavar="POINTS",
                        help="the same for accuracies and task scores, in points, 1 = 0.01 accuracy "
                             "(default: the runs' verdict.margin_points)")
    args = parser.parse_args(argv)
    try:  # a bad value, here or in the runs' config: one line, before anything is written
        share = margins.share(args.margin, "--margin") if args.margin is not None else None
        points = margins.points(args.margin_points, "--margin-points") if args.margin_points is not None else None
    except ConfigError as err:
        print(f"{parser.prog}: error: {str(err).replace('--margin=', '--margin ').replace('-points=', '-points ')}",
              file=sys.stderr)
        return 2
    for folder in args.sweep_dirs:
        if not folder.is_dir() or not find_job_dirs(folder):
            print(f"{parser.prog}: error: {folder} holds no run folders (subfolders with .hydra/); "
                  "pass the folder `attnres-run -m` wrote, e.g. multirun/default", file=sys.stderr)
            return 2
    if len(args.sweep_dirs) > 1 and args.out is None:
        print(f"{parser.prog}: error: with several sweep folders, name where their summary goes with --out DIR",
              file=sys.stderr)
        return 2
    try:
        found = margin_from_runs(collect_rows(*args.sweep_dirs))
    except ConfigError as err:
        print(f"{parser.prog}: error: the runs' config: {err}; or pass --margin and --margin-points", file=sys.stderr)
        return 2
    margin = Margin(found.share if share is None else share, found.points if points is None else points)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = write_sweep_summary(args.out, *args.sweep_dirs, margin=margin)
        out = args.out
    elif tuning.is_tuned(args.sweep_dirs[0]):  # a tuned sweep (tune=lr): the tuned verdict leads
        rows, lines = write_tuned_summary(args.sweep_dirs[0], margin=margin)
        print(f"{format_counts(status_counts([r['status'] for r in rows]))} -> {args.sweep_dirs[0]}/summary.md, "
              "summary.csv, summary.png, tuning.png")
        for line in lines:
            print(line)
        return 0
    else:
        rows = write_sweep_summary(args.sweep_dirs[0], margin=margin)
        out = args.sweep_dirs[0]
    metric = primary_metric(rows)
    counts = format_counts(status_counts([row["status"] for row in rows]))
    print(f"{counts} -> {out}/summary.md, summary.csv, summary.png ({metric})")
    for row in rows:
        print(f"  {row['job']:<40} {row['status']:<12} {metric}={row.get(metric)}")
    for line in verdict_lines(comparisons(rows, metric, margin), rows):
        print(f"verdict: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
