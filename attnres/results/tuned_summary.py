"""The summary of a tuned sweep (`tune=lr`, `attnres.sweep.tuned`): summary.md, summary.csv,
summary.png and tuning.png, from `tuning/tuning.json` and the run folders.

It leads with the tuned verdict: each arm at its own best on the verdict seeds, paired by seed
with its baseline arm at the baseline's own best (`verdict.compare`: interval, seeds favouring,
cost). Then each arm's chosen values with the mean over the tuning seeds, whether the choice lies
on the search's edge, the search budget of every arm (checked equal), the shared-value verdict
beside it when the folder holds runs at the configured values (`hydra.sweeper.untuned=true`),
and every trial of the search.
"""

from __future__ import annotations

import csv
import io
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnres.atomic import atomic_write
from attnres.results import sequential, tuning, verdict
from attnres.results.summary import (
    COLUMNS,
    _fmt,
    collect_rows,
    filled_columns,
    margin_from_runs,
    primary_metric,
    verdict_intro,
)


def _rows_by_job(sweep_dir: Path, names: set[str]) -> dict[str, dict[str, Any]]:
    rows = collect_rows(sweep_dir, only=names) if names else []
    return {Path(r["path"]).relative_to(sweep_dir).as_posix(): r for r in rows if "path" in r}


def _compare(state: Mapping[str, Any], rows: Mapping[str, Mapping[str, Any]], field: str,
             metric: str, margin: verdict.Margin) -> list[verdict.Comparison]:
    """Each arm against its baseline arm on the runs of `field` (Holm over the arms of one baseline)."""
    arms = {a["label"]: a for a in state.get("arms", [])}
    found = []
    for arm in arms.values():
        if arm.get("is_baseline"):
            continue
        base = arms.get(arm.get("baseline") or "")
        cand_rows = [rows[j] for j in (arm.get(field) or {}).values() if j in rows]
        base_rows = [rows[j] for j in (base.get(field) or {}).values() if j in rows] if base else []
        found.append((cand_rows, base_rows, arm["label"], base["label"] if base else None))
    return verdict.compare_arms(found, metric, margin)


