"""Sweep summaries: the verdicts first, then one row per job, in summary.md and summary.csv,
and summary.png: each configuration's difference from its paired standard baseline (interval
and per-seed dots, zero marked) beside the validation curves over steps.

Rebuilt from the run folders alone, so `attnres-summarize SWEEP_DIR` can redo it. A run
folder is any folder below the sweep folder that holds `.hydra/`; a job is labelled by the
overrides of `.hydra/overrides.yaml` that differ between the jobs, not by its folder name, and a
configuration by those less the seed. Verdicts: `attnres.results.verdict` (DESIGN.md section 6).
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnres.atomic import atomic_write, read_json, write_json
from attnres.config.naming import split_overrides
from attnres.results import sequential, summary_figure, task_verdicts, verdict

COLUMNS = ["job", "config", "residual", "num_blocks", "seed", "status", "val/loss", "val/bpb", "val/accuracy",
           "tokens_per_sec", "peak_memory_gib", "parameters", "wall_time_s", "slot", "error", *verdict.COLUMNS]
#: configuration keys that do not change what a run computes, left out when matching baselines
NOT_COMPARED = ("seed", "name", "resume", "ckpt_path", "overwrite", "compile", "keep_freed_memory",
                "trainer.enable_progress_bar", "data.num_workers", "callbacks", "logger", "verdict")
#: the residual strategy's own keys: a baseline differs from its candidates in these only
STRATEGY_KEYS = ("residual", "num_blocks")
#: how a job ended, in the order counts are listed; "unfinished": no status (never ran, or killed
#: before it could say; also killed while continuing a finished run: metrics.json "running");
#: "duplicate": the same run as another job of the sweep, not run again; "diverged": a tuned sweep's
#: trial whose loss went non-finite (attnres.sweep.tuned: a finding of its search, not a failure);
#: under SLURM (slurm.py) a job that ended without saying how: "cancelled" (also before it ran),
#: "preempted", "timed out", "lost" (a node failure, or no record of how it ended)
STATUS_ORDER = ("finished", "diverged", "failed", "interrupted", "cancelled", "preempted", "timed out", "lost",
                "unfinished", "duplicate")
#: the keys that do not name a run folder (conf/config.yaml: hydra.job.config.override_dirname)
DEFAULT_EXCLUDED = ("name", "tune", "resume", "ckpt_path", "overwrite", "trainer.enable_progress_bar",
                    "data.num_workers", "verdict.margin", "verdict.margin_points")


def find_job_dirs(sweep_dir: Path) -> list[Path]:
    """Every run folder (a folder holding `.hydra/`) below `sweep_dir`, at any depth, sorted."""
    found = []
    for folder, subfolders, _ in os.walk(sweep_dir):
        if ".hydra" in subfolders and Path(folder) != Path(sweep_dir):
            found.append(Path(folder))
            subfolders.clear()  # a run folder holds no other run folder
        else:
            subfolders[:] = [d for d in subfolders if not d.startswith(".")]
    return sorted(found)


def job_overrides(run_dir: Path) -> dict[str, str] | None:
    """The overrides that name this run (`.hydra/overrides.yaml` less the excluded keys), or None."""
    hydra_dir = run_dir / ".hydra"
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(hydra_dir / "overrides.yaml"))
    except (OSError, ValueError):
        return None
    excluded: Any = DEFAULT_EXCLUDED
    try:
        excluded = OmegaConf.load(hydra_dir / "hydra.yaml").hydra.job.config.override_dirname.exclude_keys
    except Exception:  # no hydra.yaml (hand-made folder) or another layout: the defaults
        pass
    return overrides_by_key([str(o) for o in overrides or []], excluded)


def overrides_by_key(overrides: list[str], excluded: Any = ()) -> dict[str, str]:
    """`key=value` strings as {key: value}, leaving out the keys in `excluded` (and bare items)."""
    parsed = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+~") not in excluded and not key.startswith("hydra."):  # hydra.*: names no job
            parsed[key] = value
    return parsed


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: repr(value)}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_keys(cfg: DictConfig) -> tuple[tuple, tuple]:
    """(exact, match): the configuration less the keys that do not change a run and the residual
    strategy's own, as hashable tuples; `match` also leaves out `verdict.IGNORED_FOR_BASELINE`."""
    flat = {k: v for k, v in _flatten(OmegaConf.to_container(cfg, resolve=False)).items()
            if not _under(k, NOT_COMPARED + STRATEGY_KEYS)}
    exact = tuple(sorted(flat.items()))
    return exact, tuple(item for item in exact if not _under(item[0], verdict.IGNORED_FOR_BASELINE))


