"""A tuned sweep's search, as its state file records it (`<sweep>/tuning/tuning.json`): each arm's
trials on the tuning seeds, their mean, the chosen point, whether it lies on the search's edge,
and the search budget of every arm. Written by `attnres.sweep.tuned.TunedSweeper`; read by the
tuned summary (`tuned_summary.py`). Pure: no Hydra, no torch.

A grid point is an integer exponent k: the value of each searched key is the arm's configured
value times `factor ** k`; k = 0 is the configured value. An Optuna trial is its number.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres.atomic import read_json, write_json

TUNING_DIR = "tuning"  # in the sweep folder: the trials' run folders, tuning.json, optuna.db
STATE = "tuning.json"
#: the sweeper's settings that define a search: a resume with any of them changed is refused
SEARCH_FIELDS = ("method", "metric", "tuning_seeds", "grid", "optuna", "proxy", "baseline", "prune")


def state_path(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / TUNING_DIR / STATE


def read_state(sweep_dir: Path) -> dict[str, Any]:
    """The state file; during the search (or after its sweep died in it) each trial's outcome as its
    run folder says now: the file is written between batches, the trials end one by one."""
    found = read_json(state_path(sweep_dir))
    if not isinstance(found, dict):
        return {}
    if found.get("stage") == "search":
        metric = (found.get("signature") or {}).get("metric", "val/loss")
        for group in found.get("groups", []):
            for trial in group.get("trials", []):
                if trial.get("job") and trial.get("status") not in ("finished", "diverged"):
                    folder = Path(sweep_dir) / (trial.get("same_as") or trial["job"])
                    trial.update(trial_outcome(read_json(folder / "metrics.json"), metric))
    return found


def write_state(sweep_dir: Path, state: Mapping[str, Any]) -> None:
    write_json(state_path(sweep_dir), dict(state))


def is_tuned(sweep_dir: Path) -> bool:
    return bool(read_state(sweep_dir).get("arms"))


def changed_fields(before: Mapping[str, Any], now: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two search definitions (a resume's check)."""
    changed = []
    for key in sorted(set(before) | set(now), key=str):
        a, b = before.get(key), now.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changed += changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key} ({_short(a)} -> {_short(b)})")
    return changed


def _short(value: Any) -> str:
    return "unset" if value is None else str(value).replace(" ", "")


#: outcomes of a trial that the search scores (a non-finite loss is the worst); any other (killed,
#: out of memory, an error, unfinished) says nothing of its values: it runs again, or the search stops
SCORED = ("finished", "diverged")


def trial_outcome(metrics: Mapping[str, Any], metric: str) -> dict[str, Any]:
    """{status, value, error} of a trial from its metrics.json: "finished" with a finite `metric`,
    "diverged" (a non-finite loss or metric), "no metric", or the run's own status ("failed",
    "interrupted", ...; "unfinished" when it wrote none)."""
    value = (metrics.get("metrics") or {}).get(metric)
    status = metrics.get("status") or "unfinished"
    if status == "finished" and not (isinstance(value, (int, float)) and math.isfinite(value)):
        status = "no metric" if value is None else "diverged"
    if status == "failed" and "non-finite" in str(metrics.get("error", "")):
        status = "diverged"
    return {"status": status, "value": value if status == "finished" else None, "error": metrics.get("error")}


# -- values ------------------------------------------------------------------------------------------
def format_value(value: float | int) -> str:
    """An override's value: an int as it is, a float in 6 significant digits (`0.00075`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    return f"{float(value):.6g}"


def scaled(configured: float | int, multiplier: float) -> float | int:
    """The configured value times a multiplier; an int stays an int (rounded, at least 1 when it was)."""
    if isinstance(configured, int) and not isinstance(configured, bool):
        return max(1 if configured >= 1 else 0, int(round(configured * multiplier)))
    return float(f"{float(configured) * multiplier:.6g}")


def grid_range(points: int, down: int = 0, up: int = 0) -> list[int]:
    """The exponents of a grid of `points` (odd) centred on 0, with `down` and `up` points added."""
    half = points // 2
    return list(range(-half - down, half + up + 1))


# -- selection ---------------------------------------------------------------------------------------
def trial_value(trial: Mapping[str, Any]) -> float:
    """A trial's score for selection: its metric; +inf when it diverged or failed (the worst)."""
    value = trial.get("value")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.inf