def choice_line(group: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    """`block: optim.optimizer.lr=0.006 (2x the configured 0.003), mean val/loss 4.2101 over tuning
    seeds 1000, 1001; 10 trials, the grid grown 1 point up`."""
    signature = state.get("signature", {})
    metric, seeds = signature.get("metric", "val/loss"), state.get("tuning_seeds", [])
    trials = len(group.get("trials", []))
    if "chosen" not in group:  # stopped (Ctrl-C, SIGTERM, a kill) before the search ended
        done = sum(1 for t in group.get("trials", []) if t.get("status") == "finished")
        return (f"{group['label']}: not chosen yet: the search was stopped with {done} of its trials finished; "
                "the same command with resume=true continues it")
    if group.get("given"):  # hydra.sweeper.method=given (attnres/sweep/tuned_given.py): no search ran
        ratios = ", ".join(f"{group['centre_ratio'][k]:.3g}x the configured {tuning.format_value(c)}"
                           for k, c in group.get("configured", {}).items())
        values = ", ".join(f"{k}={tuning.format_value(v)}" for k, v in group["centre"].items())
        return f"{group['label']}: {values} ({ratios}), given (hydra.sweeper.given): no search ran"
    if group.get("chosen_values") is None:
        return f"{group['label']}: no choice: none of its {trials} trials finished with a finite {metric}"
    values = ", ".join(f"{k}={tuning.format_value(v)}" for k, v in group["chosen_values"].items())
    multiplier = group.get("chosen_multiplier")
    centre = ", ".join(tuning.format_value(v) for v in group.get("centre", {}).values())
    rel = f" ({multiplier:g}x the configured {centre})" if multiplier is not None else ""
    text = f"{group['label']}: {values}{rel}, mean {metric} {group['chosen_mean']:.4f} over tuning seeds " \
           f"{', '.join(map(str, seeds))}; {trials} trials"
    grown = [f"{n} point{'s' * (n != 1)} {side}" for side, n in (group.get("extended") or {}).items() if n]
    if grown:
        text += f", the grid grown {' and '.join(grown)}"
    edge = group.get("edge")
    if edge:
        where = {"up": "UPPER EDGE", "down": "LOWER EDGE", "both": "EDGES (ONE POINT)"}.get(edge, edge)
        fix = ("raise hydra.sweeper.grid.max_extend or move the configured value"
               if state.get("signature", {}).get("method") == "grid" else "widen hydra.sweeper.optuna.space")
        which = f" ({group['edge_key']})" if group.get("edge_key") else ""
        text += f"; STILL AT THE SEARCH'S {where}{which}: the best value may lie beyond it ({fix})"
    failed = sum(1 for t in group.get("trials", []) if t.get("status") not in ("finished", "pruned"))
    pruned = sum(1 for t in group.get("trials", []) if t.get("status") == "pruned")
    if pruned:
        text += f"; {pruned} trial{'s' * (pruned != 1)} stopped at a rung (successive halving)"
    if failed:
        text += f"; {failed} trial{'s' * (failed != 1)} diverged or failed (scored as the worst)"
    return text


def lines(state: Mapping[str, Any], tuned: Sequence[verdict.Comparison],
          shared: Sequence[verdict.Comparison]) -> list[str]:
    """The lines a tuned sweep prints at its end, each with its own head: the tuned verdict first."""
    out = [f"verdict, each arm at its own best: {c.sentence()}" for c in tuned] or \
        ["verdict: none: no baseline arm (residual=standard, or hydra.sweeper.baseline) among the arms"]
    out += [f"chosen: {choice_line(g, state)}" for g in state.get("groups", [])]
    equal, budget = tuning.budget_check(state.get("groups", []))
    out.append(f"search budget: {budget}")
    out += [f"beside it, every arm at the configured values: {c.sentence()}" for c in shared if c.mean is not None]
    return out


def write_tuned_summary(sweep_dir: str | Path, title: str | None = None, margin: verdict.Margin | None = None
                        ) -> tuple[list[dict[str, Any]], list[str]]:
    """summary.md/.csv/.png and tuning.png of a tuned sweep, the verdicts at `margin` (by default the
    runs' own); returns its verdict rows and lines."""
    sweep_dir = Path(sweep_dir)
    state = tuning.read_state(sweep_dir)
    arms = state.get("arms", [])
    tuned_jobs = {j for a in arms for j in (a.get("jobs") or {}).values()}
    shared_jobs = {j for a in arms for j in (a.get("untuned_jobs") or {}).values()}
    rows = _rows_by_job(sweep_dir, tuned_jobs | shared_jobs)
    metric = primary_metric(list(rows.values())) if rows else state.get("signature", {}).get("metric", "val/loss")
    margin = margin or margin_from_runs(list(rows.values()))
    tuned, shared = _compare(state, rows, "jobs", metric, margin), _compare(state, rows, "untuned_jobs", metric, margin)
    for found in (tuned, shared):  # seeds on demand: the design's repeated intervals
        sequential.apply(found, sequential.read_record(sweep_dir))
    text = lines(state, tuned, shared)
    title = title or sweep_dir.name
    seeds = ", ".join(map(str, state.get("tuning_seeds", [])))
    md = [f"# Tuned sweep {title}", "",
          "## Verdict, each arm at its own best", "",
          verdict_intro(metric, margin, f"Each arm ran at the values its search chose on the tuning seeds ({seeds}), "
                        "then on the verdict seeds, which the search never read; against its baseline arm at the "
                        "baseline's own best"), ""]
    md += [f"- {c.sentence()}" for c in tuned] or ["- no tuned verdict: no baseline arm among the arms"]
    md += ["", "## What each arm chose", ""] + [f"- {choice_line(g, state)}" for g in state.get("groups", [])]
    equal, budget = tuning.budget_check(state.get("groups", []))
    groups = state.get("groups", [])
    given = bool(groups) and all(g.get("given") for g in groups)  # hydra.sweeper.method=given: no search to show
    search = "" if given else f" The search: {_search_text(state)}."
    md += ["", "## Search budget", "", f"{budget[0].upper()}{budget[1:]}.{search}", ""]
    md += ["## Beside it: every arm at the configured values", ""]
    if any(c.mean is not None for c in shared):
        md += [f"- {c.sentence()}" for c in shared]
    else:
        md += ["No runs at the configured values on the verdict seeds in this folder "
               "(`hydra.sweeper.untuned=true` runs them; a plain sweep into the same folder counts too)."]
    if not given:
        md += ["", "## The search", "", "![search](tuning.png)", ""] + _trials_table(state)
    verdict_rows = []
    for arm in arms:
        for stage, field in (("tuned", "jobs"), ("configured", "untuned_jobs")):
            for job in (arm.get(field) or {}).values():
                if job in rows:
                    verdict_rows.append({**rows[job], "stage": stage, "arm": arm["label"]})
    by_stage = {"tuned": {c.label: c for c in tuned}, "configured": {c.label: c for c in shared}}
    for row in verdict_rows:  # each row's own difference and its stage's verdict: the shared-lr one checks too
        c = by_stage[row["stage"]].get(row["arm"])
        if c is not None:
            row.update(c.columns())
            row["diff"] = c.diffs.get(row.get("seed"))
    columns = ["stage", "arm", *filled_columns(verdict_rows)]
    md += ["", "## Verdict runs", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(_fmt(r.get(k)).replace("|", "/") for k in columns) + " |" for r in verdict_rows]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["stage", "arm", *COLUMNS], extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: _fmt(r.get(k)) for k in ["stage", "arm", *COLUMNS]} for r in verdict_rows)
    atomic_write(sweep_dir / "summary.csv", lambda f: f.write(buffer.getvalue().encode()))
    atomic_write(sweep_dir / "summary.md", lambda f: f.write(("\n".join(md) + "\n").encode()))
    _draw(sweep_dir, state, tuned, [c for c in shared if c.mean is not None], metric, title)
    return verdict_rows, text


