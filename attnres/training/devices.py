"""The machine side of a run: the precision `auto` resolves to, and how the C library's allocator
treats the memory a training step frees (the `keep_freed_memory` key).

A CPU training step allocates and frees the same large tensors every step: activations, their
gradients, the depth-attention outputs (on the default tiny model each (B, T, D) tensor is
786 KB). glibc hands blocks above its mmap threshold (128 KB at start, raised as such blocks
are freed) straight back to the system, and trims the top of its heap once more than twice that
threshold is free there; either way the next step faults every page in afresh. AttnRes
allocates more of these than the standard residual (outputs and gradients per depth-attention
call), so it pays more of this cost: on the default model and a 2-core VM, keeping freed memory
made the runner train 7.6% faster with the standard residual and 12.6% faster with Block AttnRes
N=8, and a bare train step 2 to 3% and 5% faster (experiments/BENCHMARKS.md, "Small models on
CPU", separate invocations).

`keep_freed_memory()` sets the two thresholds once per process (`mallopt`): blocks below 32 MB
come from the heap, and the heap is trimmed only when a whole GiB is free at its top. The
process's resident memory then stays near its peak instead of shrinking between steps, as
PyTorch's CUDA allocator does on a GPU. Nothing else changes: results are bit-identical.
On other C libraries (macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

import torch

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed heap memory in this process for reuse (glibc only; once per process).
    Returns whether the allocator took the setting."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has mallopt but not these thresholds)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def resolve_precision(precision: Any, accelerator: str) -> Any:
    """`precision: auto` -> bf16-mixed on a GPU that supports it, else 32-true."""
    if precision != "auto":
        return precision
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"