def point_means(trials: Iterable[Mapping[str, Any]], seeds: Sequence[int]) -> dict[Any, float]:
    """Point -> mean score over the tuning seeds; a point missing a seed's trial is left out."""
    by_point: dict[Any, dict[int, float]] = {}
    for trial in trials:
        by_point.setdefault(trial["point"], {})[trial["seed"]] = trial_value(trial)
    means = {}
    for point, scores in by_point.items():
        if all(s in scores for s in seeds):
            values = [scores[s] for s in seeds]
            means[point] = math.inf if any(math.isinf(v) for v in values) else statistics.fmean(values)
    return means


def best_point(means: Mapping[Any, float]) -> Any:
    """The point of the lowest mean; ties go to the point nearest the configured value (0). None
    when no point has a finite mean."""
    finite = {p: m for p, m in means.items() if math.isfinite(m)}
    if not finite:
        return None
    return min(finite, key=lambda p: (finite[p], abs(p) if isinstance(p, int) else 0, str(p)))


def grid_edge(best: int | None, exponents: Sequence[int]) -> str | None:
    """"down" / "up" when the best exponent is the grid's lowest / highest (a grid of one point
    is at both edges: "both"), else None."""
    if best is None or not exponents:
        return None
    low, high = best == min(exponents), best == max(exponents)
    return "both" if low and high else "down" if low else "up" if high else None


def budget_check(arms: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """Whether every arm had the same search budget, and the sentence that says it: the same
    search (points or trials, tuning seeds) and the same training tokens per trial; an arm whose
    grid grew at an edge has more trials, which the sentence counts."""
    if not arms:
        return True, "no arms"
    if all(a.get("given") for a in arms):  # hydra.sweeper.method=given: the values came from elsewhere
        return True, "no search ran: each arm at its given values (hydra.sweeper.given), chosen outside this sweep"
    initial = {a["label"]: a.get("initial_trials") for a in arms}
    tokens = {a["label"]: a.get("tokens_per_trial") for a in arms}
    trials = {a["label"]: len(a.get("trials", [])) for a in arms}
    rungs = {a["label"]: _rungs(a) for a in arms}
    same_search = len(set(initial.values())) == 1 and len(set(rungs.values())) == 1
    same_tokens = len({t for t in tokens.values()}) == 1
    first = arms[0]
    size = first.get("initial_trials")
    per = (f"{tokens[first['label']]:,} training tokens" if isinstance(tokens[first["label"]], int)
           else "the same steps")
    if same_search and same_tokens:
        text = f"equal across arms: {size} trials each at first, {per} per trial"
        grown = [f"{label} {n}" for label, n in trials.items() if n != size]
        if grown:
            text += f"; grown at an edge to {', '.join(grown)} trials"
        if rungs[first["label"]] != "unpruned":
            steps = ", ".join(f"{label} {a['trained_steps']:,}" for a in arms if (label := a["label"])
                              and isinstance(a.get("trained_steps"), int))
            text += f"; pruned at the same rungs, equal across arms: {rungs[first['label']]}" + \
                (f" (training steps trained: {steps})" if steps else "")
        return True, text
    parts = [f"{label}: {initial[label]} trials of {tokens[label]} tokens, {rungs[label]}" for label in initial]
    return False, "NOT equal across arms (" + "; ".join(parts) + ")"


def _rungs(group: Mapping[str, Any]) -> str:
    """A search's successive-halving rungs in words (tuned_halving.py), "unpruned" without them."""
    prune, steps = group.get("prune") or {}, group.get("rung_steps") or []
    if not prune.get("rungs"):
        return "unpruned"
    at = ", ".join(f"{r:g}" for r in prune["rungs"])
    return (f"rungs at {at} of the steps (steps {', '.join(map(str, steps[:-1]))} of {steps[-1] if steps else '?'}), "
            f"keeping {prune.get('keep'):g} of the points at each")
