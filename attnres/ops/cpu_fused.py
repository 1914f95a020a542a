"""Depth attention on CPU as one fused C++ loop each way (`csrc/depth_attention_cpu.cpp`).

The same math, arguments and saved statistics as `torch_fused.py` (its module docstring has
the per-token formulas), and the same entry points.
Per token the kernel keeps the n source rows in L1 while it forms the logits, the softmax,
the weighted sums and (backward) every gradient: each source is read once per call and
each gradient written once, where the plain-PyTorch formulation makes a pass over memory per
operation. On narrow models that is most of what AttnRes costs over a standard residual
(experiments/BENCHMARKS.md, "Small models on CPU").

The kernel is compiled on first use (torch.utils.cpp_extension: a C++ compiler and ninja;
about a minute once per machine, cached under TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions), for float32 and float64 sources. `available()` says whether it
built; when it does not (no compiler, say), one warning names the reason and kernel="auto"
takes the plain-PyTorch path, which gives the same results more slowly.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from attnres.ops.torch_fused import SECOND_ORDER_NORMED_MERGE, attend, differentiable_backward, inv_rms, second_order

__all__ = ["DTYPES", "GradSink", "available", "fused_depth_attention", "inv_rms", "load_error", "mix_one",
           "run_depth_attention"]

DTYPES = (torch.float32, torch.float64)
CACHED_STATISTICS = False  # `SourceStack` keeps no key statistics: the kernel computes them in passing
# `run_depth_attention(out_norm=...)` norms output 0 of any call (K queries, a prefix or not): the
# strategies' two-phase sites can hand the next sublayer its pre-norm (`attnres.functional`)
FUSED_OUTPUT_NORM = True
SOURCE = Path(__file__).with_name("csrc") / "depth_attention_cpu.cpp"
OPENMP_FAILED = "openmp-failed"  # in an OpenMP build's folder: that build failed here, do not try again
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cflags(openmp: bool) -> list[str]:
    """`openmp`: compile ATen's `parallel_for` as torch runs it. With an OpenMP torch (Linux
    wheels) the loop over threads is inlined into the kernel from ATen's header; compiled
    without -fopenmp it runs every token on one thread whatever torch.get_num_threads() says.
    Without it the loops are still vectorised (-fopenmp-simd)."""
    flags = ["-O3", "-fno-math-errno", "-fopenmp" if openmp else "-fopenmp-simd"]
    if platform.machine() in ("x86_64", "AMD64") and sys.platform.startswith("linux"):
        flags.append("-march=native")  # the build name carries the CPU's features (`_build_name`)
    return flags


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_name(flags: Sequence[str]) -> str:
    """One build per source, flags, torch and CPU: a cache shared by machines of other CPUs
    (a home directory on a cluster) never hands one a binary for instructions it lacks."""
    key = "\n".join([SOURCE.read_text(), " ".join(flags), torch.__version__, _cpu_features()])
    return "attnres_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """One attnres process at a time builds or loads in `build_dir` (the workers of a sweep
    start together). An flock, which the system releases when its holder dies: torch's own
    lock file stays behind when a build is killed, and every later build would wait on it for
    ever, so whoever holds this lock removes that file. Without flock (Windows), torch's lock
    alone."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build_dir / "attnres.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # no build is running: it is a killed one's
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build() -> None:
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    # with torch's OpenMP threads when torch has them (a compiler without OpenMP, e.g. Apple's
    # clang, fails that build: then a one-thread build, which is what the loops do without it;
    # the failure is remembered in the build folder, so later processes go straight to it)
    choices = [True, False] if torch.backends.openmp.is_available() else [False]
    for openmp in choices:
        flags = _cflags(openmp)
        name = _build_name(flags)
        build_dir = Path(root) / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        if openmp and (build_dir / OPENMP_FAILED).exists():
            continue
        try:
            with _exclusive(build_dir):
                compiling = not (build_dir / f"{name}.so").exists()
                if compiling:
                    print("attnres: compiling the fused CPU depth-attention kernel (once per machine, about a minute; "
                          "residual.kernel=torch skips it)", file=sys.stderr, flush=True)
                started = time.perf_counter()
                cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags,
                                   extra_ldflags=["-fopenmp"] if openmp else None, is_python_module=False,
                                   build_directory=str(build_dir), verbose=False)
                if compiling:
                    print(f"attnres: the fused CPU kernel is built ({time.perf_counter() - started:.0f} s; "
                          f"cached in {build_dir})", file=sys.stderr, flush=True)
            break
        except Exception as exc:  # noqa: BLE001  (the OpenMP build failed: try the one-thread build; its failure is raised)
            if not openmp or "interrupted" in str(exc):  # ninja stopped by a signal: no verdict on OpenMP
                raise
            reason = _reason(exc)
            (build_dir / OPENMP_FAILED).write_text(f"{reason}\n")
            print(f"attnres: the fused CPU kernel could not be built with OpenMP ({reason}); building it to run "
                  f"on one thread (remove {build_dir / OPENMP_FAILED} to try again)", file=sys.stderr, flush=True)
    _state["threads"] = "openmp" if openmp else "one"
    torch.ops.attnres_cpu.forward  # noqa: B018  (raises if the library did not register)
    _register_fakes()


