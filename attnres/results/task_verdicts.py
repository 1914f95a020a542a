"""Verdicts on downstream tasks: one per strategy and task metric, paired by seed (verdict.py).

A run evaluated on tasks (`eval.tasks=[...]`, attnres-tasks) has their metrics in its metrics.json:
`tasks.metrics` holds `<task>/<metric>` (also in `metrics`). Each such metric that some run of a
sweep has becomes a column of the sweep's summary and gets its own verdicts, with the direction
`verdict.higher_is_better` gives it (accuracy up, bits per byte down).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres.atomic import read_json
from attnres.results import verdict


def attach(rows: list[dict[str, Any]]) -> list[str]:
    """Each row gets the task metrics its run folder recorded; returns the task metric names, in
    the order first seen."""
    keys: list[str] = []
    for row in rows:
        path = row.get("path")
        tasks = read_json(Path(path) / "metrics.json").get("tasks") if path else None
        found = (tasks or {}).get("metrics") if isinstance(tasks, Mapping) else None
        for key, value in (found or {}).items():
            row[key] = value
            if key not in keys:
                keys.append(key)
    return keys


def comparisons(rows: Sequence[Mapping[str, Any]], keys: Sequence[str],
                margin: verdict.Margin | None = None) -> list[verdict.Comparison]:
    """Every strategy against its baseline on every task metric, metric by metric (Holm over the
    strategies within a metric), at `margin` (`verdict.margin_points` for accuracies)."""
    return [c for key in keys for c in verdict.comparisons(rows, key, margin)]


def lines(rows: list[dict[str, Any]], margin: verdict.Margin | None = None) -> list[str]:
    """The verdict sentences on the task metrics of `rows` (attached here if not yet)."""
    return [c.sentence() for c in comparisons(rows, attach(rows), margin)]
