"""The fused CPU kernel's machinery (`attnres/ops/cpu_fused.py`): the gradient sink the
strategies' passes use, the build (its cache name, a killed build's lock) and the fallback to
the plain-PyTorch path when it cannot be built. Its numerics against the reference are in
tests/test_kernels.py, with the other implementations."""

from __future__ import annotations

import functools
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from attnres import BlockAttentionResidual, FullAttentionResidual, Transformer
from attnres.functional import resolve_kernel
from attnres.ops import cpu_fused

pytestmark = [
    pytest.mark.usefixtures("torch_single_thread"),
    pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="needs a C++ compiler"),
]


def _model(strategy, kernel, **kw):
    torch.manual_seed(0)
    m = Transformer(vocab_size=40, n_layer=3, n_head=2, n_embd=16, block_size=8,
                    residual=functools.partial(strategy, kernel=kernel, **kw)).double()
    with torch.no_grad():
        m.residual.pseudo_query.normal_(0.0, 0.5)  # weights far from uniform
    return m


def _grads(model, idx, passes=1):
    loss = model(idx, targets=idx)["loss"]
    for i in range(passes):
        loss.backward(retain_graph=i + 1 < passes)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy,kw", [(BlockAttentionResidual, {"num_blocks": 3}),
                                         (BlockAttentionResidual, {"num_blocks": 6, "output_aggregation": False}),
                                         (FullAttentionResidual, {})], ids=["block3", "block6-noagg", "full"])
def test_sink_gives_autograds_gradients_and_resets_between_backwards(strategy, kw, rel_err):
    """The sink (each call adds its source gradients into one buffer per source) gives the
    reference path's gradients; a second backward through the retained graph adds the same
    again (the sink is emptied as autograd hands each sum on, nothing is counted twice)."""
    idx = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    assert resolve_kernel("auto", torch.zeros(1, dtype=torch.float64)) == "cpu"
    want = _grads(_model(strategy, "naive", **kw), idx)
    got = _grads(_model(strategy, "cpu", **kw), idx)
    twice = _grads(_model(strategy, "cpu", **kw), idx, passes=2)
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-12, name
        assert rel_err(twice[name], 2 * want[name]) < 1e-12, name


def test_sink_only_for_sources_that_need_gradients(rel_err):
    """A frozen embedding (no gradient) is not tracked: only the sublayers' sums go to the sink."""
    from attnres.functional import SourceStack

    e = torch.randn(2, 3, 8, dtype=torch.float64)  # no gradient
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    stack = SourceStack(e, 3, 1e-6, "cpu")
    stack.append(e @ w)
    _, r, (sink, slots) = stack.take()
    assert r is None and slots == [None, 1] and isinstance(sink, cpu_fused.GradSink)
    with torch.no_grad():
        assert SourceStack(e, 2, 1e-6, "cpu").take()[2] is None  # no gradients, no sink