def _job_row(run_dir: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"job": run_dir.name, "path": run_dir}
    hydra_dir = run_dir / ".hydra"
    if (hydra_dir / "config.yaml").is_file():
        cfg = OmegaConf.load(hydra_dir / "config.yaml")
        hydra_yaml = hydra_dir / "hydra.yaml"
        choices = OmegaConf.load(hydra_yaml).hydra.runtime.choices if hydra_yaml.is_file() else {}
        row["residual"] = choices.get("residual", "?")
        row["num_blocks"] = cfg.get("num_blocks") if "num_blocks" in cfg.get("residual", {}) else "-"
        row["seed"] = cfg.get("seed")
        row["is_baseline"] = row["residual"] == "standard"
        row["exact"], row["match"] = config_keys(cfg)
    metrics = read_json(run_dir / "metrics.json")
    status = metrics.get("status")  # "running": continued and never ended (killed): its numbers are gone
    row["status"] = status if status and status != "running" else "unfinished"
    for key in ("val/loss", "val/bpb", "val/accuracy"):
        row[key] = metrics.get("metrics", {}).get(key)
    peak = metrics.get("peak_memory_bytes")
    row.update(
        tokens_per_sec=metrics.get("tokens_per_sec"), peak_memory_gib=peak / 2**30 if peak else None,
        tokens_per_sec_after_warmup=metrics.get("tokens_per_sec_after_warmup"),  # the verdicts' tokens/s ratio
        machine_load=metrics.get("machine_load"),  # whether that ratio was measured on a busy machine (cost.py)
        parameters=metrics.get("parameters"), wall_time_s=metrics.get("wall_time_s"),
        slot=metrics.get("slot"), error=metrics.get("error"),
    )
    return row


def job_labels(overrides: dict[str, dict[str, str]]) -> dict[str, str]:
    """Job name -> only the overrides (key -> value) that differ between the jobs, as k=v,k=v."""
    keys = sorted({k for kv in overrides.values() for k in kv})
    varying = [k for k in keys if len({kv.get(k) for kv in overrides.values()}) > 1]
    return {n: ",".join(f"{k}={kv[k]}" for k in varying if k in kv) or n for n, kv in overrides.items()}


#: a sweep folder's names of its jobs for TensorBoard's HParams table (`write_trial_names`)
TRIAL_NAMES = "trial_names.json"


def write_trial_names(sweep_dir: Path, overrides: dict[str, dict[str, str]]) -> dict[str, str]:
    """Name each job of a sweep (job folder -> its overrides) for TensorBoard's HParams table, where
    a long run folder name shows as its first characters, the same for every job: the overrides that
    differ between the jobs, then the sweep's folder name, `residual=block,seed=0 (quick)` (a name
    TensorBoard groups by: unique across sweeps of one logdir, and across the earlier sweeps' runs in
    this folder, whose overrides count too). Written to `<sweep_dir>/trial_names.json`, which each
    job's `HParamsSummary` reads (`trial_name`); returns the names written."""
    sweep_dir = Path(sweep_dir)
    everyone = {d.relative_to(sweep_dir).as_posix(): job_overrides(d) for d in find_job_dirs(sweep_dir)}
    everyone = {name: found for name, found in everyone.items() if found is not None}
    everyone.update(overrides)
    labels = job_labels(everyone)
    earlier = read_json(sweep_dir / TRIAL_NAMES)
    names = {**(earlier if isinstance(earlier, dict) else {}),
             **{n: f"{labels[n]} ({sweep_dir.name})" for n in overrides}}
    write_json(sweep_dir / TRIAL_NAMES, names)
    return names


