"""Device slots (attnres/sweep/slots.py): the plan of slots, a lock of a dead sweep reclaimed at
once while a live sweep's is left alone, and (the shared sweep) two simulated GPUs whose jobs never
share a slot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from itertools import combinations

import pytest

from attnres.sweep.slots import Slot, plan_slots
from tests.helpers import job_dirs, metrics


@pytest.mark.slow
def test_two_simulated_gpus_never_share_a_slot(shared_sweep):
    """The shared sweep's 4 jobs on two simulated GPUs (ATTNRES_FAKE_GPUS=2: two slots)."""
    sweep = shared_sweep.dir
    jobs = job_dirs(sweep)
    assert len(jobs) == 4
    held = [json.loads((d / "slot.json").read_text()) for d in jobs.values()]
    assert {h["slot"] for h in held} == {"gpu0.0", "gpu1.0"}
    for a, b in combinations(held, 2):  # two jobs on one slot never overlap in time
        if a["slot"] == b["slot"]:
            assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)
    assert any(sum(h["slot"] == s for h in held) >= 2 for s in ("gpu0.0", "gpu1.0")), "no slot was reused"
    assert any(a["slot"] != b["slot"] and a["start"] < b["end"] and b["start"] < a["end"]
               for a, b in combinations(held, 2)), "the two slots never ran at once"
    for d in jobs.values():
        assert metrics(d)["status"] == "finished" and metrics(d)["slot"] in ("gpu0.0", "gpu1.0")
    summary = (sweep / "summary.md").read_text()
    assert "4 finished" in summary and "gpu0.0" in summary
    assert (sweep / "summary.png").stat().st_size > 1000
    assert len((sweep / "summary.csv").read_text().splitlines()) == 5


def test_slot_plan():
    assert [s.name for s in plan_slots(["0", "1"], 2, None)] == ["gpu0.0", "gpu0.1", "gpu1.0", "gpu1.1"]
    assert all(isinstance(s, Slot) and s.device in ("0", "1") for s in plan_slots(["0", "1"], 2, None))
    cpu = plan_slots([], 1, 3)
    assert [s.name for s in cpu] == ["cpu0", "cpu1", "cpu2"] and all(s.device is None for s in cpu)
    with pytest.raises(ValueError, match="jobs_per_gpu"):
        plan_slots(["0"], 0, None)


def test_slot_plan_counts_the_cores_this_process_may_use(monkeypatch):
    """Under `taskset -c 0` (or a SLURM cpuset) a sweep plans for the one core it may run on: one job
    of one thread, not the machine's cores, which would put two threads on one core."""
    import attnres.sweep.slots as slots

    monkeypatch.setattr(slots.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(slots.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert slots.usable_cores() == 1
    plan = plan_slots([], 1, None)
    assert [(s.name, s.threads) for s in plan] == [("cpu0", 1)]
    monkeypatch.setattr(slots.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [(s.name, s.threads) for s in plan_slots([], 1, None)] == [("cpu0", 2), ("cpu1", 2)]


def test_a_cpu_sweep_pinned_to_some_cores_shares_their_slots_alone(monkeypatch):
    import attnres.sweep.slots as slots

    monkeypatch.delenv("ATTNRES_LOCK_DIR", raising=False)
    uid = os.getuid()
    monkeypatch.setattr(slots.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(slots.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert str(slots.default_lock_dir(cpu_only=True)) == f"/tmp/attnres-slots-{uid}"
    monkeypatch.setattr(slots.os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert str(slots.default_lock_dir(cpu_only=True)) == f"/tmp/attnres-slots-{uid}-cpus1"
    assert str(slots.default_lock_dir()) == f"/tmp/attnres-slots-{uid}"  # GPU slots: shared whatever the cores
    monkeypatch.setattr(slots.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5}, raising=False)
    assert str(slots.default_lock_dir(cpu_only=True)) == f"/tmp/attnres-slots-{uid}-cpus0-2,5"
    monkeypatch.setenv("ATTNRES_LOCK_DIR", "/somewhere")  # what the launcher hands its workers wins
    assert str(slots.default_lock_dir(cpu_only=True)) == "/somewhere"


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_a_slot_lock_of_a_dead_sweep_is_reclaimed_at_once(tmp_path, monkeypatch):
    import threading

    from attnres.sweep import slots

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a sweep process that has died
    locks = tmp_path / "locks"
    locks.mkdir()
    holders = {}
    for slot, sweep_pid in (("cpu0", dead.pid), ("cpu1", os.getpid())):  # cpu1: a live sweep's
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(locks / f"{slot}.lock")],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        (locks / f"{slot}.lock").write_text(json.dumps({
            "slot": slot, "sweep": sweep_pid, "worker": holder.pid,
            "worker_start": slots.process_start(holder.pid), "child": None}))
        holders[slot] = holder
    monkeypatch.setenv(slots.SLOTS_ENV, json.dumps([{"name": s, "device": None, "threads": 1} for s in holders]))
    monkeypatch.setenv(slots.SWEEP_ENV, "{}")  # no watchdog in this test process
    monkeypatch.setattr(slots, "claimed", None)
    claimed = []
    thread = threading.Thread(target=lambda: claimed.append(slots.claim_slot(locks, poll_s=0.1)), daemon=True)
    try:
        start = time.monotonic()
        thread.start()
        thread.join(20)
        assert claimed, "waited on the lock of a sweep that died"
        slot, fd = claimed[0]
        assert slot.name == "cpu0" and time.monotonic() - start < 15
        assert holders["cpu0"].wait(5) == -signal.SIGTERM  # the orphan was stopped
        assert holders["cpu1"].poll() is None  # a live sweep's holder is left alone
        os.close(fd)
    finally:
        for holder in holders.values():
            holder.kill()
            holder.wait()
