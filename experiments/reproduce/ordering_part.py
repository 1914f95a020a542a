"""Part `ordering` of the CPU study: its three REPORT.md sections, all from the deep shape's runs
of standard, Block N=4 and Full. Section 1, the loss ordering (the paper's Table 2); section 4,
hidden-state magnitudes and gradient norms across depth (Figure 5b, 5c); section 5, the depth
attention's heatmaps (Figure 8), from the runs' dashboards.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from study import PAPER_GAPS, Effect, Run, finished, job_counts, means_table, paper_range, relative_gap, save
from verdicts import (
    CONTRADICTED,
    MARGIN_COLUMN,
    NOT_RESOLVED,
    REPRODUCED,
    MarginVerdict,
    claim,
    held_together,
    margin_note,
    verdict,
)

from attnres.results import figures

NEAR_UNIFORM = 1.10  # a source must get 10% more than its uniform share on every seed to count


def part_ordering(runs: Sequence[Run]) -> tuple[list[str], list[str]]:
    shape = "deep"
    if not finished(runs, shape, "standard"):
        return ["No runs yet: `python experiments/reproduce/run.py --parts ordering`."], []
    rows = [("block", "block N=4", "standard"), ("full", "full", "standard"), ("full vs block", "full", "block N=4")]
    text = [f"{job_counts(runs, 'ordering')}. The paper's gaps are Table 2's, one per size (194M to 528M activated "
            "parameters, 38.7B to 119B tokens, 8,192-token context); ours are at the deep shape (8 x 40, "
            "154k non-embedding parameters, 4.9M tokens, 128-token context): about 1,000 to 3,000 times "
            "fewer parameters and 10,000 times fewer tokens.", "",
            "| comparison | paper, Table 2 (5 sizes, % of baseline loss) | ours (% of baseline val/loss, mean "
            f"[95% CI], 5 seeds) | seeds favouring | verdict | {MARGIN_COLUMN} |", "|---|---|---|---|---|---|"]
    claims, shared = [], []
    for name, candidate, baseline in rows:
        effect = relative_gap(runs, shape, candidate, baseline)
        paper = PAPER_GAPS[name]
        word = verdict(effect, paper)
        wins = sum(v < 0 for v in effect.per_seed.values())
        label = f"{candidate} vs {baseline}"
        margin = MarginVerdict.from_effect(effect)
        if baseline == "standard":
            shared.append((label, margin))
        text.append(f"| {label} | {', '.join(f'{v:+.2f}' for v in paper)} | {effect.text()} | "
                    f"{wins}/{effect.n} | {word} | {margin.text()} |")
        what = {"block": "Block AttnRes (N = 4, S = 4) has a lower loss than the standard residual",
                "full": "Full AttnRes has a lower loss than the standard residual",
                "full vs block": "Full AttnRes has a lower loss than Block AttnRes"}[name]
        claims.append(claim(word, f"{what} (paper, Table 2: {paper_range(paper)} of the baseline's loss; "
                                  f"ours: {effect.text()}, deep shape)") + margin_note(("loss", margin)))
    text += ["", held_together(shared), "", *means_table(runs, [(shape, "standard"), (shape, "block N=4"),
                                                                (shape, "full")])]
    return text, claims



# -- training dynamics: Figure 5b, 5c; depth attention: Figure 8 -------------------------------------------
def _figure_data(run: Run) -> dict:
    from plot_run import read_figure_data

    return read_figure_data(run.path, None) or {}


def part_dynamics(runs: Sequence[Run], figs: Path) -> tuple[list[str], list[str]]:
    shape = "deep"
    data = {name: {seed: _figure_data(r) for seed, r in finished(runs, shape, name).items()}
            for name in ("standard", "block N=4", "full")}
    data = {name: {s: d for s, d in per.items() if "magnitude/plot" in d and "grad_norm/plot" in d}
            for name, per in data.items()}
    if not data["standard"]:
        return ["No dashboard data yet (part ordering's runs log it)."], []
    growth = {n: {s: float(d["magnitude/plot"][1][0][-1] / d["magnitude/plot"][1][0][0]) for s, d in per.items()}
              for n, per in data.items()}
    spread = {n: {s: float(d["grad_norm/plot"][1].max() / d["grad_norm/plot"][1].min()) for s, d in per.items()}
              for n, per in data.items()}
    step = next(iter(data["standard"].values()))["magnitude/plot"][0]
    text = [f"From the deep shape's runs of part ordering, the dashboards' last probe (step {step}). Input RMS is "
            "the hidden state each sublayer reads (for the standard residual the running sum, for AttnRes the "
            "depth-attention mix); gradient norms are per Transformer layer.", "",
            "| strategy | seeds | input RMS, last sublayer over first (mean [min, max]) | gradient norm, largest "
            "layer over smallest (mean [min, max]) |", "|---|---|---|---|"]
    for name in data:
        g, r = list(growth[name].values()), list(spread[name].values())
        if g:
            text.append(f"| {name} | {len(g)} | {statistics.fmean(g):.2f}x [{min(g):.2f}, {max(g):.2f}] | "
                        f"{statistics.fmean(r):.2f}x [{min(r):.2f}, {max(r):.2f}] |")
    claims = []
    for name in ("block N=4", "full"):
        seeds = sorted(set(growth[name]) & set(growth["standard"]))
        if not seeds:
            continue
        mag = Effect({s: math.log(growth[name][s] / growth["standard"][s]) for s in seeds})
        grad = Effect({s: math.log(spread[name][s] / spread["standard"][s]) for s in seeds})
        claims.append(claim(verdict(mag, [-1e-9]),
                            f"hidden-state magnitude stays bounded over depth with {name} but grows with the standard "
                            f"residual (paper, Figure 5b): growth {statistics.fmean(growth[name].values()):.2f}x "
                            f"against {statistics.fmean(growth['standard'].values()):.2f}x; log of the ratio, paired "
                            f"by seed, {mag.text('')} (no size in the paper: {CONTRADICTED} needs the other side of "
                            "zero)"))
        claims.append(claim(verdict(grad, [-1e-9]),
                            f"gradient norms are more uniform across depth with {name} (paper, Figure 5c): largest "
                            f"over smallest {statistics.fmean(spread[name].values()):.2f}x against "
                            f"{statistics.fmean(spread['standard'].values()):.2f}x; log of the ratio {grad.text('')}"))
    mags = {n: np.stack([d["magnitude/plot"][1] for d in per.values()]) for n, per in data.items() if per}
    grads = {n: np.stack([d["grad_norm/plot"][1] for d in per.values()]) for n, per in data.items() if per}
    labels = next(iter(data["standard"].values()))["magnitude/plot"][2]["labels"]
    panels = [("input RMS (what each sublayer reads)", {n: m[:, 0].mean(0) for n, m in mags.items()}),
              ("output RMS (what it writes)", {n: m[:, 1].mean(0) for n, m in mags.items()})]
    fig = figures.compare_profiles(panels, {n: n for n in mags}, labels, "deep shape: mean over seeds, last probe",
                                   "sublayer (depth)")
    mag_png = save(fig, figs / "magnitude.png")
    n_layers = next(iter(grads.values())).shape[1]
    fig = figures.compare_profiles([("gradient norm per layer", {n: g.mean(0) for n, g in grads.items()})],
                                   {n: n for n in grads}, [f"L{k}" for k in range(n_layers)],
                                   "deep shape: mean over seeds, last probe", "Transformer layer (depth)")
    grad_png = save(fig, figs / "grad_norm.png")
    text += ["", f"![magnitudes]({mag_png}) ![gradient norms]({grad_png})"]
    return text, claims


def _locality(grid: np.ndarray) -> tuple[float, float] | None:
    """(newest source, embedding) weight over the uniform 1/S, averaged over the rows with two or
    more sources (a row's sources are its non-NaN cells; the newest is the last)."""
    newest, embedding = [], []
    for row in grid:
        valid = row[~np.isnan(row)]
        if len(valid) >= 2:
            newest.append(valid[-1] * len(valid))
            embedding.append(valid[0] * len(valid))
    return (statistics.fmean(newest), statistics.fmean(embedding)) if newest else None


def _above_one(values: Sequence[float]) -> str:
    if min(values) > NEAR_UNIFORM:
        return REPRODUCED
    return CONTRADICTED if max(values) < 1.0 else NOT_RESOLVED


def part_heatmaps(runs: Sequence[Run], figs: Path) -> tuple[list[str], list[str]]:
    text, claims = [], []
    for name in ("block N=4", "full"):
        got = [d["depth/heatmap"] for d in (_figure_data(r) for r in finished(runs, "deep", name).values())
               if "depth/heatmap" in d]
        if not got:
            continue
        step, _, meta = got[0]
        with warnings.catch_warnings():  # a column no row reaches is NaN in every seed: NaN in the mean too
            warnings.simplefilter("ignore", RuntimeWarning)
            grid = np.nanmean(np.stack([a for _, a, _ in got]), axis=0)
        png = save(figures.render("depth/heatmap", grid, {**meta, "strategy": f"{meta['strategy']}, deep shape, "
                                                                         f"mean of {len(got)} seeds"}, step),
                    figs / f"heatmap_{name.replace(' ', '_').replace('=', '')}.png")
        per_seed = [x for x in (_locality(a) for _, a, _ in got) if x is not None]
        local, reuse = [x[0] for x in per_seed], [x[1] for x in per_seed]
        text += [f"**{name}** (step {step}): the newest source gets {statistics.fmean(local):.2f}x its uniform "
                 f"share on average over rows (seeds {', '.join(f'{v:.2f}' for v in local)}), the embedding "
                 f"{statistics.fmean(reuse):.2f}x ({', '.join(f'{v:.2f}' for v in reuse)}).", "",
                 f"![heatmap {name}]({png})", ""]
        claims.append(claim(_above_one(local), f"diagonal locality (paper, Figure 8), {name}: newest source at "
                                               f"{statistics.fmean(local):.2f}x the uniform weight ({REPRODUCED}: "
                                               f"above {NEAR_UNIFORM}x on every seed; {CONTRADICTED}: below 1x on "
                                               "every seed)"))
        claims.append(claim(_above_one(reuse), f"embedding reuse (paper, Figure 8), {name}: embedding at "
                                               f"{statistics.fmean(reuse):.2f}x the uniform weight"))
    return text or ["No heatmap data yet (part ordering's runs log it)."], claims

