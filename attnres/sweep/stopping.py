"""Ctrl-C or SIGTERM to a parallel sweep: the running jobs finish their step and save, the jobs not
started stay unstarted, and the sweep still writes its summary and exits 130 (SIGINT) or 143 (SIGTERM).

The sweep process alone takes the signal (`SweepStop`): a job process runs in a session of its own
and the launcher's workers ignore both signals, so a signal sent to the whole process group (a
terminal's Ctrl-C, `scancel`, `kill -- -PGID`) and one sent to the sweep's pid alone reach each job
exactly once, forwarded by its worker (`wait_forwarding`). The sweep and its workers share the
count of signals through a file in the sweep folder; a second signal stops the jobs at once (their
last checkpoints stay whole).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attnres.atomic import read_json, write_json

log = logging.getLogger(__name__)

STOP_FILE = ".sweep.stop"  # in the sweep folder: {"signal": "SIGINT", "count": 1}
SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: the signal that stopped the sweep run by this process, if one did (`plan.exit_status`)
stopped_by: signal.Signals | None = None


class SweepStop:
    """The sweep process's handler of SIGINT and SIGTERM while its jobs run (`catching`)."""

    def __init__(self, sweep_dir: Path) -> None:
        self.path = Path(sweep_dir) / STOP_FILE
        self.count = 0

    def _handle(self, signum: int, frame: Any) -> None:
        global stopped_by
        sig = signal.Signals(signum)
        stopped_by = stopped_by or sig
        self.count += 1
        write_json(self.path, {"signal": sig.name, "count": self.count})
        if self.count == 1:
            log.warning(f"received {sig.name}: the running jobs stop after their step and save a checkpoint, the "
                        "others do not start; the summary follows (send it again to stop the jobs at once)")
        else:
            log.warning(f"received {sig.name} again: stopping the running jobs at once")

    @contextlib.contextmanager
    def catching(self) -> Iterator[SweepStop]:
        self.path.unlink(missing_ok=True)  # a previous sweep's stop is not this one's
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.path.unlink(missing_ok=True)


def requested(stop_file: str | Path | None) -> tuple[signal.Signals | None, int]:
    """(the first signal, how many) the sweep has received, read from its stop file."""
    if not stop_file:
        return None, 0
    record = read_json(stop_file)
    name = record.get("signal")
    return (signal.Signals[name] if name in signal.Signals.__members__ else None), int(record.get("count", 0))


def _shielded(signum: int, frame: Any) -> None:
    """A worker's handler of SIGINT and SIGTERM: nothing (`ignore_signals`)."""


def ignore_signals() -> None:
    """In a worker: the sweep process takes SIGINT and SIGTERM for it (a worker killed by one would
    take its job down mid-save). A handler that does nothing, not SIG_IGN: an ignored signal stays
    ignored in the processes a worker starts, so a job process that got the sweep's forwarded
    signal before its own handlers were in place (while importing) trained on to the end; a handler
    is reset to the default at exec, and such a job ends at once, recorded `interrupted`."""
    for sig in SIGNALS:
        signal.signal(sig, _shielded)


def wait_forwarding(proc: subprocess.Popen, stop_file: str | Path | None, poll_s: float = 0.3) -> int:
    """Wait for a job process, passing each signal the sweep receives on to it; its exit status."""
    forwarded = 0
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        sig, count = requested(stop_file)
        while sig is not None and forwarded < count:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            forwarded += 1