def _reason(exc: BaseException) -> str:
    """One line from a build failure: the compiler's first error when there is one."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and "Error building extension" not in ln]
    line = (errors or lines or [type(exc).__name__])[0]
    return line if len(line) <= 300 else line[:297] + "..."


def available() -> bool:
    """Whether the C++ kernel is built and loaded (building it on the first call); False, with
    one warning naming the reason, when it cannot be. While torch.compile traces, it builds
    nothing (it answers whether an earlier call did)."""
    if "ok" in _state or torch.compiler.is_compiling():
        return bool(_state.get("ok", False))
    with _lock:
        if "ok" not in _state:
            if os.environ.get("ATTNRES_CPU_KERNEL", "1") == "0":
                _state["ok"], _state["error"] = False, "ATTNRES_CPU_KERNEL=0 in the environment"
            else:
                try:
                    _build()
                    _state["ok"] = True
                except Exception as exc:  # noqa: BLE001  (any build failure: fall back, say why)
                    reason = _reason(exc)
                    _state["ok"], _state["error"] = False, reason
                    warnings.warn(
                        f"attnres: the fused CPU kernel could not be built ({reason}); using the plain-PyTorch "
                        "path, which gives the same results more slowly on narrow models (install a C++ compiler "
                        "and ninja to get it, or set residual.kernel=torch to silence this)",
                        RuntimeWarning, stacklevel=2,
                    )
    return bool(_state["ok"])


def load_error() -> str | None:
    """Why the kernel is not available, or None."""
    return _state.get("error")  # type: ignore[return-value]


def _register_fakes() -> None:
    """Shapes of the C++ ops' outputs, for torch.compile's tracing."""

    @torch.library.register_fake("attnres_cpu::forward")
    def _(vals, r_cache, queries, prefix_h, prefix_lse, eps, out_norm, out_eps):
        shape, n, K = vals[0].shape, len(vals), queries.shape[0]
        lead, new = shape[:-1], queries.new_empty
        norm = out_norm is not None
        r = new((n, *lead)) if r_cache is None else new(r_cache.shape)
        return ([new(shape) for _ in range(K)], new((K, n, *lead)), new((K, *lead)), r,
                new(shape if norm else (0,)), new(lead if norm else (0,)))

    @torch.library.register_fake("attnres_cpu::backward")
    def _(vals, r, queries, z, lse, prefix_lse, outs, d_outs, dz_ext, dlse, out_norm, h, h_inv_rms, accumulate):
        shape, K = vals[0].shape, queries.shape[0]
        new = queries.new_empty
        pre = prefix_lse is not None
        return ([new(shape) for _ in vals], new((K, shape[-1])), [new(shape) for _ in range(K)] if pre else [],
                new((K, *shape[:-1]) if pre else (0,)), new((shape[-1],) if out_norm is not None else (0,)))


class GradSink:
    """The gradients of one pass's completed sources (`attnres.functional.SourceStack`), one
    buffer each. Every call that reads a tracked source adds its gradient into the source's
    buffer inside the C++ backward loop, where autograd would have each call write a fresh
    tensor and then add it to the others in a pass over memory of its own (three tensor passes
    saved per source and call). `track`'s node runs after all of them (autograd's order) and
    hands the sum on once, with whatever reached the source by other paths."""

    def __init__(self) -> None:
        self.grads: dict[int, Tensor] = {}

    def track(self, source: Tensor, index: int) -> Tensor:
        return _Collect.apply(source, self, index)


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, source, sink, index):
        ctx.sink, ctx.index = sink, index
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        total = ctx.sink.grads.pop(ctx.index, None)
        if grad is not None:
            total = grad if total is None else total.add_(grad)
        return total, None, None


class _CpuDepthAttention(torch.autograd.Function):
    """Autograd around the two C++ ops, as lean as it can be (a depth attention per sublayer,
    twice per layer, on models whose sublayers take a millisecond or two): the sources,
    prefixes and cotangents go to C++ in their own shapes, nothing is reshaped or copied here.
    Saves the statistics r, z and lse, references to the sources, and with a prefix the
    outputs (the caller keeps them anyway: they are sublayer inputs). A backward that is itself
    differentiated (create_graph=True) runs `torch_fused.differentiable_backward` instead of the
    C++ one, which autograd cannot differentiate, and hands the source gradients to autograd,
    not to the gradient sink; with a fused output norm and a prefix it refuses in one line
    (SECOND_ORDER_NORMED_MERGE)."""

    @staticmethod
    def forward(ctx, eps, r_cache, queries, prefix_lse, out_norm, slots, n, out_eps, *tensors):  # n sources, K prefixes
        sources, prefix_h = list(tensors[:n]), list(tensors[n:])
        ctx.slots = slots  # None, or (sink, each source's index in it or None): see GradSink
        outs, z, lse, r, h, hn = torch.ops.attnres_cpu.forward(sources, r_cache, queries, prefix_h, prefix_lse, eps,
                                                               out_norm, out_eps)
        ctx.n, ctx.K, ctx.has_prefix, ctx.has_norm = n, queries.shape[0], prefix_lse is not None, out_norm is not None
        ctx.eps, ctx.out_eps = eps, out_eps
        ctx.mark_non_differentiable(r, h, hn)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(queries, r, z, lse, prefix_lse, out_norm, h, hn, *sources,
                              *(outs if ctx.has_prefix else ()))
        return (*outs, z, lse, r, h, hn)

    @staticmethod
    def backward(ctx, *grads):
        n, K = ctx.n, ctx.K
        # zeros that have no storage (gradcheck's, functorch's) are no cotangent for the kernel
        if not torch.compiler.is_compiling():
            grads = [None if g is None or g._is_zerotensor() else g for g in grads]
        d_outs, dz, dlse = grads[:K], grads[K], grads[K + 1]
        n_prefix = K if ctx.has_prefix else 0
        if dz is None and dlse is None and all(g is None for g in d_outs):
            return (None,) * (8 + n + n_prefix)
        queries, r, z, lse, prefix_lse, out_norm, h, hn, *rest = ctx.saved_tensors
        sources, outs = rest[:n], rest[n:]
        if not ctx.has_norm:
            out_norm = h = hn = None
        if second_order():  # create_graph=True: differentiable operations, the sink bypassed
            if ctx.has_norm and ctx.has_prefix:  # h needs the prefix's value, which is not kept
                raise RuntimeError(SECOND_ORDER_NORMED_MERGE)
            d_src, d_q, d_pre_h, d_pre_lse, d_w = differentiable_backward(
                sources, ctx.eps, queries, z, lse, prefix_lse, outs, d_outs, dz, dlse, out_norm, ctx.out_eps)
            return (None, None, d_q, d_pre_lse, d_w, None, None, None, *d_src, *d_pre_h)
        into: list[Tensor | None] = []
        if ctx.slots is not None:
            sink, index = ctx.slots
            into = [None if i is None else sink.grads.get(i) for i in index]
        d_src, d_q, d_pre_h, d_pre_lse, d_w = torch.ops.attnres_cpu.backward(
            sources, r, queries, z, lse, prefix_lse, outs, d_outs, dz, dlse, out_norm, h, hn, into
        )
        if ctx.slots is not None:  # tracked sources: their gradient stays in the sink
            d_src = list(d_src)
            for j, i in enumerate(index):
                if i is not None:
                    sink.grads[i], d_src[j] = d_src[j], None
        return (None, None, d_q, d_pre_lse if ctx.has_prefix else None, d_w if ctx.has_norm else None, None, None,
                None, *d_src, *d_pre_h)


def run_depth_attention(
    sources: Sequence[Tensor],
    r_cache: Tensor | None,
    queries: Tensor,
    prefix_h: Sequence[Tensor] = (),
    prefix_lse: Tensor | None = None,
    eps: float = 1e-6,
    out_norm: Tensor | None = None,
    stacked: Tensor | None = None,
    out_eps: float | None = None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """`torch_fused.run_depth_attention` on the C++ kernels: float32 or float64 CPU sources
    (..., D), queries (K, D) and prefixes of the same dtype. `stacked`: what
    `SourceStack.take` gives with the sources for this kernel, (GradSink, each source's index
    in it or None), or None; the kernels read the sources where they are. `out_norm` (D,): output
    0 is RMSNorm(h_0) * out_norm with eps `out_eps` (None: `eps`), for any number of queries,
    with or without a prefix (`FUSED_OUTPUT_NORM`)."""
    out_eps = eps if out_eps is None else out_eps
    n = len(sources)
    if torch.is_grad_enabled() and (queries.requires_grad or any(t.requires_grad for t in sources)
                                    or any(t.requires_grad for t in prefix_h)
                                    or any(t is not None and t.requires_grad for t in (prefix_lse, out_norm))):
        *outs, z, lse, _, _, _ = _CpuDepthAttention.apply(eps, r_cache, queries, prefix_lse, out_norm, stacked, n,
                                                          out_eps, *sources, *prefix_h)
        return outs, z, lse
    with torch.no_grad():
        outs, z, lse, *_ = torch.ops.attnres_cpu.forward(list(sources), r_cache, queries, list(prefix_h), prefix_lse,
                                                         eps, out_norm, out_eps)
    return list(outs), z, lse


def mix_one(sources: Sequence[Tensor], queries: Tensor, row: int, eps: float) -> Tensor:
    """h of row `row` of the gain-folded queries (K, D) over `sources` (..., D), without
    gradient, in one call of the kernel's lean entry (`mix` in the C++ source: one allocation,
    the query picked there): the strategies' one-pass route (decoding), where a call's fixed cost
    is the mix's cost. The caller holds `torch.no_grad()` or inference mode."""
    op = _state.get("mix")
    if op is None:
        op = _state["mix"] = torch.ops.attnres_cpu.mix.default
    return op(sources, queries, row, eps)


def fused_depth_attention(
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    output_norm_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`torch_fused.fused_depth_attention` on the C++ core (float32 or float64 CPU sources)."""
    return attend(run_depth_attention, sources, pseudo_query, norm_weight, eps, output_norm_weight)
