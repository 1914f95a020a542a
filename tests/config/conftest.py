"""Fixtures of the config checks' tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The test runs in an empty folder, without the Triton interpreter the kernel tests set,
    and the check must leave the folder empty."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield tmp_path
    assert not any(tmp_path.iterdir()), f"the check wrote {list(tmp_path.iterdir())}"
