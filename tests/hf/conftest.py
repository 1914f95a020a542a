"""The `runs` fixture: the six strategies' runs, trained once per test session (tests/hf/shared.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import helpers
from tests.hf.shared import train_and_sample


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The six strategies, 10 steps each on a few stdlib files, and each one's greedy mode=sample."""
    root, outcome = helpers.shared_once(tmp_path_factory, "hf-export-runs", train_and_sample)
    for name, ran in outcome.items():
        assert ran["returncode"] == 0, f"{name} failed:\n{ran['stderr'][-3000:]}"
    return root
