"""Shared fixtures: an independent float64 reference of depth attention (DESIGN.md section 2,
written here from the formulas, never calling attnres), the one relative-error measure every
forward and gradient comparison uses, and the runs and the sweep trained once per test session
(tests/helpers.py) for the tests that only read what they wrote.

Global resources are isolated per test process (each pytest-xdist worker is one): the sweep slot
folder (ATTNRES_LOCK_DIR) and the data cache (ATTNRES_CACHE). The fused CPU kernel's build folder
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) is shared on purpose: a build costs ~30 s
and attnres/ops/cpu_fused.py serialises builders with an flock (tests/ops/test_cpu_fused.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from tests import helpers

# Without a GPU, the Triton kernel tests run in Triton's CPU interpreter. Triton reads this
# when it is first imported, and Lightning (imported by other test modules) may import it
# before tests/test_kernels.py is collected, so it is set here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Sweeps claim device slots in a lock folder shared by every sweep of the user (attnres/sweep/slots.py), so a
# sweep the user runs beside the tests would hold the tests' slots and stall them: the tests'
# sweeps (subprocesses inherit this) get a folder of their own unless a test names one.
if "ATTNRES_LOCK_DIR" not in os.environ:
    os.environ["ATTNRES_LOCK_DIR"] = tempfile.mkdtemp(prefix="attnres-test-slots-")
    atexit.register(shutil.rmtree, os.environ["ATTNRES_LOCK_DIR"], ignore_errors=True)
# Data modules cache corpora under ~/.cache/attnres unless data.cache_dir is set: the tests' (and
# their runs') caches go to a folder of this process's own.
if "ATTNRES_CACHE" not in os.environ:
    os.environ["ATTNRES_CACHE"] = tempfile.mkdtemp(prefix="attnres-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ATTNRES_CACHE"], ignore_errors=True)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64, over the whole tensor (the absolute
    error where the reference is exactly zero, e.g. the query gradient with one source)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    assert torch.isfinite(a).all(), "result has inf or nan"
    scale = e.norm()
    return ((a - e).norm() / (scale if scale > 0 else 1.0)).item()


def _ref_depth_attention(sources, query, gain=None, eps=1e-6):
    """float64 depth attention straight from DESIGN.md: stack the sources, RMSNorm them
    (optional gain g), logits = w . RMSNorm(v_i), softmax over depth, weighted sum of the raw
    sources. Returns (h (B, T, D), alpha (S, B, T)), differentiable."""
    v = torch.stack([s.to(torch.float64) for s in sources])  # (S, B, T, D)
    keys = v / torch.sqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    if gain is not None:
        keys = keys * gain.to(torch.float64)
    logits = (keys * query.to(torch.float64)).sum(dim=-1)  # (S, B, T)
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(dim=0), alpha


def _assert_rounded_once(weights: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`weights` are depth-attention weights of `dtype` inputs as the contract has them: in that
    dtype, computed with float32 statistics (float64 for float64 inputs) and rounded once, so
    within half an ulp of `dtype` plus the statistics' own error of the float64 `expected`."""
    assert weights.dtype == dtype, f"weights are {weights.dtype}, inputs {dtype}"
    w, e = weights.detach().cpu().to(torch.float64), expected.detach().cpu().to(torch.float64)
    stat = 1e-12 if dtype == torch.float64 else 1e-5  # relative error of the statistics
    info = torch.finfo(dtype)
    bound = (info.eps / 2 + stat) * e.abs() + info.smallest_normal * info.eps  # + the subnormal spacing
    worst = ((w - e).abs() - bound).max().item()
    assert worst <= 0, f"weights off the {dtype} rounding of the reference by {worst:.2e} beyond the bound"


@pytest.fixture
def rounded_once():
    """`rounded_once(weights, expected, dtype)`: the weights are the float64 reference rounded
    once to the inputs' dtype, to the accuracy of float32 statistics."""
    return _assert_rounded_once


@pytest.fixture
def rel_err():
    """The relative-error helper: `rel_err(actual, expected) -> float`."""
    return _rel_err


@pytest.fixture
def ref_depth_attention():
    """The float64 reference: `ref_depth_attention(sources, query, gain=None, eps=1e-6) -> (h, alpha)`."""
    return _ref_depth_attention


@pytest.fixture(scope="module")
def torch_single_thread():
    """One intra-op thread for the module: the core tests use tiny tensors, for which waking a
    second thread costs milliseconds per op on small CPU machines. Restores the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the runs and the sweep the tests share (trained once per session, whichever worker asks first) --
@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory) -> dict[str, helpers.Ran]:
    """The CLI runs of helpers.STRATEGY_RUNS (standard, full, block, and block with callbacks=none),
    trained at once. Read only: a test that writes into a run folder copies it (helpers.copy_run)."""
    root, outcome = helpers.shared_once(tmp_path_factory, "strategy-runs", helpers.train_strategy_runs)
    runs = {name: helpers.Ran(root / name, **ran) for name, ran in outcome.items()}
    for name, ran in runs.items():
        assert ran.returncode == 0, f"{name} failed:\n{ran.stdout[-3000:]}{ran.stderr[-3000:]}"
    return runs


@pytest.fixture(scope="session")
def shared_sweep(tmp_path_factory) -> helpers.Ran:
    """The sweep of helpers.sweep_command (standard and block, two seeds, two simulated GPUs), its
    folder `.dir`. Read only, as the runs above."""
    root, ran = helpers.shared_once(tmp_path_factory, "shared-sweep", helpers.run_shared_sweep)
    sweep = helpers.Ran(root / "sweep", **ran)
    assert sweep.returncode == 0, sweep.stderr[-4000:]
    return sweep


@pytest.fixture(scope="session")
def strategy_events(strategy_runs) -> dict:
    """Each shared run's TensorBoard events, read back with TensorBoard's own reader."""
    return {name: helpers.event_accumulator(ran.dir) for name, ran in strategy_runs.items()}
