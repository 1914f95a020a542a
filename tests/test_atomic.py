"""Atomic writes (attnres/atomic.py): JSON never holds NaN or Infinity, a write that fails leaves
the previous file and no temporary one, and a written file follows the umask."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from attnres import atomic
from attnres.atomic import atomic_write, finite_json, write_json


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_write_json_never_writes_nan(tmp_path, value):
    write_json(tmp_path / "m.json", {"metrics": {"val/loss": value, "ok": 1.5}, "list": [value]})
    text = (tmp_path / "m.json").read_text()
    assert json.loads(text) == {"metrics": {"val/loss": None, "ok": 1.5}, "list": [None]}
    assert finite_json({"a": (value, 2)}) == {"a": [None, 2]}


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    write_json(path, {"step": 1})
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_json(path, {"step": 2})
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)  # says which file
    assert json.loads(path.read_text()) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
    monkeypatch.undo()
    atomic_write(path, lambda f: f.write(b'{"step": 3}'))
    assert json.loads(path.read_text()) == {"step": 3}
