"""Part `blocksize` of the CPU study: REPORT.md's section 2, the paper's Figure 6 at the deep
shape (S = 1, 2, 4, 8 sublayers per block; S = 1 and 4 are part ordering's Full and Block N=4)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from study import Effect, Run, job_counts, relative_gap, save
from verdicts import MARGIN_COLUMN, MarginVerdict, claim, held_together, margin_note, verdict

from attnres.results import figures

# Figure 6 (436M, baseline 1.766): S sublayers per block -> loss (S = 1 is Full)
FIGURE6 = {1: 1.737, 2: 1.746, 4: 1.746, 8: 1.748, 16: 1.753, 32: 1.757}
FIGURE6_BASELINE = 1.766
# -- part blocksize: Figure 6 --------------------------------------------------------------------------
BLOCK_OF_S = {1: "full", 2: "block N=8", 4: "block N=4", 8: "block N=2"}  # at the deep shape, L = 16


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def part_blocksize(runs: Sequence[Run], figs: Path) -> tuple[list[str], list[str]]:
    shape = "deep"
    gaps = {s: relative_gap(runs, shape, name) for s, name in BLOCK_OF_S.items()}
    if not all(g.n for g in gaps.values()):
        missing = [f"S={s}" for s, g in gaps.items() if not g.n]
        return [f"Not every block size has finished runs yet ({', '.join(missing)} missing): "
                "`python experiments/reproduce/run.py --parts ordering,blocksize`."], []
    paper = {s: 100 * (FIGURE6[s] - FIGURE6_BASELINE) / FIGURE6_BASELINE for s in BLOCK_OF_S}
    text = [f"{job_counts(runs, 'blocksize')} (S = 2 and 8; S = 1 and 4 are part ordering's Full and Block N = 4). "
            "S counts sublayers per block, as the paper does (deep shape: L = 16 sublayers, so S = 16 / N). "
            "The paper's points are Figure 6's, at its 436M model against its baseline of 1.766.", "",
            "| S | ours | paper, Figure 6 (% of baseline loss) | ours (% of baseline val/loss, mean [95% CI]) | "
            f"verdict (below the baseline) | {MARGIN_COLUMN} |", "|---|---|---|---|---|---|"]
    claims = []
    for s, name in BLOCK_OF_S.items():
        word = verdict(gaps[s], [paper[s]])
        text.append(f"| {s} | {name} | {paper[s]:+.2f} ({FIGURE6[s]:.3f}) | {gaps[s].text()} | {word} | "
                    f"{MarginVerdict.from_effect(gaps[s]).text()} |")
    text += ["", held_together([(f"S = {s}", MarginVerdict.from_effect(gaps[s])) for s in BLOCK_OF_S])]
    # the trend: per seed, the slope of the gap over log2 S (percent per doubling of S)
    seeds = sorted(set.intersection(*(set(g.per_seed) for g in gaps.values())))
    xs = [math.log2(s) for s in BLOCK_OF_S]
    trend = Effect({seed: _slope(xs, [gaps[s].per_seed[seed] for s in BLOCK_OF_S]) for seed in seeds})
    paper_slope = _slope(xs, [paper[s] for s in BLOCK_OF_S])
    word = verdict(trend, [paper_slope], lower=False)
    text += ["", f"Trend: the least-squares slope of the gap over log2 S, per seed: ours {trend.text(' pt')} per "
                 f"doubling of S; the paper's points give {paper_slope:+.2f} pt (larger blocks lose a little of "
                 "the gain). Verdict: " + word + "."]
    claims.append(claim(word, f"smaller blocks are better, Full (S = 1) best (paper, Figure 6: {paper_slope:+.2f} "
                              f"percentage points of the baseline's loss per doubling of S over S = 1 to 8; ours: "
                              f"{trend.text(' pt')})"))
    worst = max(BLOCK_OF_S, key=lambda s: gaps[s].mean)
    claims.append(claim(verdict(gaps[worst], [paper[worst]]),
                        f"every block size S = 1 to 8 beats the baseline (paper, Figure 6: all of them; ours, "
                        f"the weakest, S = {worst}: {gaps[worst].text()})")
                  + margin_note(("loss", MarginVerdict.from_effect(gaps[worst]))))
    fig = figures.new_figure(5.6, 3.6)
    ax = fig.subplots()
    for seed in seeds:
        ax.plot(list(BLOCK_OF_S), [gaps[s].per_seed[seed] for s in BLOCK_OF_S], color="#1f77b4", alpha=0.25, lw=0.8)
    ax.errorbar(list(BLOCK_OF_S), [gaps[s].mean for s in BLOCK_OF_S],
                yerr=np.array([[gaps[s].mean - gaps[s].ci[0], gaps[s].ci[1] - gaps[s].mean] for s in BLOCK_OF_S]).T,
                color="#1f77b4", marker="o", capsize=3, label="ours (mean, 95% CI; thin: seeds)")
    ax.plot(list(BLOCK_OF_S), [paper[s] for s in BLOCK_OF_S], color="#b22222", marker="s", ls="--",
            label="paper, Figure 6 (436M)")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(BLOCK_OF_S), [str(s) for s in BLOCK_OF_S])
    ax.set_xlabel("S, sublayers per block (1 = Full)")
    ax.set_ylabel("val/loss vs standard (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    text += ["", f"![block size]({save(fig, figs / 'blocksize.png')})"]
    return text, claims

