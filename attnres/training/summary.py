"""Sweep summaries: one row per job in summary.csv and summary.md, and summary.png with the
final validation metric by residual and num_blocks (mean and spread over seeds).

Rebuilt from the run folders alone, so `experiments/summarize.py SWEEP_DIR` can redo it.
"""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from attnres.training.io import atomic_write, read_json

COLUMNS = ["job", "residual", "num_blocks", "seed", "status", "val/loss", "val/bpb", "val/accuracy",
           "tokens_per_sec", "peak_memory_gib", "parameters", "wall_time_s", "slot", "error"]


def _job_row(run_dir: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"job": run_dir.name}
    hydra_dir = run_dir / ".hydra"
    if (hydra_dir / "config.yaml").is_file():
        cfg = OmegaConf.load(hydra_dir / "config.yaml")
        hydra_yaml = hydra_dir / "hydra.yaml"
        choices = OmegaConf.load(hydra_yaml).hydra.runtime.choices if hydra_yaml.is_file() else {}
        row["residual"] = choices.get("residual", "?")
        row["num_blocks"] = cfg.get("num_blocks") if "num_blocks" in cfg.get("residual", {}) else "-"
        row["seed"] = cfg.get("seed")
    metrics = read_json(run_dir / "metrics.json")
    row["status"] = metrics.get("status", "not finished")
    for key in ("val/loss", "val/bpb", "val/accuracy"):
        row[key] = metrics.get("metrics", {}).get(key)
    peak = metrics.get("peak_memory_bytes")
    row.update(
        tokens_per_sec=metrics.get("tokens_per_sec"), peak_memory_gib=peak / 2**30 if peak else None,
        parameters=metrics.get("parameters"), wall_time_s=metrics.get("wall_time_s"),
        slot=metrics.get("slot"), error=metrics.get("error"),
    )
    return row


def short_names(names: list[str]) -> dict[str, str]:
    """Job folder name -> only the overrides that differ between the jobs of the sweep."""
    parsed = {n: dict(kv.split("=", 1) for kv in n.split(",") if "=" in kv) for n in names}
    keys = sorted({k for kv in parsed.values() for k in kv})
    varying = [k for k in keys if len({kv.get(k) for kv in parsed.values()}) > 1]
    return {n: ",".join(f"{k}={parsed[n][k]}" for k in varying if k in parsed[n]) or n for n in names}


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """A row per job folder, plus one per job that was skipped as a duplicate of another."""
    notes = read_json(sweep_dir / "jobs.json")
    rows = {d.name: _job_row(d) for d in sorted(sweep_dir.iterdir()) if (d / ".hydra").is_dir()}
    for name, note in sorted(notes.items()):
        if note.get("status") == "duplicate" and note.get("same_as") in rows:
            rows[name] = {**rows[note["same_as"]], "job": name, "status": "duplicate", "same_as": note["same_as"]}
    short = short_names(sorted(rows))
    for name, row in rows.items():
        row["job"] = short[name]
        if row.get("same_as"):
            row["status"] = f"duplicate of {short[row.pop('same_as')]}"
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


def write_sweep_summary(sweep_dir: str | Path) -> list[dict[str, Any]]:
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: _fmt(r.get(k)) for k in COLUMNS} for r in rows)
    atomic_write(sweep_dir / "summary.csv", lambda f: f.write(buffer.getvalue().encode()))

    kinds = [str(r["status"]).split(" ")[0] for r in rows]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
    lines = [f"# Sweep {sweep_dir.name}", "",
             f"{len(rows)} jobs: {counts}. The job column lists the overrides that differ.", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k)).replace("|", "/") for k in COLUMNS) + " |")
    atomic_write(sweep_dir / "summary.md", lambda f: f.write(("\n".join(lines) + "\n").encode()))
    _plot(sweep_dir, rows)
    return rows


def _plot(sweep_dir: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = primary_metric(rows)
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.get(metric) is not None and not str(r["status"]).startswith("duplicate"):
            label = r.get("residual", "?") + ("" if r.get("num_blocks") in ("-", None) else f" N={r['num_blocks']}")
            groups.setdefault(label, []).append(float(r[metric]))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(groups) + 2), 3.5), dpi=120)
    labels = sorted(groups)
    means = [statistics.fmean(groups[k]) for k in labels]
    spreads = [statistics.stdev(groups[k]) if len(groups[k]) > 1 else 0.0 for k in labels]
    ax.bar(labels, means, yerr=spreads, capsize=4, color="#4C72B0")
    for i, k in enumerate(labels):
        ax.scatter([i] * len(groups[k]), groups[k], color="black", s=10, zorder=3)
    if means:
        low, high = min(min(v) for v in groups.values()), max(max(v) for v in groups.values())
        pad = max(1e-3, 0.15 * (high - low))
        ax.set_ylim(low - pad, high + pad)
    ax.set_ylabel(f"final {metric}")
    ax.set_title(f"{sweep_dir.name}: mean ± std over seeds (dots: runs)", fontsize=9)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write(sweep_dir / "summary.png", lambda f: f.write(buffer.getvalue()))


class SweepSummary(Callback):
    """Hydra callback: writes the summary when a sweep ends, whichever launcher ran it."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            write_sweep_summary(sweep_dir)
            print(f"sweep summary: {sweep_dir / 'summary.md'}")
