"""The verdict words of REPORT.md and the rule that picks one (every section's claims use these).

Each claim of the paper that the study tests gets a 95% interval over seeds (paired by seed,
Student t) and one of WORDS: REPRODUCED when the interval excludes zero on the paper's side,
CONTRADICTED when it excludes the paper's effect (every size the paper reports for it) and does
not exclude zero on the paper's side, NOT_RESOLVED when it holds both zero and the paper's effect.
To change the words, change them here: the sections, the claim counts and the report's
explanation (DEFINITIONS) all read them from this module.

Beside each loss comparison (and the task's accuracy) stands the runner's margin verdict
(docs/sweeps.md#verdicts), with its power: `MarginVerdict`, from per-seed values when the runs are
here (`from_effect`), or from the mean, 95% interval and seed count a report printed
(`from_printed`: those are sufficient statistics of a paired t test), rendered by one code path.
The words are attnres.results.verdict's, the power figures attnres.results.power's.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from attnres.results import power
from attnres.results.margin import Margin
from attnres.results.verdict import ALPHA, Comparison

REPRODUCED, CONTRADICTED, NOT_RESOLVED = "reproduced", "contradicted", "not resolved"
WORDS = (REPRODUCED, CONTRADICTED, NOT_RESOLVED)  # in the order the claim counts list them
#: the report's explanation of the words (its "**Verdicts.**" paragraph)
DEFINITIONS = (
    "**Verdicts.** Each claim gets a 95% interval over seeds (Student t, paired by seed) and one of: "
    f"*{REPRODUCED}* (the interval excludes zero on the paper's side), *{CONTRADICTED}* (the interval excludes "
    "the paper's effect, every size the paper reports for it, and does not exclude zero on the paper's "
    f"side), *{NOT_RESOLVED}* (the interval holds both zero and the paper's effect). Loss gaps are compared "
    "as a share of the baseline's validation loss in percent, since nats per token depend on the tokenizer."
)


def verdict(effect: Any, paper: Sequence[float], lower: bool = True) -> str:
    """One of WORDS for an Effect (study.py) against a paper effect that is negative (lower=True:
    lower is the paper's side) or positive."""
    ci = effect.ci
    if ci is None:
        return NOT_RESOLVED
    low, high = ci
    if (high < 0) if lower else (low > 0):
        return REPRODUCED
    p_low, p_high = min(paper), max(paper)
    if high < p_low or low > p_high:
        return CONTRADICTED
    return NOT_RESOLVED


def claim(word: str, text: str) -> str:
    return f"- **{word}**: {text}"


def count_words(claims: Sequence[str]) -> str:
    """"2 reproduced, 1 not resolved" of claim lines (claim()'s form)."""
    words = [c.split("**")[1] for c in claims]
    return ", ".join(f"{words.count(w)} {w}" for w in WORDS if w in words)


# == the margin verdict beside each comparison (docs/sweeps.md#verdicts) ==============================
MARGIN = Margin()  # the runner's defaults: verdict.margin=0.5% of the baseline, verdict.margin_points=1
LOSS, ACCURACY = "val/loss", "attnres_pointer/acc"  # the metrics the report compares; which way is better: margin.py
MARGIN_DEFINITION = (
    "**Margin verdicts.** Beside each loss comparison (a Block or Full arm against its baseline, as a share of the "
    "baseline's val/loss) stands the verdict the runner gives a sweep (docs/sweeps.md#verdicts), read off the same "
    f"95% interval with the runner's default margin, `verdict.margin` = {100 * MARGIN.share:g}% of the baseline's "
    "loss (the task's accuracy: `verdict.margin_points` = "
    f"{MARGIN.points:g} point): better or worse by at least the margin; by less than the margin; whether by the "
    "margin is not resolved; equivalent within the margin (the interval inside it: TOST at 2.5% a side); or not "
    "resolved. With it, its power (statsmodels): the smallest difference its seeds detect at 80% power from the "
    "observed paired spread, and the seeds a margin-sized difference needs. The trend and depth-difference claims, "
    "the magnitudes, the depth attention and the compute multiplier have no margin verdict: the margin is a "
    "difference of loss between two configurations. Each interval is at 95% on its own, as the claims read it; a "
    "sweep's verdicts hold the K arms that share one baseline together (at 1 - 0.05/K), so sections 1 and 2 also "
    "give the words at that level (\"Held together\")."
)


@dataclass(frozen=True)
class MarginVerdict:
    """A paired comparison's sufficient statistics (its mean, 95% interval, the sd of its paired
    differences and its seed count), in percent of the baseline's loss (LOSS) or points (ACCURACY)."""

    metric: str
    mean: float
    ci: tuple[float, float] | None
    sd: float | None
    n: int

    @classmethod
    def from_effect(cls, effect: Any, metric: str = LOSS) -> MarginVerdict:
        """From an Effect (study.py: per-seed values and their 95% t interval), as a rebuild from runs has it."""
        values = list(effect.per_seed.values())
        sd = statistics.stdev(values) if len(values) >= 2 else None
        return cls(metric, effect.mean if values else math.nan, effect.ci, sd, len(values))

    @classmethod
    def from_printed(cls, mean: float, low: float, high: float, n: int, metric: str = LOSS) -> MarginVerdict:
        """From a printed mean, 95% paired-t interval [low, high] and n: sd = half-width / t(0.975, n-1) * sqrt(n)."""
        from scipy import stats

        if n < 2 or not high >= low:
            raise ValueError(f"an interval [{low}, {high}] over {n} seeds gives no spread")
        sd = (high - low) / 2 / float(stats.t.ppf(1 - ALPHA / 2, n - 1)) * math.sqrt(n)
        return cls(metric, mean, (low, high), sd, n)

    @property
    def margin(self) -> float:
        """In the comparison's units, 100 times the runner's (whose are the loss and the 0-1 accuracy):
        percent of the baseline's loss, or points of accuracy."""
        return 100 * MARGIN.in_units(self.metric, 1.0)  # a loss as a share of the baseline: the baseline is 1

    @property
    def unit(self) -> str:
        return "%" if self.comparison().lower_is_better else " pt"

    def comparison(self) -> Comparison:
        """The runner's Comparison of these statistics: its `verdict` is the words."""
        one = self.ci is None and self.n == 1
        return Comparison(label="", baseline="", metric=self.metric, method="one pair" if one else "paired t",
                          n=self.n, mean=self.mean, ci=self.ci, margin=self.margin, sd=self.sd,
                          detectable=power.detectable(self.sd, self.n, ALPHA) if self.sd else None,
                          seeds_needed=power.seeds_needed(self.margin, self.sd, ALPHA) if self.sd else None)

    @property
    def words(self) -> str:
        return self.comparison().verdict if self.n else "no pairs"

    def text(self) -> str:
        """`better by at least the margin (80% power at 0.91% with 5 seeds; the margin needs 12 seeds)`."""
        found = self.comparison()
        if not found.sd:
            return self.words
        detect = f"80% power at {found.detectable:.2f}{self.unit} with {self.n} seeds" if found.detectable else \
            "no power figure"
        need = f"; the margin needs {found.seeds_needed:,} seeds" if found.seeds_needed else ""
        return f"{self.words} ({detect}{need})"

    def describe_margin(self) -> str:
        return MARGIN.describe(self.metric)

    def held_with(self, arms: int) -> MarginVerdict:
        """The same comparison with its interval at 1 - 0.05 / arms (Bonferroni), as a sweep holds the
        `arms` comparisons that share one baseline together (attnres.results.verdict.compare_arms)."""
        from scipy import stats

        if self.ci is None or not self.sd:
            return self
        ci = stats.t.interval(1 - ALPHA / arms, self.n - 1, loc=self.mean, scale=self.sd / math.sqrt(self.n))
        return MarginVerdict(self.metric, self.mean, (float(ci[0]), float(ci[1])), self.sd, self.n)


def held_together(named: Sequence[tuple[str, MarginVerdict]]) -> str:
    """The sentence after a table whose rows share one baseline: each row's words at the level a sweep
    would hold them together at."""
    k = len(named)
    return (f"Held together, as a sweep's verdicts hold the {k} comparisons that share one baseline "
            f"({100 * (1 - ALPHA / k):.4g}% intervals, Bonferroni): " + "; ".join(
                f"{name}: {held.words} [{held.ci[0]:+.2f}, {held.ci[1]:+.2f}]"
                for name, held in ((name, found.held_with(k)) for name, found in named)) + ".")


#: the header of a table's margin column, whose cells are MarginVerdict.text()
MARGIN_COLUMN = f"margin verdict ({100 * MARGIN.share:g}% of the baseline; power)"


def margin_note(*found: tuple[str, MarginVerdict]) -> str:
    """The sentence a claim line ends with: ` Margin verdict (0.5% of the baseline): ...`; with several
    comparisons, each named (`accuracy`, `loss`)."""
    if len(found) == 1:
        (_, only), = found
        return f" Margin verdict ({only.describe_margin()}): {only.text()}."
    return " Margin verdicts: " + "; ".join(f"{name} ({v.describe_margin()}): {v.text()}" for name, v in found) + "."


# == today's REPORT.md, whose runs are elsewhere: the margin verdicts from its printed numbers =========
NUM = r"([-+]?\d+\.\d+)"
#: printed comparisons and where the runs path puts their margin verdict: a claim or paragraph line gets
#: margin_note() at its end, a table row a last cell (MARGIN_COLUMN); each triple is mean, low, high
_NOTES = (  # (pattern, metrics of its triples in order)
    (rf"^- \*\*.*ours: {NUM}% \[{NUM}, {NUM}\], deep shape(?:\)$|, lr .*\)$)", (LOSS,)),  # sections 1, 7
    (rf"^- \*\*.*every block size .*: {NUM}% \[{NUM}, {NUM}\]\)$", (LOSS,)),
    (rf"^- \*\*.*AttnRes beats the baseline at the \w+ shape .*ours: {NUM}% \[{NUM}, {NUM}\]\)$", (LOSS,)),
    (rf"^- \*\*.*on a downstream task .*: {NUM} pt \[{NUM}, {NUM}\] of accuracy, loss {NUM}% \[{NUM}, {NUM}\];.*\)$",
     (ACCURACY, LOSS)),
    (rf"^Block N=4 minus standard, each at its own lr, .*\*\*{NUM}% \[{NUM}, {NUM}\]\*\* \(\d+ seeds\).*\.$", (LOSS,)),
    (rf"^Block N=4 minus standard, paired by seed: \*\*{NUM} pt \[{NUM}, {NUM}\]\*\* .*; beside it the loss, "
     rf"{NUM}% \[{NUM}, {NUM}\] of the standard's val/loss\.$", (ACCURACY, LOSS)),
)
_ROW = rf"^\|.* \| {NUM}% \[{NUM}, {NUM}\] \|(?: \d+/\d+ \|)? (?:{'|'.join(WORDS)}) \|$"


def _printed(match: re.Match, metrics: Sequence[str], n: int) -> list[MarginVerdict]:
    values = [float(v) for v in match.groups()]
    return [MarginVerdict.from_printed(*values[3 * i:3 * i + 3], n, metric) for i, metric in enumerate(metrics)]


def margins_from_printed(text: str, n: int) -> tuple[str, list[MarginVerdict]]:
    """REPORT.md `text` with the margin verdict beside each printed loss (and accuracy) comparison of
    `n` seeds, as a rebuild from the runs writes it, but from the printed mean and interval
    (MarginVerdict.from_printed); the verdicts found. Lines that have theirs already are kept."""
    lines, found = text.split("\n"), []
    date = time.strftime("%Y-%m-%d")
    for i, line in enumerate(lines):
        if "Margin verdict" in line:
            continue
        for pattern, metrics in _NOTES:
            if match := re.match(pattern, line):
                named = list(zip(("accuracy", "loss") if len(metrics) == 2 else ("loss",),
                                 _printed(match, metrics, n), strict=True))
                lines[i] = line + margin_note(*named)
                found += [v for _, v in named]
                break
        else:
            if match := re.match(_ROW, line):
                (verdict_,) = _printed(match, (LOSS,), n)
                lines[i] = f"{line} {verdict_.text()} |"
                found.append(verdict_)
                head = i
                while lines[head - 1].startswith("|"):
                    head -= 1
                if MARGIN_COLUMN not in lines[head]:  # the table's header and rule get the column
                    lines[head] += f" {MARGIN_COLUMN} |"
                    lines[head + 1] += "---|"
    _add_held_together(lines, n)
    head = [i for i, line in enumerate(lines) if line.startswith("**Verdicts.**")]
    if found and head and MARGIN_DEFINITION not in lines:  # the report's verdict paragraph gets the margin's
        lines[head[0] + 1:head[0] + 1] = ["", MARGIN_DEFINITION, "", printed_note(found, date)]
    return "\n".join(lines), found


#: the tables whose rows share one baseline (by their header's start), and which rows: sections 1 and 2
SHARED_BASELINE = {"| comparison | paper, Table 2": " vs standard |", "| S | ours |": " |"}


def _add_held_together(lines: list[str], n: int) -> None:
    for start, rows_with in SHARED_BASELINE.items():
        head = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
        if head is None:
            continue
        end = head + 2
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        if end + 1 < len(lines) and lines[end + 1].startswith("Held together"):
            continue
        named = []
        for row in lines[head + 2:end]:
            cells = [c.strip() for c in row.strip("|").split("|")]
            match = re.search(rf"{NUM}% \[{NUM}, {NUM}\]", row)
            if rows_with in row and match:
                name = f"S = {cells[0]}" if start.startswith("| S |") else cells[0]
                named.append((name, MarginVerdict.from_printed(*map(float, match.groups()), n)))
        if len(named) > 1:
            lines[end:end] = ["", held_together(named)]


def rounding_effect(found: MarginVerdict, step: float = 0.01) -> tuple[set[str], float, int]:
    """What printing the interval's bounds to `step` can change: the words at every corner of
    [low ± step/2] x [high ± step/2], and the largest change there of the 80% power figure and of
    the seeds the margin needs."""
    low, high = found.ci
    here = found.comparison()
    words, detect, needed = set(), 0.0, 0
    for dl in (-step / 2, step / 2):
        for dh in (-step / 2, step / 2):
            corner = MarginVerdict.from_printed(found.mean, low + dl, high + dh, found.n, found.metric)
            words.add(corner.words)
            other = corner.comparison()
            detect = max(detect, abs(other.detectable - here.detectable))
            needed = max(needed, abs(other.seeds_needed - here.seeds_needed))
    return words, detect, needed


def printed_note(found: Sequence[MarginVerdict], date: str) -> str:
    """The paragraph that says where a copy's margin verdicts came from and what the rounding can change."""
    unique = list({(v.metric, v.mean, v.ci): v for v in found}.values())
    effects = {(v.metric, v.mean, v.ci): rounding_effect(v) for v in unique}
    flips = [f"{v.mean:+.2f}{v.unit} [{v.ci[0]:+.2f}, {v.ci[1]:+.2f}] ({' or '.join(sorted(effects[k][0]))})"
             for k, v in zip(effects, unique, strict=True) if len(effects[k][0]) > 1]
    needs = [(v.comparison().seeds_needed, effects[k][2]) for k, v in zip(effects, unique, strict=True)]
    few = max((d for k, d in needs if k < 100), default=0)
    many = max((d / k for k, d in needs if k >= 100), default=0.0)
    return (f"*In this copy the margin verdicts and their power were computed on {date} from the printed means, "
            f"95% intervals and seed counts, since the runs are not on this machine: for a paired t test these are "
            "sufficient statistics (sd = half-width / t(0.975, n - 1) x sqrt(n), `MarginVerdict.from_printed` in "
            "experiments/reproduce/verdicts.py). The printed bounds are rounded to 0.01 points, so each may be off by "
            f"up to 0.005; over the {len(unique)} distinct comparisons that "
            + (f"could change the words of {'; '.join(flips)}" if flips else "changes no verdict's words")
            + f", moves an 80% power figure by at most {max(e[1] for e in effects.values()):.3f} points and the "
            f"seeds the margin needs by at most {few} where it is under 100 ({100 * many:.2g}% above). A rebuild from "
            "the runs computes all of it from the per-seed values.*")
