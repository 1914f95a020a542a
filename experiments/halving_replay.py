"""What successive halving would have chosen, and saved, on a finished unpruned tuned sweep.

    python experiments/halving_replay.py multirun/<name> --rungs 0.25,0.5 --keep 0.5

For each arm of the sweep (`tuning/tuning.json`) it replays `hydra.sweeper.prune` (the rule of
attnres/sweep/tuned_halving.py, growth at the grid's edge included) from each trial's validation
curve in its TensorBoard events, read at the rung steps, and prints the unpruned choice, the pruned
choice and the training steps pruning saves. The replay is exact when the rungs are validation
steps of the trials: a run paused at a step and resumed is the run that never paused
(tests/training/test_pause.py), so a pruned trial's value at a rung is the unpruned trial's value
there. A rung that is not a validation step, or a grown point the unpruned sweep never ran, is
refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from attnres.config.errors import ConfigError
from attnres.results import tuning
from attnres.results.summary_figure import validation_curve
from attnres.sweep import tuned_halving


def _values(sweep_dir: Path, group: dict[str, Any], steps: list[int], metric: str) -> dict:
    found: dict[tuple[Any, int], dict[int, float]] = {}
    for trial in group.get("trials", []):
        if trial.get("status") == "diverged":
            found[(trial["point"], trial["seed"])] = dict.fromkeys(steps, math.inf)
            continue
        folder = sweep_dir / (trial.get("same_as") or trial["job"])
        curve = validation_curve(folder, metric)
        if curve is None:
            raise ConfigError(f"{folder} has no {metric} curve in TensorBoard events; replay a sweep that ran with "
                              "logger=tensorboard")
        at = dict(zip(curve[0].tolist(), curve[1].tolist(), strict=True))
        absent = [s for s in steps if s not in at]
        if absent:
            raise ConfigError(f"step {absent[0]} is no validation step of {folder.name} (it validated at "
                              f"{', '.join(map(str, sorted(at)))}); choose rungs on validation steps")
        found[(trial["point"], trial["seed"])] = {s: at[s] for s in steps}
    return found


def replay_group(sweep_dir: Path, state: dict[str, Any], group: dict[str, Any], rungs: list[float],
                 keep: float) -> dict[str, Any]:
    """The pruned search of one arm, run on the recorded curves: its choice and steps trained."""
    signature = state["signature"]
    grid, seeds, metric = signature["grid"], state["tuning_seeds"], signature["metric"]
    first = sweep_dir / group["trials"][0]["job"]
    max_steps = int(OmegaConf.load(first / ".hydra" / "config.yaml").trainer.max_steps)
    steps = tuned_halving.rung_steps(rungs, max_steps)
    recorded = _values(sweep_dir, group, steps, metric)
    known: dict[tuple[Any, int], dict[int, float]] = {}
    reached: dict[Any, int] = {}
    extended = {"down": 0, "up": 0}
    while True:
        exponents = tuning.grid_range(int(grid["points"]), extended["down"], extended["up"])
        todo, alive = tuned_halving.next_runs(exponents, known, seeds, steps, keep)
        for point, step in todo:  # what the pruned sweep would run next: its values from the curves
            for seed in seeds:
                if (point, seed) not in recorded:
                    raise ConfigError(f"the pruned search of {group['label']} grows to point {point}, which the "
                                      "unpruned sweep never ran; replay it with other rungs")
                known.setdefault((point, seed), {})[step] = recorded[(point, seed)][step]
            reached[point] = step
        if todo:
            continue
        best = tuning.best_point(tuned_halving.full_length_means(alive, known, seeds, steps[-1]))
        edge, grew = tuning.grid_edge(best, exponents), False
        for side in ("down", "up"):
            if edge in (side, "both") and extended[side] < int(grid["max_extend"]):
                extended[side] += 1
                grew = True
        if not grew:
            break
    pruned_steps = sum(reached.values()) * len(seeds)
    full_steps = len(group["trials"]) * max_steps
    return {"arm": group["label"], "unpruned": group.get("chosen"), "pruned": best, "steps": steps,
            "pruned_steps": pruned_steps, "unpruned_steps": full_steps, "saved": 1 - pruned_steps / full_steps,
            "factor": float(grid["factor"])}


def replay(sweep_dir: Path, rungs: list[float], keep: float) -> list[dict[str, Any]]:
    state = tuning.read_state(sweep_dir)
    if not state.get("groups") or state.get("stage") not in ("verdict", "done"):
        raise ConfigError(f"{sweep_dir} holds no finished tuned search (tuning/tuning.json); run the tuned sweep "
                          "to its end first")
    if (state.get("signature") or {}).get("method") != "grid" or (state["signature"].get("prune") or {}).get("rungs"):
        raise ConfigError(f"{sweep_dir} is not an unpruned grid search; replay a tune=lr sweep without "
                          "hydra.sweeper.prune")
    tuned_halving.check_prune({"rungs": rungs, "keep": keep}, "grid")
    return [replay_group(sweep_dir, state, group, rungs, keep) for group in state["groups"]]


def _fraction_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text} is not a comma-separated list of fractions, e.g. 0.25,0.5") from err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="a finished, unpruned tuned sweep folder (tune=lr)")
    parser.add_argument("--rungs", type=_fraction_list, default=[0.25, 0.5], help="fractions of trainer.max_steps")
    parser.add_argument("--keep", type=float, default=0.5, help="the share of points that go on at each rung")
    args = parser.parse_args(argv)
    try:
        rows = replay(args.sweep, args.rungs, args.keep)
    except ConfigError as err:
        print(f"halving_replay: error: {err}", file=sys.stderr)
        return 2
    print(f"successive halving replayed on {args.sweep}: rungs {', '.join(f'{r:g}' for r in args.rungs)} of "
          f"the steps, keep {args.keep:g}")
    for row in rows:
        def say(point: Any) -> str:
            return "none" if point is None else f"point {point} ({row['factor'] ** point:g}x the configured value)"
        same = "the same choice" if row["pruned"] == row["unpruned"] else "ANOTHER CHOICE"
        print(f"  {row['arm']}: unpruned {say(row['unpruned'])}, pruned {say(row['pruned'])}: {same}; "
              f"training steps {row['pruned_steps']:,} of {row['unpruned_steps']:,} "
              f"({row['saved']:.0%} saved; rung steps {', '.join(map(str, row['steps']))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
