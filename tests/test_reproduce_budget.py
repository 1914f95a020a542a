"""A reproduction part's budget (experiments/reproduce/run.py, Part.budget_h): hours of wall time added up
over its invocations in runs/state.json; the sweep running when it is spent gets one SIGTERM (it saves, and
resume continues it), a spent part is not run again unless --over-budget, and neither counts as a failure."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

HERE = REPO / "experiments" / "reproduce"
sys.path.insert(0, str(HERE))
run = pytest.importorskip("run")  # experiments/reproduce/run.py
report = pytest.importorskip("report")  # experiments/reproduce/report.py
tuned_seeds_part = pytest.importorskip("tuned_seeds_part")
depth_part = pytest.importorskip("depth_part")

# a sweep stand-in: records each signal it gets, ends 1 after a SIGTERM (as a sweep whose jobs stopped may)
CHILD = """
import signal, sys, time
got = []
def stop(s, f):
    got.append(s)
    open(sys.argv[1], "w").write(",".join(map(str, got)))
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)
"""


def test_the_sweep_running_at_the_deadline_gets_one_sigterm_and_the_budget_is_reported(tmp_path):
    record = tmp_path / "got"
    start = time.monotonic()
    code = run.call_forwarding([sys.executable, "-c", CHILD, str(record)], Path("."), deadline=start + 2.0)
    assert code == run.BUDGET_SPENT and 2.0 <= time.monotonic() - start < 30
    assert record.read_text() == str(int(signal.SIGTERM))
    # no deadline, or one not reached: the sweep's own exit status
    assert run.call_forwarding([sys.executable, "-c", "import sys; sys.exit(3)"], Path("."),
                               deadline=time.monotonic() + 60) == 3


def _main(tmp_path, monkeypatch, state, sweep_code, *args, meta=True):
    """run.main(--parts tuned_seeds) with its sweep faked: (exit status, [deadline - now] per sweep started)."""
    out = tmp_path / "runs"
    out.mkdir()
    (out / "state.json").write_text(json.dumps(state))
    started = []

    def fake_sweep(sweep, where, jobs, deadline=None):
        started.append(None if deadline is None else deadline - time.monotonic())
        return sweep_code

    monkeypatch.setattr(run, "run_sweep", fake_sweep)
    monkeypatch.setattr(report, "update_report", lambda out, parts: (tmp_path / "REPORT.md", ""))
    monkeypatch.setattr(run, "DATA", tmp_path)  # part prepare's output taken as there
    if meta:
        (tmp_path / "meta.json").write_text("{}")
    monkeypatch.setattr(run, "prepare", lambda: pytest.fail("part prepare ran"))
    return run.main(["--parts", "tuned_seeds", "--out", str(out), *args]), started


def test_a_part_runs_with_the_budget_it_has_left(tmp_path, monkeypatch):
    code, started = _main(tmp_path, monkeypatch, {"tuned_seeds": {"wall_s": 3600.0, "invocations": 1}}, 0)
    assert code == 0 and len(started) == 1 and 2 * 3600 - 60 < started[0] <= 2 * 3600


def test_a_part_stopped_by_its_budget_is_recorded_and_not_a_failure(tmp_path, monkeypatch, capsys):
    code, _ = _main(tmp_path, monkeypatch, {}, run.BUDGET_SPENT)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "run.py: part tuned_seeds reached its budget of 3 h and was stopped; its section says where" in err
    assert json.loads((tmp_path / "runs" / "state.json").read_text())["tuned_seeds"]["budget_spent"] is True


def test_a_spent_part_is_not_run_again_unless_asked(tmp_path, monkeypatch, capsys):
    spent = {"tuned_seeds": {"wall_s": 3 * 3600 + 1.0, "invocations": 2}}
    (tmp_path / "meta.json").unlink(missing_ok=True)
    code, started = _main(tmp_path, monkeypatch, spent, 0, meta=False)  # no data, and none needed: no prepare
    assert code == 0 and started == []
    assert "== part tuned_seeds: its budget of 3 h is spent (3.00 h in all): not run again (--over-budget runs it)" \
        in capsys.readouterr().out
    (tmp_path / "again").mkdir()
    code, started = _main(tmp_path / "again", monkeypatch, spent, 0, "--over-budget")
    assert code == 0 and started == [None]  # run, with no deadline


def test_the_budgets_are_the_ones_the_sections_state():
    budgets = {p.name: p.budget_h for p in run.PARTS}
    assert budgets["tuned_seeds"] == tuned_seeds_part.BUDGET_H == 3.0  # issue 49: at most 3 hours
    assert budgets["depth_tuned"] == depth_part.BUDGET_H == 4.0  # issue 51: at most 4 hours
