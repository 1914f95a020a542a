"""Downstream tasks through lm-evaluation-harness (the eval extra): attnres's own tasks over local data
(local.py, yaml/), the bridge to lm-eval (lmeval.py), the paper's Table 3 (paper.py), attnres-tasks (main.py)."""