def test_build_name_follows_source_flags_torch_and_cpu(monkeypatch):
    name = cpu_fused._build_name(["-O3"])
    assert name.startswith("attnres_cpu_") and name == cpu_fused._build_name(["-O3"])
    assert cpu_fused._build_name(["-O2"]) != name
    monkeypatch.setattr(cpu_fused, "_cpu_features", lambda: "flags : sse2")
    assert cpu_fused._build_name(["-O3"]) != name  # another CPU never loads this binary


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_a_killed_build_blocks_nothing(tmp_path):
    """A build killed while it holds the lock: the system releases it, the next process gets it
    at once and removes the lock file torch's build left behind (else torch waits for ever)."""
    (tmp_path / "lock").write_text("")  # what torch's killed build leaves
    code = ("import sys, time; from pathlib import Path; from attnres.ops import cpu_fused\n"
            "with cpu_fused._exclusive(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not (tmp_path / "lock").exists()  # the holder cleared it
        (tmp_path / "lock").write_text("")  # and is killed mid-build, leaving torch's again
        waiter = threading.Thread(target=lambda: cpu_fused._exclusive(tmp_path).__enter__())
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive()  # the live holder keeps others out
        holder.send_signal(signal.SIGKILL)
        waiter.join(10.0)
        assert not waiter.is_alive() and not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def fresh_state(monkeypatch):
    """`available()` as on first use: nothing built or loaded yet in this process's view."""
    monkeypatch.setattr(cpu_fused, "_state", {})
    return monkeypatch


def test_failed_build_falls_back_with_one_warning(fresh_state):
    def broken():
        raise RuntimeError("Error building extension 'x': [1/2] c++ ...\n"
                           "foo.cpp:1:10: fatal error: Python.h: missing\n")

    fresh_state.setattr(cpu_fused, "_build", broken)
    cpu = torch.zeros(1)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(foo.cpp:1:10: fatal error: Python.h: missing\)"):
        assert resolve_kernel("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="kernel='cpu': the C\\+\\+ kernel could not be built .*use kernel='torch'"):
        resolve_kernel("cpu", cpu)
    s = BlockAttentionResidual(8, 4, num_blocks=2)  # the strategies take the plain-PyTorch path, same results
    assert s.fast_kernel(cpu) == "torch"


def test_environment_switch_turns_it_off(fresh_state):
    fresh_state.setenv("ATTNRES_CPU_KERNEL", "0")
    assert resolve_kernel("auto", torch.zeros(1)) == "torch"
    assert "ATTNRES_CPU_KERNEL=0" in cpu_fused.load_error()


def test_a_failed_openmp_build_falls_back_to_one_thread(fresh_state, tmp_path, capsys):
    """Where the compiler has no OpenMP (Apple's clang, say) the kernel is built without it and
    runs its loops on one thread; where torch has no OpenMP it is not tried at all."""
    from torch.utils import cpp_extension

    assert cpu_fused.available()  # the real kernel is loaded: the stand-in build below only records
    calls = []

    def load(name, sources, extra_cflags, extra_ldflags=None, **kw):
        calls.append(extra_cflags)
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("Error building extension 'x': [1/2] c++ ...\n"
                               "clang: error: unsupported option '-fopenmp'\n")

    fresh_state.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fresh_state.setattr(cpp_extension, "load", load)
    fresh_state.setattr(torch.backends.openmp, "is_available", lambda: True)
    cpu_fused._build()
    assert ["-fopenmp" in f for f in calls] == [True, False] and "-fopenmp-simd" in calls[1]
    assert cpu_fused._state["threads"] == "one"
    said = capsys.readouterr().err
    assert "could not be built with OpenMP (clang: error: unsupported option '-fopenmp')" in said
    assert "on one thread (remove " in said and cpu_fused.OPENMP_FAILED in said
    calls.clear()
    cpu_fused._build()  # a later process does not try the failed OpenMP build again, and says nothing
    assert "OpenMP" not in capsys.readouterr().err
    assert len(calls) == 1 and "-fopenmp" not in calls[0]
    calls.clear()
    fresh_state.setattr(torch.backends.openmp, "is_available", lambda: False)
    cpu_fused._build()
    assert len(calls) == 1 and "-fopenmp" not in calls[0]


@pytest.mark.skipif(not (sys.platform.startswith("linux") and shutil.which("g++")), reason="g++ on Linux")
def test_the_kernel_runs_on_torchs_threads():
    """With g++ and an OpenMP torch (Linux wheels) the kernel is the OpenMP build: ATen's
    parallel_for, inlined from its header, runs the tokens over torch's threads (built without
    -fopenmp, it ran every token on one thread whatever torch.get_num_threads() said)."""
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch has no OpenMP")
    assert cpu_fused.available()
    assert cpu_fused._state.get("threads") == "openmp"


def test_an_interrupted_openmp_build_is_not_taken_for_a_failed_one(fresh_state, tmp_path):
    """Ctrl-C (or any signal to the process group) stops ninja with "interrupted by user": that
    says nothing about OpenMP, so no marker is left that would make every later process build
    the one-thread kernel; the interruption is raised as it came."""
    from torch.utils import cpp_extension

    def load(name, sources, extra_cflags, extra_ldflags=None, **kw):
        raise RuntimeError(f"Error building extension '{name}': ninja: build stopped: interrupted by user.")

    fresh_state.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fresh_state.setattr(cpp_extension, "load", load)
    fresh_state.setattr(torch.backends.openmp, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="interrupted by user"):
        cpu_fused._build()
    assert not list(tmp_path.rglob(cpu_fused.OPENMP_FAILED))


def test_a_build_says_when_it_is_done_and_how_long_it_took(fresh_state, tmp_path, capsys):
    """Issue "The first hour", item 4: the build said "compiling ... about 30 s" and then nothing."""
    from torch.utils import cpp_extension

    assert cpu_fused.available()  # the real kernel is loaded: the stand-in build below only records
    fresh_state.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fresh_state.setattr(cpp_extension, "load", lambda **kw: None)
    cpu_fused._build()
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith("attnres: compiling the fused CPU depth-attention kernel")
    assert len(said) == 2 and said[1].startswith("attnres: the fused CPU kernel is built ("), said
    assert re.search(r"is built \(\d+ s; cached in .+\)$", said[1]), said
    for lock in tmp_path.rglob("attnres.lock"):  # what a finished build leaves in its folder
        (lock.parent / f"{lock.parent.name}.so").write_text("")
    cpu_fused._build()  # already built: a later process says nothing
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("d", [32, 64, 96, 128, 100], ids=lambda d: f"D{d}")
def test_compile_time_widths_match_the_reference(d, rel_err):
    """The forward runs float32 rows of D 32, 64, 96 and 128 with the width a compile-time constant
    (`dispatch_width` in the C++ source), any other D with it read at run time (D 100 here): each
    against the float64 reference, value and gradient, with the fused output norm, and with K = 5
    queries over a prefix (the phase-2 merge: a group of 4 queries and one of 1)."""
    from attnres.functional import completed_attention, merge_completed
    from attnres.ops import naive_depth_attention

    assert cpu_fused.available(), cpu_fused.load_error()
    gen = torch.Generator().manual_seed(d)
    src64 = [torch.randn(3, 7, d, generator=gen, dtype=torch.float64) for _ in range(4)]
    q64 = torch.randn(5, d, generator=gen, dtype=torch.float64) / d**0.5
    w64 = 1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
    dh = torch.randn(3, 7, d, generator=gen, dtype=torch.float64)

    def grads(out, leaves):
        return torch.autograd.grad((out * dh).sum(), leaves, retain_graph=True)

    src = [s.float().requires_grad_() for s in src64]
    w = w64.float().requires_grad_()
    h, _ = cpu_fused.fused_depth_attention(src, q64[0].float(), None, 1e-6, output_norm_weight=w)
    ref_src = [s.clone().requires_grad_() for s in src64]
    ref_w = w64.clone().requires_grad_()
    ref, _ = naive_depth_attention(ref_src, q64[0], None, 1e-6, output_norm_weight=ref_w)
    assert rel_err(h.double(), ref) < 1e-5
    for got, want in zip(grads(h, [*src, w]), grads(ref, [*ref_src, ref_w]), strict=True):
        assert rel_err(got.double(), want) < 1e-4

    # K = 5 queries: the first two sources in phase 1, the other two merged in after
    src = [s.float().requires_grad_() for s in src64]
    accs, lse = completed_attention(src[:2], None, q64.float(), 1e-6, "cpu")
    outs, _ = merge_completed(accs, lse, src[2:], None, q64.float(), 1e-6, "cpu")
    for k in range(5):
        ref_src = [s.clone().requires_grad_() for s in src64]
        ref, _ = naive_depth_attention(ref_src, q64[k], None, 1e-6)
        assert rel_err(outs[k].double(), ref) < 1e-5
        for got, want in zip(grads(outs[k], src), grads(ref, ref_src), strict=True):
            assert rel_err(got.double(), want) < 1e-4


@pytest.mark.parametrize("tokens", [1, 7, 33], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("d", [32, 100], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_token_counts_off_the_groups_match_the_reference(tokens, d, dtype, rel_err):
    """The kernel forms the logits and g = dO . v for W tokens of a source at a time (W: a
    vector's lanes) inside tiles of 16 tokens: token counts that fill neither a group nor a
    tile (1, 7, 33) against the float64 reference, value and gradient, one query with the
    fused output norm and K = 5 queries over a prefix (the phase-2 merge)."""
    from attnres.functional import completed_attention, merge_completed
    from attnres.ops import naive_depth_attention

    assert cpu_fused.available(), cpu_fused.load_error()
    tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-12, 1e-11)
    gen = torch.Generator().manual_seed(tokens * d)
    src64 = [torch.randn(tokens, d, generator=gen, dtype=torch.float64) for _ in range(5)]
    q64 = torch.randn(5, d, generator=gen, dtype=torch.float64) / d**0.5
    w64 = 1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
    dh = torch.randn(tokens, d, generator=gen, dtype=torch.float64)

    def grads(out, leaves):
        return torch.autograd.grad((out.double() * dh).sum(), leaves, retain_graph=True)

    src = [s.to(dtype).requires_grad_() for s in src64]
    w = w64.to(dtype).requires_grad_()
    y, _ = cpu_fused.fused_depth_attention(src, q64[0].to(dtype), None, 1e-6, output_norm_weight=w)
    ref_src = [s.clone().requires_grad_() for s in src64]
    ref_w = w64.clone().requires_grad_()
    ref, _ = naive_depth_attention(ref_src, q64[0], None, 1e-6, output_norm_weight=ref_w)
    assert rel_err(y.double(), ref) < tol[0]
    for got, want in zip(grads(y, [*src, w]), grads(ref, [*ref_src, ref_w]), strict=True):
        assert rel_err(got.double(), want) < tol[1]

    src = [s.to(dtype).requires_grad_() for s in src64]
    accs, lse = completed_attention(src[:3], None, q64.to(dtype), 1e-6, "cpu")
    outs, _ = merge_completed(accs, lse, src[3:], None, q64.to(dtype), 1e-6, "cpu")
    for k in range(5):
        ref_src = [s.clone().requires_grad_() for s in src64]
        ref, _ = naive_depth_attention(ref_src, q64[k], None, 1e-6)
        assert rel_err(outs[k].double(), ref) < tol[0]
        for got, want in zip(grads(outs[k], src), grads(ref, ref_src), strict=True):
            assert rel_err(got.double(), want) < tol[1]
