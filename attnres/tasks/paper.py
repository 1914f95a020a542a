"""The paper's Table 3 (its 48B run, baseline to AttnRes; ../shared/PAPER.md) in lm-eval's task names.

`paper_table3` in a task list stands for all of them. Which harness and settings the paper used is
not stated, so its figures are shown beside ours for orientation, not as a like-for-like target.
CMath has no lm-eval task: it is named and left out.
"""

from __future__ import annotations

GROUP = "paper_table3"

#: (the paper's name, lm-eval's task or None, baseline, AttnRes), in the paper's order
TABLE3 = (
    ("MMLU", "mmlu", 73.5, 74.6),
    ("MMLU-Pro", "mmlu_pro", 52.2, 52.2),
    ("GPQA-Diamond", "gpqa_diamond_zeroshot", 36.9, 44.4),
    ("BBH", "bbh", 76.3, 78.0),
    ("ARC-Challenge", "arc_challenge", 64.6, 65.7),
    ("HellaSwag", "hellaswag", 83.2, 83.4),
    ("TriviaQA", "triviaqa", 69.9, 71.8),
    ("GSM8K", "gsm8k", 81.7, 82.4),
    ("MGSM", "mgsm_direct", 64.9, 66.1),
    ("MATH", "minerva_math", 53.5, 57.1),
    ("CMath", None, 84.7, 85.1),
    ("HumanEval", "humaneval", 59.1, 62.2),
    ("MBPP", "mbpp", 72.0, 73.9),
    ("CMMLU", "cmmlu", 82.0, 82.9),
    ("C-Eval", "ceval-valid", 79.6, 82.5),
)
BY_TASK = {task: (name, base, attnres) for name, task, base, attnres in TABLE3 if task}
NO_TASK = [name for name, task, _, _ in TABLE3 if task is None]


def expand(tasks: list[str]) -> list[str]:
    """`tasks` with `paper_table3` replaced by its lm-eval tasks, each name once, in order."""
    out: list[str] = []
    for task in tasks:
        out += [t for _, t, _, _ in TABLE3 if t] if task == GROUP else [task]
    return list(dict.fromkeys(out))


def beside(task: str) -> str:
    """The paper's figures for `task`, as shown beside ours ("" when it is not in Table 3)."""
    if task not in BY_TASK:
        return ""
    name, base, attnres = BY_TASK[task]
    return f"paper (48B, {name}): {base} -> {attnres}"
