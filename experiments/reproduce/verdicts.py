"""The verdict words of REPORT.md and the rule that picks one (every section's claims use these).

Each claim of the paper that the study tests gets a 95% interval over seeds (paired by seed,
Student t) and one of WORDS: REPRODUCED when the interval excludes zero on the paper's side,
CONTRADICTED when it excludes the paper's effect (every size the paper reports for it) and does
not exclude zero on the paper's side, NOT_RESOLVED when it holds both zero and the paper's effect.
To change the words, change them here: the sections, the claim counts and the report's
explanation (DEFINITIONS) all read them from this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