def trial_name(run_dir: Path) -> str | None:
    """The name its sweep gave this run for the HParams table (`write_trial_names`), or None."""
    run_dir = Path(run_dir)
    for base in (run_dir.parent, run_dir.parent.parent):  # a tuned sweep's trials: <sweep>/tuning/<run>
        names = read_json(base / TRIAL_NAMES)
        name = names.get(run_dir.relative_to(base).as_posix()) if isinstance(names, dict) else None
        if isinstance(name, str) and name:
            return name
    return None


def config_labels(overrides: dict[str, dict[str, str]]) -> dict[str, str]:
    """Job name -> its configuration's label: the overrides that differ between the jobs, less the
    seed, short (`block N=4 shape=deep`; `residual=` and `num_blocks=` read as strategy and N)."""
    keys = sorted({k for kv in overrides.values() for k in kv} - {"seed"})
    varying = [k for k in keys if len({kv.get(k) for kv in overrides.values()}) > 1]
    if "residual" in varying:  # the strategy first
        varying.remove("residual")
        varying.insert(0, "residual")

    def short(key: str, value: str) -> str:
        return value if key == "residual" else f"N={value}" if key == "num_blocks" else f"{key}={value}"

    return {n: " ".join(short(k, kv[k]) for k in varying if k in kv) or "all jobs" for n, kv in overrides.items()}


def short_names(names: list[str]) -> dict[str, str]:
    """Job folder name -> only the overrides that differ between the jobs of the sweep (parsed from
    the names; `collect_rows` reads each job's `.hydra/overrides.yaml` instead)."""
    return job_labels({n: overrides_by_key(split_overrides(Path(n).name)) for n in names})


def status_counts(statuses: list[str]) -> Counter:
    """How many jobs ended each way; "duplicate of <job>" counts as "duplicate", every other status
    as it is written ("timed out", "not finished")."""
    return Counter("duplicate" if str(s).startswith("duplicate of ") else str(s) for s in statuses)


def format_counts(counts: Counter) -> str:
    """`4 jobs, 3 finished, 1 failed`: the statuses in STATUS_ORDER, then any others."""
    kinds = [k for k in STATUS_ORDER if counts.get(k)] + sorted(k for k in counts if k not in STATUS_ORDER)
    total = sum(counts.values())
    return ", ".join([f"{total} job{'' if total == 1 else 's'}", *(f"{counts[k]} {k}" for k in kinds)])


def collect_rows(sweep_dir: Path, *more_dirs: Path, only: Collection[str] | None = None) -> list[dict[str, Any]]:
    """A row per run folder, plus one per job that was skipped as a duplicate of another; with
    `more_dirs`, the runs of all those folders together (labelled as one sweep); with `only`, the
    job folders (relative to `sweep_dir`) of one sweep, not the earlier sweeps' in the same folder."""
    rows, overrides = {}, {}
    for folder in (Path(sweep_dir), *map(Path, more_dirs)):
        prefix = f"{folder.name}/" if more_dirs else ""
        notes = read_json(folder / "jobs.json")
        for run_dir in find_job_dirs(folder):
            name = prefix + run_dir.relative_to(folder).as_posix()
            if only is not None and name not in only:
                continue
            rows[name] = _job_row(run_dir)
            found = job_overrides(run_dir)
            overrides[name] = found if found is not None else overrides_by_key(split_overrides(run_dir.name))
        for name, note in sorted(notes.items()):
            if note.get("status") == "duplicate" and prefix + str(note.get("same_as")) in rows:
                same_as = prefix + note["same_as"]
                rows[prefix + name] = {**rows[same_as], "job": name, "status": "duplicate", "same_as": same_as}
                listed = note.get("overrides")
                overrides[prefix + name] = (overrides_by_key(listed, DEFAULT_EXCLUDED) if listed is not None
                                            else overrides_by_key(split_overrides(Path(name).name)))
    labels, configs = job_labels(overrides), config_labels(overrides)
    for name, row in rows.items():
        row["job"], row["config"] = labels[name], configs[name]
        if row.get("num_blocks") == "-":  # a strategy that does not read num_blocks: N is not part of it
            row["config"] = " ".join(t for t in row["config"].split(" ") if not t.startswith("N=")) or row["residual"]
        if row.get("same_as"):
            row["status"] = f"duplicate of {labels[row.pop('same_as')]}"
    order = sorted(rows.values(), key=lambda r: (str(r.get("residual")), str(r.get("num_blocks")),
                                                 str(r.get("seed")), r["job"]))
    return order


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def primary_metric(rows: list[dict[str, Any]]) -> str:
    for key in ("val/bpb", "val/accuracy", "val/loss"):
        if any(r.get(key) is not None for r in rows):
            return key
    return "val/loss"


