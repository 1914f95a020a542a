"""keep_freed_memory (attnres/training/devices.py): freed tensor memory stays in the process.

Checked in fresh processes (the setting is per process, and once set it stays) through glibc's
own account of its memory (`mallinfo2`): with the setting, a 4 MB tensor comes from the heap
and its pages stay there when it is freed, ready for the next step's tensor; without it, the
tensor is a mapping of its own, returned to the system when freed (and faulted in afresh the
next time). What that is worth in step time is measured in experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")

PROBE = textwrap.dedent(
    """
    import ctypes, json, sys, torch
    from attnres.training.devices import keep_freed_memory

    class Info(ctypes.Structure):  # glibc's struct mallinfo2 (2.33 and later)
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        print(json.dumps(None)); sys.exit()
    libc.mallinfo2.restype = Info
    kept = keep_freed_memory() if sys.argv[1] == "keep" else False
    again = keep_freed_memory() if kept else False
    before = libc.mallinfo2()
    t = torch.empty(1 << 20)  # 4 MB
    t.fill_(1.0)
    mapped = libc.mallinfo2().hblkhd - before.hblkhd
    del t
    print(json.dumps({"kept": kept, "again": again, "mapped": mapped, "free_in_heap": libc.mallinfo2().fordblks}))
    """
)


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    if result is None:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    return result


@needs_glibc
def test_freed_tensor_memory_stays_in_the_heap():
    kept = _probe("keep")
    assert kept["kept"] is True and kept["again"] is True  # a second call gives the first one's answer
    assert kept["mapped"] == 0  # from the heap, not a mapping of its own
    assert kept["free_in_heap"] >= 4 << 20  # freed, and still the process's for the next tensor


@needs_glibc
def test_without_it_a_large_tensor_is_a_mapping_returned_when_freed():
    plain = _probe("plain")
    assert plain["kept"] is False
    assert plain["mapped"] >= 4 << 20


