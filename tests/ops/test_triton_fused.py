"""The Triton kernels (attnres/ops/triton_fused.py) as the CUDA backend compiles them, no GPU
needed. Their numerics, in Triton's CPU interpreter or on a GPU, are in test_kernels.py with the
other implementations."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attnres.ops.dispatch import triton_available
from tests.helpers import REPO

HAS_TRITON = triton_available()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param("--d 768 --sublayers 24 --num-blocks 8", id="gpt-small-D768-L24-N8", marks=pytest.mark.slow),
        # a whole ptxas compile of every kernel (25 s): integration, so slow like its sibling
        pytest.param("--d 1000 --sublayers 6 --num-blocks 3 --dtype float16", id="D1000-L6-N3-f16",
                     marks=pytest.mark.slow),
    ],
)
def test_triton_kernels_compile_for_hopper_without_spilling(shape):
    """Every kernel variant the Block and Full fast paths launch compiles for sm_90 (H100/H200),
    no GPU needed, and none spills registers to local memory: the interpreter checks the math,
    not what the CUDA backend makes of it. Before the kernels looped over sources at run time,
    Full's variants spilled up to 7 KB per thread. A few bytes are allowed (ptxas sometimes
    caps registers and spills one or two values, depending on the triton version)."""
    pytest.importorskip("triton.backends.nvidia")
    root = REPO
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(root / "experiments" / "kernel_resources.py"), *shape.split(), "--max-spill", "32"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernel variants" in result.stdout and "_bwd_kernel" in result.stdout, result.stdout
