"""The study's per-seed results beside REPORT.md: experiments/reproduce/results/<part>.json, committed.

The runs (experiments/reproduce/runs/) stay on the machine that trained them. A record keeps, for
each run of a part, what the report's comparisons read (what names its configuration, its seed,
status and metrics), so that a later machine can recompute a section's effects, margin verdicts and
power from per-seed values instead of from the printed intervals. report.py writes one for every
part whose runs it holds, each time it builds or splices the report; a part module of its own
(depth_part.py) calls `write_record` the same way and reads its values back with `per_seed`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres.atomic import read_json, write_json

FOLDER = "results"  # beside REPORT.md
VERSION = 1


def write_record(folder: Path, part: str, runs: Sequence[Mapping[str, Any]], source: str,
                 extra: Mapping[str, Any] | None = None) -> Path:
    """`folder/<part>.json`: one mapping per run (JSON values: the keys that name its configuration,
    `seed`, `status` and its metrics by name), sorted so that a rebuild's diff shows only what changed,
    written atomically; `source` says which runs folder it came from; `extra`: what else the part's
    section reads (depth_tuned: the sweep's seeds.json), kept as given."""
    rows = sorted((dict(r) for r in runs), key=lambda r: json.dumps(r, sort_keys=True, default=str))
    path = folder / f"{part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"part": part, "version": VERSION, "source": source, "written": time.strftime("%Y-%m-%d"),
                      "runs": rows, **({"extra": dict(extra)} if extra else {})})
    return path


def read_record(folder: Path, part: str) -> list[dict[str, Any]]:
    """The runs of `folder/<part>.json` ([] when there is no record)."""
    return list(read_json(folder / f"{part}.json").get("runs", []))


def per_seed(runs: Sequence[Mapping[str, Any]], metric: str, **match: Any) -> dict[int, float]:
    """{seed: metric} of the finished runs whose keys equal `match` (e.g. shape="deep", strategy="standard");
    a seed recorded twice is an error, not a silent choice."""
    found: dict[int, float] = {}
    for run in runs:
        value = run.get(metric)
        if run.get("status") != "finished" or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if all(run.get(key) == want for key, want in match.items()):
            if run["seed"] in found:
                raise ValueError(f"seed {run['seed']} recorded twice for {match}")
            found[int(run["seed"])] = float(value)
    return found
