"""What every section of REPORT.md shares: the paper's Table 2, the runs of the study's parts
(experiments/reproduce/run.py), paired effects over seeds with their 95% t interval, tables and
figure files. Loss differences are a share of the baseline's validation loss (percent): nats per
token depend on the tokenizer (ours: 1,024 tokens; the paper's: not ours), a share less so.
Parts whose runs are missing or unfinished say so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from attnres.atomic import read_json
from attnres.results import figures
from attnres.results.summary import find_job_dirs

PAPER = "Kimi Team, *Attention Residuals*, arXiv 2603.15031 (2026)"
METRIC = "val/loss"
PARTS = ("ordering", "blocksize", "depth", "ladder")
# Table 2 (five sizes, 194M to 528M activated parameters): validation loss per strategy
TABLE2 = {"194M": (1.931, 1.909, 1.899), "241M": (1.895, 1.875, 1.874), "296M": (1.829, 1.809, 1.804),
          "436M": (1.766, 1.746, 1.737), "528M": (1.719, 1.693, 1.692)}  # baseline, Block, Full


def _pct(paper: tuple[float, float, float], i: int, j: int = 0) -> float:
    return 100 * (paper[i] - paper[j]) / paper[j]


PAPER_GAPS = {  # percent of the baseline's loss, per Table 2 size
    "block": [_pct(row, 1) for row in TABLE2.values()],
    "full": [_pct(row, 2) for row in TABLE2.values()],
    "full vs block": [100 * (row[2] - row[1]) / row[0] for row in TABLE2.values()],
}


STRATEGIES = {"StandardResidual": "standard", "FullAttentionResidual": "full"}  # else Block: "block N=<n>"


# -- the runs -----------------------------------------------------------------------------------------
@dataclass
class Run:
    part: str
    shape: str
    strategy: str  # standard | full | block N=<n>
    seed: int
    status: str
    loss: float | None
    bpb: float | None
    tokens_per_sec: float | None
    tokens: int
    parameters: int
    non_embedding: int
    path: Path


def load_runs(out: Path) -> list[Run]:
    runs = []
    for part in PARTS:
        for path in find_job_dirs(out / part):
            try:
                cfg = OmegaConf.load(path / ".hydra" / "config.yaml")
            except OSError:
                continue
            found = read_json(path / "metrics.json")
            metrics = found.get("metrics", {})
            target = str(OmegaConf.select(cfg, "residual._target_", default="")).rsplit(".", 1)[-1]
            strategy = STRATEGIES.get(target) or f"block N={int(cfg.num_blocks)}"
            runs.append(Run(part, str(cfg.shape), strategy, int(cfg.seed), str(found.get("status", "unfinished")),
                            metrics.get("val/loss"), metrics.get("val/bpb"),
                            found.get("tokens_per_sec_after_warmup"), int(found.get("tokens_seen") or 0),
                            int(found.get("parameters") or 0), int(found.get("non_embedding_parameters") or 0), path))
    return runs


def finished(runs: Sequence[Run], shape: str, strategy: str) -> dict[int, Run]:
    return {r.seed: r for r in runs if r.shape == shape and r.strategy == strategy and r.status == "finished"
            and isinstance(r.loss, float) and math.isfinite(r.loss)}


def t_interval(values: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    from scipy import stats

    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, (mean - half, mean + half)


@dataclass
class Effect:
    """Per-seed values of a paired quantity (percent), their mean and 95% t interval."""

    per_seed: dict[int, float]

    @property
    def n(self) -> int:
        return len(self.per_seed)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed.values())

    @property
    def ci(self) -> tuple[float, float] | None:
        return t_interval(list(self.per_seed.values()))[1] if self.n >= 2 else None

    def text(self, unit: str = "%") -> str:
        if not self.per_seed:
            return "no runs"
        ci = self.ci
        where = f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else " (one seed, no interval)"
        return f"{self.mean:+.2f}{unit}{where}"


def relative_gap(runs: Sequence[Run], shape: str, candidate: str, baseline: str = "standard") -> Effect:
    """(candidate - baseline) / baseline of val/loss, in percent, paired by seed."""
    a, b = finished(runs, shape, candidate), finished(runs, shape, baseline)
    return Effect({s: 100 * (a[s].loss - b[s].loss) / b[s].loss for s in sorted(set(a) & set(b))})



def paper_range(values: Sequence[float], unit: str = "%") -> str:
    low, high = min(values), max(values)
    return f"{low:+.2f}{unit}" if abs(high - low) < 5e-3 else f"{low:+.2f} to {high:+.2f}{unit}"


def save(fig: Any, path: Path) -> str:
    """Write `fig` to `path` (in the report's figures/ folder); returns the link REPORT.md uses."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figures.save_png(fig, path)
    return link(path)


def link(path: Path) -> str:
    """A figure's path as REPORT.md, beside the figures/ folder, links it."""
    return f"{path.parent.name}/{path.name}"


def mean_sd(values: Sequence[float], digits: int = 4) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def job_counts(runs: Sequence[Run], part: str) -> str:
    mine = [r for r in runs if r.part == part]
    return f"{sum(r.status == 'finished' for r in mine)} of {len(mine)} jobs finished"


def means_table(runs: Sequence[Run], rows: Sequence[tuple[str, str]]) -> list[str]:
    lines = ["| shape | strategy | seeds | val/loss (mean ± sd) | val/bpb (mean ± sd) | tokens/s after warm-up |",
             "|---|---|---|---|---|---|"]
    for shape, strategy in rows:
        got = list(finished(runs, shape, strategy).values())
        if not got:
            lines.append(f"| {shape} | {strategy} | 0 | — | — | — |")
            continue
        tps = [r.tokens_per_sec for r in got if r.tokens_per_sec]
        lines.append(f"| {shape} | {strategy} | {len(got)} | {mean_sd([r.loss for r in got])} | "
                     f"{mean_sd([r.bpb for r in got if r.bpb is not None])} | "
                     f"{f'{statistics.fmean(tps):,.0f}' if tps else '—'} |")
    return lines