def terminal_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a person reads it at the end of a sweep: job, status, the primary metric,
    tokens per second and wall time, aligned."""
    metric = primary_metric(rows)
    tasks = task_verdicts.attach(rows)  # eval.tasks: a column per task metric
    header = ["job", "status", metric, *tasks, "tokens/s", "wall s"]
    body = [[str(r["job"]), str(r["status"]), _fmt(r.get(metric)), *(_fmt(r.get(k)) for k in tasks),
             _fmt(r.get("tokens_per_sec")), _fmt(r.get("wall_time_s"))] for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *body])


MD_COLUMNS = [c for c in COLUMNS if c not in verdict.COLUMNS or c == "diff"]


def filled_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns of summary.md some job fills (`val/accuracy` only for synthetic data, `error`
    only when a job failed), `job` and `status` always; summary.csv keeps every column."""
    return [c for c in MD_COLUMNS if c in ("job", "status") or any(_fmt(r.get(c)) for r in rows)]


def margin_from_runs(rows: list[dict[str, Any]]) -> verdict.Margin:
    """The margin the sweep's runs were configured with (`verdict:` of a run's .hydra/config.yaml), or
    the defaults for runs older than it; a bad value there is a ConfigError."""
    for row in rows:
        path = Path(row["path"]) / ".hydra" / "config.yaml" if row.get("path") else None
        if path is not None and path.is_file():
            node = OmegaConf.load(path).get("verdict")
            if node is not None:
                return verdict.Margin.from_config(node)
    return verdict.Margin()


def attach_verdicts(rows: list[dict[str, Any]], metric: str, margin: verdict.Margin | None = None,
                    record: dict[str, Any] | None = None) -> list[verdict.Comparison]:
    """The comparisons of the sweep; each row gets its configuration's verdict columns and
    `diff`, its own difference from the baseline run of the same seed. With seeds on demand's
    `record` (sequential.read_record), the intervals are the design's repeated ones."""
    found = verdict.comparisons(rows, metric, margin)
    sequential.apply(found, record or {})
    by_config = {c.label: c for c in found}
    for row in rows:
        comparison = by_config.get(row.get("config"))
        if comparison is not None:
            row.update(comparison.columns())
            row["diff"] = comparison.diffs.get(row.get("seed"))
    return found


def verdict_intro(metric: str, margin: verdict.Margin, what: str = "Each configuration against the "
                  "standard-residual runs of the same configuration") -> str:
    """The paragraph above a summary's verdicts: what the words mean (docs/sweeps.md#verdicts)."""
    return (f"{what}, paired by seed: the mean difference of {metric} with its 95% interval (Student t; at "
            f"1 - 0.05/K, with Holm's p, when K configurations share a baseline), judged against the margin "
            f"({margin.describe(metric)}; points for accuracies): better or worse by at least the margin, by less "
            "than it, equivalent within it (the interval inside it, TOST), or not resolved; 2 seeds never "
            "name a winner. Then the seeds that favour each side, the smallest difference these seeds detect "
            "at 80% power and the seeds the margin needs, and the cost as ratios to the baseline with a 95% "
            "interval.")


