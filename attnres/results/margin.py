"""Which way a metric is better, and the margin that matters for it (conf/config.yaml `verdict:`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from attnres.config import margins

HIGHER_IS_BETTER = ("val/accuracy",)
#: lm-eval task metrics (`<task>/<metric>`, attnres.results.task_verdicts) where higher is better:
#: accuracies, exact match, F1, MCC, pass@k, BLEU, ROUGE (with or without a filter suffix);
#: perplexities and bits per byte are lower-is-better, as the losses
TASK_HIGHER_IS_BETTER = ("acc", "exact_match", "em", "f1", "mcc", "pass@", "pass_at", "bleu", "rouge", "chrf")
#: higher-is-better metrics lm-eval reports on a 0-100 scale: a point is 1 of them, not 0.01
HUNDRED_SCALE = ("bleu", "chrf")


def higher_is_better(metric: str) -> bool:
    """Whether a larger `metric` is the better one (val/accuracy, a task's accuracy)."""
    if metric in HIGHER_IS_BETTER:
        return True
    task, _, name = metric.rpartition("/")
    return bool(task) and not task.startswith(("val", "train")) and name.startswith(TASK_HIGHER_IS_BETTER)


@dataclass(frozen=True)
class Margin:
    """The smallest difference that matters (conf/config.yaml `verdict:`, attnres.config.margins)."""

    share: float = margins.share(margins.DEFAULT_SHARE_TEXT)  # of the baseline's mean: losses, bpb
    points: float = margins.DEFAULT_POINTS  # accuracies and other higher-is-better metrics

    @classmethod
    def from_config(cls, node: Any) -> Margin:
        """From a `verdict:` node (or None: the defaults); a bad value is a ConfigError."""
        node = node or {}
        return cls(margins.share(node.get("margin", margins.DEFAULT_SHARE_TEXT)),
                   margins.points(node.get("margin_points", margins.DEFAULT_POINTS)))

    def in_units(self, metric: str, baseline_mean: float) -> float | None:
        """The margin in `metric`'s own units."""
        if higher_is_better(metric):
            return self.points * (1.0 if metric.rpartition("/")[2].startswith(HUNDRED_SCALE) else 0.01)
        scale = abs(baseline_mean)
        return self.share * scale if scale > 0 and math.isfinite(scale) else None

    def describe(self, metric: str) -> str:
        if higher_is_better(metric):
            return f"{self.points:g} point{'s' * (self.points != 1)}"
        return f"{100 * self.share:g}% of the baseline"
