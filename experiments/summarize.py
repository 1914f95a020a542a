"""Rebuild a sweep's summary.csv, summary.md and summary.png from its run folders.

    python experiments/summarize.py multirun/<name>

Useful after a SLURM sweep (whose launcher does not write the summary) or after editing runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnres.training.summary import find_job_dirs, format_counts, primary_metric, status_counts, write_sweep_summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a sweep folder, e.g. multirun/default")
    args = parser.parse_args()
    if not args.sweep_dir.is_dir() or not find_job_dirs(args.sweep_dir):
        print(f"summarize: {args.sweep_dir} holds no run folders (subfolders with .hydra/); "
              "pass the folder `attnres-run -m` wrote, e.g. multirun/default", file=sys.stderr)
        return 2
    rows = write_sweep_summary(args.sweep_dir)
    metric = primary_metric(rows)
    counts = format_counts(status_counts([row["status"] for row in rows]))
    print(f"{counts} -> {args.sweep_dir}/summary.md, summary.csv, summary.png ({metric})")
    for row in rows:
        print(f"  {row['job']:<40} {row['status']:<12} {metric}={row.get(metric)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
