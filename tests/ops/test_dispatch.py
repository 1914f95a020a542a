"""Which implementation runs (attnres/ops/dispatch.py, `resolve_kernel`): kernel="auto" per device
and dtype, the errors of a kernel that cannot take the inputs, and triton never imported unless a
Triton kernel runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnres
from attnres import BlockAttentionResidual
from attnres.functional import resolve_kernel
from attnres.ops import cpu_fused
from attnres.ops.dispatch import triton_available

HAS_TRITON = triton_available()  # finds triton (>= 3.2) without importing it


def test_auto_dispatch_and_errors(monkeypatch):
    cpu = torch.zeros(1)
    fused = "cpu" if cpu_fused.available() else "torch"
    assert resolve_kernel("auto", cpu) == fused
    assert resolve_kernel("auto", cpu.double()) == fused
    assert resolve_kernel("auto", cpu.bfloat16()) == "torch"  # the C++ kernel's dtypes: float32, float64
    assert resolve_kernel("naive", cpu) == "naive"
    assert resolve_kernel("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="kernel='cpu' takes CPU tensors of float32 or float64"):
        resolve_kernel("cpu", cpu.half())
    with pytest.raises(ValueError, match="kernel must be one of"):
        resolve_kernel("cuda", cpu)
    with pytest.raises(ValueError, match="kernel must be one of"):
        BlockAttentionResidual(8, 4, num_blocks=2, kernel="fast")
    if HAS_TRITON:
        with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
            resolve_kernel("triton", cpu.double())
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            resolve_kernel("triton", cpu)


def test_import_attnres_never_imports_triton():
    root = Path(attnres.__file__).resolve().parents[1]
    code = (
        "import sys, torch, attnres, attnres.functional\n"
        "from attnres import BlockAttentionResidual\n"
        "s = BlockAttentionResidual(8, 4, num_blocks=2)\n"
        "s(torch.randn(1, 2, 8), [torch.nn.Identity()] * 4).sum().backward()\n"
        "print('triton' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