def verdict_lines(found: list[verdict.Comparison], rows: list[dict[str, Any]]) -> list[str]:
    if found:
        return [c.sentence() for c in found]
    if not any(r.get("is_baseline") for r in rows):
        return ["No verdicts: no residual=standard runs in this sweep to compare with."]
    return ["No verdicts: every configuration of this sweep is a standard-residual baseline."]


def write_sweep_summary(sweep_dir: str | Path, *more_dirs: Path, title: str | None = None,
                        only: Collection[str] | None = None, margin: verdict.Margin | None = None
                        ) -> list[dict[str, Any]]:
    """summary.csv, summary.md and summary.png in `sweep_dir`, from its runs (and those of
    `more_dirs`; with `only`, of the sweep that just ran alone), the verdicts at `margin` (by default
    the runs' own, `margin_from_runs`). Returns the rows, with their verdict columns."""
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir, *more_dirs, only=only)
    names = [d.relative_to(sweep_dir).as_posix() for d in find_job_dirs(sweep_dir)]
    left_out = 0 if only is None else sum(name not in only for name in names)
    metric = primary_metric(rows)
    margin = margin or margin_from_runs(rows)
    record = sequential.read_record(sweep_dir)  # seeds on demand: the design's intervals
    found = attach_verdicts(rows, metric, margin, record)
    task_keys = task_verdicts.attach(rows)  # eval.tasks: one more column and verdict per task metric
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[*COLUMNS, *task_keys], extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: _fmt(r.get(k)) for k in [*COLUMNS, *task_keys]} for r in rows)
    atomic_write(sweep_dir / "summary.csv", lambda f: f.write(buffer.getvalue().encode()))

    total, _, counts = format_counts(status_counts([r["status"] for r in rows])).partition(", ")
    lines = [f"# Sweep {title or sweep_dir.name}", "", "## Verdicts", "", verdict_intro(metric, margin), ""]
    lines += [f"- {line}" for line in verdict_lines(found, rows)]
    lines += [f"- {c.sentence()}" for c in task_verdicts.comparisons(rows, task_keys, margin)]
    if record.get("stopped"):  # seeds on demand: where the sweep stopped, and why
        lines += ["", f"Seeds on demand: {record['stopped']} ({sequential.describe(record['design'])})."]
    lines += ["", "## Jobs", "",
              f"{total}{': ' + counts if counts else ''}. The job column lists the overrides that differ; "
              f"diff is the run's {metric} minus its baseline's at the same seed.", ""]
    if left_out > 0:
        lines[-1:-1] = [f"This folder also holds {left_out} run(s) of earlier sweeps, not listed here; "
                        f"`attnres-summarize {sweep_dir}` lists every run in it.", ""]
    columns = filled_columns(rows) + task_keys
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k)).replace("|", "/") for k in columns) + " |")
    atomic_write(sweep_dir / "summary.md", lambda f: f.write(("\n".join(lines) + "\n").encode()))
    try:  # the table and the verdicts are written; a figure that cannot be drawn must not lose them
        fig = summary_figure.summary_figure(found, rows, metric, title or sweep_dir.name)
        buffer_png = io.BytesIO()
        fig.savefig(buffer_png, format="png")
    except Exception as err:  # any plotting failure: say so in one line and go on
        print(f"summary: summary.png not drawn ({type(err).__name__}: {err}); summary.md and summary.csv are "
              f"written; redraw with attnres-summarize {sweep_dir}", file=sys.stderr, flush=True)
        return rows
    atomic_write(sweep_dir / "summary.png", lambda f: f.write(buffer_png.getvalue()))
    return rows