def _search_text(state: Mapping[str, Any]) -> str:
    sig = state.get("signature", {})
    if sig.get("method") == "grid":
        grid = sig.get("grid") or {}
        text = (f"a {grid.get('points')}-point log grid (factor {grid.get('factor')}) of "
                f"{', '.join(grid.get('keys', []))} around each arm's configured value, grown up to "
                f"{grid.get('max_extend')} points a side where the best lay on an edge")
    else:
        optuna = sig.get("optuna") or {}
        text = (f"an Optuna study per arm ({optuna.get('sampler', 'tpe')} sampler, seed {optuna.get('seed', 0)}), "
                f"{optuna.get('trials')} trials of {', '.join(optuna.get('space') or {})}")
    proxy = sig.get("proxy") or {}
    if proxy:
        text += f", at {', '.join(f'{k}={v}' for k, v in proxy.items())} (the proxy); the choice carries over as " \
                "the same multiple of each job's configured value"
    return text + f"; each point on every tuning seed, selected on the lowest mean {sig.get('metric', 'val/loss')}"


def _trials_table(state: Mapping[str, Any]) -> list[str]:
    seeds = state.get("tuning_seeds", [])
    out = ["| arm | values | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | |",
           "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for group in state.get("groups", []):
        means = tuning.point_means(group.get("trials", []), seeds)
        by_point: dict[Any, dict[int, Mapping[str, Any]]] = {}
        for t in group.get("trials", []):
            by_point.setdefault(t["point"], {})[t["seed"]] = t
        for point in sorted(by_point, key=lambda p: (isinstance(p, str), p)):
            trials = by_point[point]
            first = next(iter(trials.values()))
            values = ", ".join(f"{k}={tuning.format_value(v)}" for k, v in (first.get("values") or {}).items())
            cells = [_cell(trials.get(s)) for s in seeds]
            mean = means.get(point)
            chosen = "chosen" if point == group.get("chosen") else ""
            out.append(f"| {group['label']} | {values} | " + " | ".join(cells) +
                       f" | {_fmt(mean) if mean is not None else ''} | {chosen} |")
    return out


def _cell(trial: Mapping[str, Any] | None) -> str:
    if trial is None:
        return ""
    if trial.get("status") == "pruned":  # successive halving: its value at the rung it stopped at
        at = trial.get("pruned_at")
        return f"pruned at step {at}: {_fmt((trial.get('rungs') or {}).get(str(at)))}"
    return _fmt(trial.get("value")) if trial.get("status") == "finished" else str(trial.get("status"))


def _draw(sweep_dir: Path, state: Mapping[str, Any], tuned: Sequence[verdict.Comparison],
          shared: Sequence[verdict.Comparison], metric: str, title: str) -> None:
    """tuning.png, and summary.png: both verdicts (each arm at its own best, and at the configured
    values when the folder has those runs) beside the search."""
    from attnres.results import summary_figure, tuning_figure

    def both_verdicts():
        fig, search_axes = summary_figure.tuned_verdicts_figure(tuned, shared, metric, title,
                                                                len(tuning_figure.search_keys(state)) or 1)
        tuning_figure.draw_search(search_axes, state)
        return fig

    for name, make in (("tuning.png", lambda: tuning_figure.search_figure(state, title)),
                       ("summary.png", both_verdicts)):
        try:
            fig = make()
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png")
        except Exception as err:  # a figure that cannot be drawn must not lose the tables
            print(f"summary: {name} not drawn ({type(err).__name__}: {err}); summary.md and summary.csv are "
                  f"written; redraw with attnres-summarize {sweep_dir}", file=sys.stderr, flush=True)
            continue
        atomic_write(sweep_dir / name, lambda f, b=buffer: f.write(b.getvalue()))


def tuned_comparisons(sweep_dir: str | Path, state: Mapping[str, Any], margin: verdict.Margin | None = None
                      ) -> list[verdict.Comparison]:
    """The tuned verdict's comparisons on the verdict runs so far (seeds on demand reads them at each look)."""
    jobs = {j for a in state.get("arms", []) for j in (a.get("jobs") or {}).values()}
    rows = _rows_by_job(Path(sweep_dir), jobs)
    metric = primary_metric(list(rows.values())) if rows else state.get("signature", {}).get("metric", "val/loss")
    return _compare(state, rows, "jobs", metric, margin or margin_from_runs(list(rows.values())))
