"""`tune=lr`: the search stage of a tuned sweep as a log grid per arm (`attnres.sweep.tuned`).

Each arm's grid is `points` values a `factor` apart, centred on the arm's configured value (the
keys of `grid.keys` scaled together), each run on every tuning seed. After each batch, an arm whose
best mean lies on its grid's edge grows one point on that side, at most `max_extend` a side, and
the grown points run as the next batch; the sweep says each time. The decisions follow from the
finished trials alone, so a resumed sweep replays them and runs only what is missing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from attnres.results import tuning

log = logging.getLogger(__name__)


def grid_search(sweeper: Any, sweep_dir: Path, state: dict[str, Any]) -> bool:
    """Stage 1 with method=grid; False when stopped."""
    points, factor, extend = int(sweeper.grid["points"]), float(sweeper.grid["factor"]), int(sweeper.grid["max_extend"])
    for group in state["groups"]:
        group.update(extended={"down": 0, "up": 0})
    launched: set[tuple[str, int, int]] = set()
    while True:
        batch, pending = [], []
        for group in state["groups"]:
            group["exponents"] = tuning.grid_range(points, group["extended"]["down"], group["extended"]["up"])
            for k in group["exponents"]:
                values = {key: tuning.scaled(v, factor ** k) for key, v in group["centre"].items()}
                for seed in sweeper.tuning_seeds:
                    if (group["label"], k, seed) not in launched:
                        launched.add((group["label"], k, seed))
                        overrides = sweeper.trial_overrides(group, values, seed)
                        batch.append(overrides)
                        pending.append((group, k, seed, values, overrides))
        if not batch:
            break
        if len(state["groups"]) and batch:
            log.info(f"tuned sweep: search, {len(batch)} trial runs")
        trials = [{"point": k, "seed": seed, "values": values, "job": sweeper.run_dir(overrides)[0],
                   "status": "unfinished"} for group, k, seed, values, overrides in pending]
        for (group, *_), trial in zip(pending, trials, strict=True):
            group["trials"].append(trial)  # recorded before they run: a sweep killed mid-batch still names them
        tuning.write_state(sweep_dir, state)
        ok = sweeper.launch_trials(batch)
        for (*_, overrides), trial in zip(pending, trials, strict=True):
            trial.update(sweeper.trial_result(overrides))
        tuning.write_state(sweep_dir, state)
        if not ok:
            return False
        grew = False
        for group in state["groups"]:
            best = tuning.best_point(tuning.point_means(group["trials"], sweeper.tuning_seeds))
            grew = grow_at_edge(group, best, extend) or grew
        if not grew:
            break
    for group in state["groups"]:
        record_choice(group, tuning.point_means(group["trials"], sweeper.tuning_seeds), factor)
    tuning.write_state(sweep_dir, state)
    return True


def grow_at_edge(group: dict[str, Any], best: Any, extend: int, how: str = "") -> bool:
    """One point more on each side of the arm's grid where its best lies on the edge (at most `extend`
    a side), said on the terminal; whether it grew. `how`: what the line adds (the pruned grid's)."""
    grew = False
    edge = tuning.grid_edge(best, group["exponents"])
    for side in ("down", "up"):
        if edge in (side, "both") and group["extended"][side] < extend:
            group["extended"][side] += 1
            grew = True
            print(f"tuned sweep: {group['label']}'s best {', '.join(group['centre'])} is at the grid's "
                  f"{'lower' if side == 'down' else 'upper'} edge; the grid grows one point "
                  f"{side} ({group['extended'][side]} of {extend}){how}", flush=True)
    return grew


def record_choice(group: dict[str, Any], means: dict[Any, float], factor: float) -> None:
    """The arm's choice, the best of `means` (point -> mean metric), and what the summary reads of it."""
    best = tuning.best_point(means)
    group["means"] = {str(k): m for k, m in means.items()}
    group["chosen"] = best
    group["chosen_multiplier"] = None if best is None else factor ** best
    group["chosen_values"] = None if best is None else \
        {key: tuning.scaled(v, factor ** best) for key, v in group["centre"].items()}
    group["chosen_mean"] = None if best is None else means[best]
    group["edge"] = tuning.grid_edge(best, group["exponents"])
