"""Cost of AttnRes against the standard residual, measured in one process.

For standard, Block AttnRes (N blocks, default 8) and Full AttnRes at one model shape
(default GPT-small: 12 layers, 768 wide, 12 heads, T 1024, batch 16, vocab 32768, bf16 on
GPU), measures

- train step time: forward + backward + AdamW step,
- prefill time: a no-grad forward in eval mode,
- peak memory of both (CUDA max_memory_allocated; not measured on CPU), and on any device the
  activations autograd saves for the backward of one train forward,

eager and under torch.compile, and the depth-attention op alone (N + 1 sources, all B*T
tokens) against its memory-traffic floor; and for each AttnRes strategy the least bytes the
depth-attention calls of one train step move, as time at the measured bandwidth and as the
least ratio to standard's step any implementation of them could reach. Times are medians of
repeated steps after warm-up, CUDA events on GPU; the strategies are timed in interleaved
rounds (standard, block, full, standard, ...) so that a busy machine slows all of them alike.
Prints a table of ratios to standard and, with --json PATH, writes every figure: the file is
rewritten (atomically) as each stage, mode and strategy finishes, so a run cut by a timeout keeps
what it measured; its "stages_done" lists the stages it holds in full.

With --op-shapes it measures only the op, at two fixed shapes that guard its implementations
against regressions (issue 29: the torch path's forward went from 7.8 to 32.5 ms at the first,
its extra peak memory from 521 MB to 1,000 MB at the second, when it began stacking its
sources): 9 sources x 4,096 tokens x D 256, forward and forward + backward time; and 9 sources
x 16,384 tokens x D 768, the extra peak memory of a forward + backward (on CPU, the profiler's
running total of tensor allocations; `op_peak_bytes`). Every implementation, as ratios to the
naive reference measured in the same run.

    python experiments/bench_residuals.py                  # GPU, GPT-small, eager + compiled
    python experiments/bench_residuals.py --quick          # CPU-sized (T 128, batch 2), eager, 1 thread
    python experiments/bench_residuals.py --quick --kernel naive   # the reference path ("before")
    python experiments/bench_residuals.py --tiny --compile # the runner's default model, eager + compiled
    python experiments/bench_residuals.py --op-shapes      # the op's regression shapes (CPU: 1 thread)
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnres import BlockAttentionResidual, FullAttentionResidual, StandardResidual, Transformer
from attnres.atomic import write_json
from attnres.functional import KERNELS, depth_attention, resolve_kernel
from attnres.ops.dispatch import triton_available
from attnres.training.devices import keep_freed_memory

GPT_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq_len": 1024, "batch": 16, "vocab": 32768}
# --quick keeps GPT-small's depth, width and vocabulary (what sets AttnRes's cost relative to
# the rest of a step, per token) and shrinks only the tokens per step, to fit a CPU
QUICK = {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq_len": 128, "batch": 2, "vocab": 32768}
# --tiny is the runner's default run (conf/model/tiny.yaml, conf/data/stdlib.yaml): 8 layers, D 96,
# 4 heads, T 128, batch 16, bytes; there the cost is the number of small ops, not their arithmetic
TINY = {"n_layer": 8, "n_embd": 96, "n_head": 4, "seq_len": 128, "batch": 16, "vocab": 256}
# --op-shapes: (sources, tokens, D) of the op's timing and of its memory measurement
OP_TIME_SHAPE = (9, 4096, 256)
OP_MEMORY_SHAPE = (9, 16384, 768)
H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e peak
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATEGIES = ("standard", "block", "full", "block-prenorm", "full-prenorm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help=f"CPU-sized shape ({QUICK}); compile off unless --compile")
    p.add_argument("--tiny", action="store_true",
                   help=f"the runner's default model and batch ({TINY}); CPU, 1 thread, compile off unless --compile")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all figures here")
    p.add_argument("--steps", type=int, default=None, help="timed steps per strategy and mode (default 10, quick 8)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, quick 2)")
    p.add_argument("--compile", dest="modes", action="store_const", const="eager,compiled",
                   help="eager and torch.compile (the default except with --quick)")
    p.add_argument("--no-compile", dest="modes", action="store_const", const="eager", help="eager only")
    p.add_argument("--modes", dest="modes", default=None,
                   help="comma-separated subset of eager,compiled (e.g. 'compiled' alone, to split a long GPU run)")
    p.add_argument("--kernel", default="auto", choices=KERNELS,
                   help="depth-attention implementation of the AttnRes strategies (naive = the reference path)")
    p.add_argument("--strategies", default="standard,block,full",
                   help=f"comma-separated subset of {','.join(STRATEGIES)} (-prenorm: each sublayer's pre-norm fused "
                        "into its depth mix, the strategies' fuse_prenorm)")
    p.add_argument("--num-blocks", type=int, default=8)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: 1 with --quick, else torch's; on a small shared "
                        "machine, multi-threaded ops measure the scheduler more than the op)")
    p.add_argument("--cpu-time", action="store_true",
                   help="on CPU, time each call in the thread's CPU time, not the wall clock (a loaded machine; "
                        "meaningful with --threads 1)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help=f"bytes/s of the op's floor (default: H200 {H200_BANDWIDTH:.1e} on CUDA, a copy on CPU)")
    p.add_argument("--op-only", action="store_true", help="only the op-vs-floor measurement")
    p.add_argument("--op-reps", type=int, default=None,
                   help="timed rounds of the op alone (default 20 on CUDA, 5 on CPU); every arm in each round")
    p.add_argument("--op-shapes", action="store_true",
                   help="only the op at its two regression shapes, every implementation, as ratios to naive: "
                        f"(sources, tokens, D) {OP_TIME_SHAPE} forward and forward+backward time, "
                        f"{OP_MEMORY_SHAPE} extra peak memory of forward+backward (CPU: 1 thread unless --threads)")
    p.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                   help="leave the C library's allocator as it starts (the runner's keep_freed_memory=false); "
                        "by default the process keeps freed memory, as the runner does (attnres/training/devices.py)")
    args = p.parse_args(argv)
    if args.quick and args.tiny:
        p.error("--quick and --tiny are two shapes: give one")
    small = args.quick or args.tiny
    shape = dict(TINY if args.tiny else QUICK if args.quick else GPT_SMALL)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    args.shape = shape
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = DTYPES[args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")]
    args.steps = args.steps or (8 if args.quick else 20 if args.tiny or args.op_shapes else 10)
    args.warmup = args.warmup or (2 if args.quick else 3)
    args.modes = [m.strip() for m in (args.modes or ("eager" if small else "eager,compiled")).split(",")]
    if not set(args.modes) <= {"eager", "compiled"}:
        p.error(f"--modes takes eager and/or compiled, got {args.modes}")
    if args.threads is None and (small or args.op_shapes) and args.device.type == "cpu":
        args.threads = 1
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown or not args.strategies:
        p.error(f"--strategies takes a comma-separated subset of {','.join(STRATEGIES)}, got {unknown or 'none'}")
    return args


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


class Timer:
    """Wall time on CPU (or with `cpu_time` the thread's CPU time, `time.thread_time`: on a machine
    shared with other jobs the wall clock also counts the time the scheduler gives to them; right
    at 1 thread, where every op runs on the calling thread), CUDA events on GPU (read after one
    synchronize per round)."""

    def __init__(self, device: torch.device, cpu_time: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.clock = time.thread_time if cpu_time else time.perf_counter

    def __call__(self, fn: Callable[[], object]) -> Callable[[], float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            return lambda: start.elapsed_time(end) / 1e3
        t = self.clock()
        fn()
        dt = self.clock() - t
        return lambda: dt

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], steps: int, warmup: int, timer: Timer) -> dict[str, dict]:
    """Median seconds per call of each fn; rounds rotate the order. Also the first call's time
    (compilation included, for compiled fns)."""
    first = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()
        timer.sync()
        first[name] = time.perf_counter() - t
        for _ in range(warmup - 1):
            fn()
    timer.sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(steps):
        order = names[r % len(names):] + names[: r % len(names)]
        pending = [(name, timer(fns[name])) for name in order]
        timer.sync()
        for name, read in pending:
            samples[name].append(read())
    return {
        name: {"median_s": statistics.median(s), "min_s": min(s), "first_call_s": first[name], "samples_s": s}
        for name, s in samples.items()
    }


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


def strategy_factory(name: str, args: argparse.Namespace):
    """`name`: standard, block or full (each sublayer's pre-norm its own, `fuse_prenorm=False`, whatever
    the default); block-prenorm and full-prenorm are those with each sublayer's pre-norm fused into its
    depth mix (`fuse_prenorm=True`)."""
    base, _, variant = name.partition("-")
    if base == "standard" and not variant:
        return StandardResidual
    if base in ("block", "full") and variant in ("", "prenorm"):
        fused = variant == "prenorm"
        if base == "block":
            return functools.partial(BlockAttentionResidual, num_blocks=args.num_blocks, kernel=args.kernel,
                                     fuse_prenorm=fused)
        return functools.partial(FullAttentionResidual, kernel=args.kernel, fuse_prenorm=fused)
    raise ValueError(f"unknown strategy {name!r}; choose from standard, block, full, block-prenorm, full-prenorm")


def saved_forward_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for the backward of `forward()` (each
    storage counted once, `model`'s parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out  # the graph (and the saved tensors) could be freed only now
    return sum(saved.values())


class Case:
    """One strategy: model, optimizer, data, and its step functions (eager or compiled)."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        s = args.shape
        torch.manual_seed(0)
        self.model = Transformer(
            vocab_size=s["vocab"], n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
            block_size=s["seq_len"], residual=strategy_factory(name, args),
        ).to(device=args.device, dtype=args.dtype)
        residual = self.model.residual
        if hasattr(residual, "pseudo_query"):  # trained-looking queries: weights far from uniform
            with torch.no_grad():
                residual.pseudo_query.normal_(0.0, 1.0 / s["n_embd"] ** 0.5)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        gen = torch.Generator().manual_seed(1)
        shape = (s["batch"], s["seq_len"])
        self.idx = torch.randint(0, s["vocab"], shape, generator=gen).to(args.device)
        self.targets = torch.randint(0, s["vocab"], shape, generator=gen).to(args.device)
        self.compiled = None

    def train_step(self, compiled: bool = False) -> None:
        model = self.compiled if compiled else self.model
        self.model.train()
        loss = model(self.idx, targets=self.targets)["loss"]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def prefill(self, compiled: bool = False) -> None:
        model = self.compiled if compiled else self.model
        self.model.eval()
        with torch.no_grad():
            model(self.idx)

    def saved_bytes(self) -> int:
        """Bytes autograd keeps for the backward of one eager training forward (each storage
        counted once, parameters left out): the activations a train step holds at its peak,
        measurable on any device."""
        self.model.train()
        return saved_forward_bytes(self.model, lambda: self.model(self.idx, targets=self.targets)["loss"])

    def static_bytes(self) -> int:
        """Parameters and optimizer state: resident between steps, counted in the peak."""
        n = sum(p.numel() * p.element_size() for p in {id(p): p for p in self.model.parameters()}.values())
        for state in self.opt.state.values():
            n += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return n


def peak_bytes(case: Case, fn: Callable[[], None], device: torch.device) -> int | None:
    """Peak memory of one call as if the case were alone on the device: the rise of
    max_memory_allocated during the call plus the case's resident parameters and optimizer
    state. None on CPU (not measured: no allocator statistics there)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base + case.static_bytes()


# ------------------------------------------------------------------------------------------------
# the op alone
# ------------------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, cpu_time: bool = False) -> float:
    """Bytes/s of a large copy (read + write) on this device, best of a few."""
    src = torch.empty(16 * 2**20, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timer, best = Timer(device, cpu_time), float("inf")
    for _ in range(3):
        dst.copy_(src)
    for _ in range(10):
        read = timer(lambda: dst.copy_(src))
        timer.sync()
        best = min(best, read())
    return 2 * src.numel() * src.element_size() / best


def cold_stream_bandwidth(args: argparse.Namespace) -> float | None:
    """Bytes/s of the simplest op with the depth attention's access pattern, on data out of
    cache: a sum of N + 1 tensors of (B, T, D) into one (torch.sum over a stacked copy, each
    source a stream), after writing 256 MB so that none of them is left in a CPU cache. In a
    train step the sources were written long before they are read again, with the sublayers'
    activations in between. None on a GPU (not measured: there the copy rate is the rate)."""
    if args.device.type != "cpu":
        return None
    s, n_src = args.shape, args.num_blocks + 1
    stacked = torch.randn(n_src, s["batch"], s["seq_len"], s["n_embd"], dtype=args.dtype)
    out = torch.empty(stacked.shape[1:], dtype=args.dtype)
    flush = torch.empty(64 * 2**20)  # 256 MB of float32
    best, clock = float("inf"), time.thread_time if args.cpu_time else time.perf_counter
    for _ in range(7):
        flush.fill_(1.0)
        t = clock()
        torch.sum(stacked, 0, out=out)
        best = min(best, clock() - t)
    return (n_src + 1) * out.numel() * out.element_size() / best


def op_inputs(n_src: int, lead: tuple[int, ...], d: int, args: argparse.Namespace, seed: int = 0):
    """`n_src` leaf sources (*lead, D) in the benchmark's dtype and device, a query with O(1)
    logits and a unit key-norm gain (float32 leaves)."""
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(*lead, d, generator=gen).to(args.device, args.dtype).requires_grad_() for _ in range(n_src)]
    query = (torch.randn(d, generator=gen) / d**0.5).to(args.device).requires_grad_()
    gain = torch.ones(d, device=args.device, requires_grad=True)
    return sources, query, gain


def op_kernels(like: torch.Tensor) -> list[str]:
    """The implementations that serve sources like `like`: the reference and the torch path
    always, Triton on CUDA where it is installed, the C++ kernel where `kernel="auto"` takes it."""
    kernels = ["naive", "torch"] + (["triton"] if like.is_cuda and triton_available() else [])
    return kernels + (["cpu"] if resolve_kernel("auto", like) == "cpu" else [])


# tensor passes of the op alone over n sources (one (B, T, D) tensor each): forward reads the
# sources and writes h; backward reads dh and the sources and writes their gradients. With the next
# pre-norm fused in (`+norm`) forward writes y and keeps h, backward reads dy and h in place of dh.
# Composed (`,norm`: the op, then F.rms_norm) adds the norm's own 5: forward reads h and writes y,
# backward reads dy and h and writes dh.
OP_PASSES = {
    "": {"forward": lambda n: n + 1, "forward_backward": lambda n: 3 * n + 2},
    "+norm": {"forward": lambda n: n + 2, "forward_backward": lambda n: 3 * n + 4},
    ",norm": {"forward": lambda n: n + 3, "forward_backward": lambda n: 3 * n + 7},
}


def op_arms(kernels: list[str]) -> list[tuple[str, str]]:
    """(kernel, arm) pairs the op is timed as: each kernel plain; the kernels that fuse the next
    sublayer's pre-norm (the C++ one, Triton's one-query path) also with it fused in (`+norm`) and
    composed after the plain op (`,norm`), so the fused path's gain is measured on every device."""
    return [(k, "") for k in kernels] + [(k, arm) for k in kernels if k in ("cpu", "triton")
                                         for arm in ("+norm", ",norm")]


def bench_op(args: argparse.Namespace, bandwidth: float) -> dict:
    """Depth attention over N + 1 sources of (B, T, D), forward and forward + backward, per
    implementation, against the floor (`OP_PASSES`: 3 (N + 1) + 2 tensor passes in all); on the
    C++ and Triton kernels also with the next sublayer's pre-norm fused in (`cpu+norm`,
    `triton+norm`) and composed after the op (`cpu,norm`, `triton,norm`), each against its own floor."""
    s, dev, dtype = args.shape, args.device, args.dtype
    n_src = args.num_blocks + 1
    sources, query, gain = op_inputs(n_src, (s["batch"], s["seq_len"]), s["n_embd"], args)
    norm_weight = torch.ones(s["n_embd"], device=dev, requires_grad=True)
    dh = torch.randn_like(sources[0])
    tensor_bytes = sources[0].numel() * sources[0].element_size()

    def floor(arm: str) -> dict:
        return {mode: passes(n_src) * tensor_bytes / bandwidth for mode, passes in OP_PASSES[arm].items()}

    kernels = op_kernels(sources[0])
    arms = op_arms(kernels)
    timer = Timer(dev, args.cpu_time)
    out = {"sources": n_src, "tokens": s["batch"] * s["seq_len"], "D": s["n_embd"], "dtype": str(dtype),
           "bandwidth_bytes_per_s": bandwidth, "floor_s": floor(""), "kernels": {}}

    def call(kernel: str, arm: str) -> torch.Tensor:
        h, _ = depth_attention(sources, query, gain, kernel=kernel,
                               output_norm_weight=norm_weight if arm == "+norm" else None)
        return torch.nn.functional.rms_norm(h, h.shape[-1:], norm_weight, 1e-6) if arm == ",norm" else h

    def fwd(kernel: str, arm: str) -> None:
        with torch.no_grad():
            call(kernel, arm)

    def fwd_bwd(kernel: str, arm: str) -> None:
        call(kernel, arm).backward(dh)
        for x in (*sources, query, gain, norm_weight):  # assigned afresh each call, never added up
            x.grad = None

    # every arm and mode in one set of rounds: a load that comes and goes meets them all alike
    fns = {(kernel + arm, mode): functools.partial(fn, kernel, arm) for kernel, arm in arms
           for mode, fn in (("forward", fwd), ("forward_backward", fwd_bwd))}
    reps = args.op_reps or (20 if dev.type == "cuda" else 5)
    res = interleaved(fns, reps, 3, timer)
    for kernel, arm in arms:
        floors = floor(arm)
        out["kernels"][kernel + arm] = {
            mode: {"median_s": r["median_s"], "min_s": r["min_s"], "floor_s": floors[mode],
                   "vs_floor": r["median_s"] / floors[mode]}
            for mode in floors for r in [res[(kernel + arm, mode)]]
        }
    return out


def op_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The most memory `fn()` holds at once beyond what was allocated when it started (its
    results included, e.g. the gradients a backward leaves in .grad). CUDA: the rise of
    max_memory_allocated. CPU, which keeps no allocator statistics: torch.profiler with
    profile_memory=True, whose "[memory]" events (one per tensor allocation and free, in order)
    carry the allocator's running total ("Total Allocated"); the peak of that total less its
    value before the first event. It counts tensor storage only (not the Python heap, nor pages
    the C library keeps), which is what an implementation changes."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    if not memory:
        return 0
    base = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in memory) - base


def bench_op_shapes(args: argparse.Namespace, time_shape: tuple[int, int, int] = OP_TIME_SHAPE,
                    memory_shape: tuple[int, int, int] = OP_MEMORY_SHAPE) -> dict:
    """The op at its regression shapes (`--op-shapes`), (sources, tokens, D) each, every
    implementation: forward (no grad) and forward + backward times at `time_shape`, timed in
    interleaved rounds; the extra peak memory of one forward + backward at `memory_shape`
    (`op_peak_bytes`). Each figure also as a ratio to naive's: of medians for the memory, and
    for the times the median over rounds of the ratio within a round (`paired_ratio`)."""
    dev, timer = args.device, Timer(args.device)
    n_src, tokens, d = time_shape
    sources, query, gain = op_inputs(n_src, (1, tokens), d, args)
    dh = torch.randn_like(sources[0])
    kernels = op_kernels(sources[0])

    def forward(kernel: str) -> None:
        with torch.no_grad():
            depth_attention(sources, query, gain, kernel=kernel)

    def forward_backward(kernel: str, srcs: list, q: torch.Tensor, g: torch.Tensor, cot: torch.Tensor) -> None:
        h, _ = depth_attention(srcs, q, g, kernel=kernel)
        h.backward(cot)

    def fresh(kernel: str) -> None:  # gradients assigned, not added to last round's
        for x in (*sources, query, gain):
            x.grad = None
        forward_backward(kernel, sources, query, gain, dh)

    fns = {}
    for kernel in kernels:
        fns[f"{kernel} forward"] = functools.partial(forward, kernel)
        fns[f"{kernel} forward_backward"] = functools.partial(fresh, kernel)
    timed = interleaved(fns, args.steps, args.warmup, timer)
    out = {"time": {"sources": n_src, "tokens": tokens, "D": d, "kernels": {}},
           "memory": {"sources": memory_shape[0], "tokens": memory_shape[1], "D": memory_shape[2], "kernels": {}}}
    for kernel in kernels:
        row = out["time"]["kernels"][kernel] = {}
        for mode in ("forward", "forward_backward"):
            samples, base = timed[f"{kernel} {mode}"]["samples_s"], timed[f"naive {mode}"]["samples_s"]
            row[f"{mode}_s"] = statistics.median(samples)
            row[f"{mode}_vs_naive"] = paired_ratio(samples, base)[1]
    del sources, query, gain, dh, fns
    n_src, tokens, d = memory_shape
    sources, query, gain = op_inputs(n_src, (1, tokens), d, args, seed=1)
    dh = torch.randn_like(sources[0])
    out["memory"]["inputs_bytes"] = n_src * sources[0].numel() * sources[0].element_size()
    for kernel in kernels:
        for x in (*sources, query, gain):  # freed before the measurement starts
            x.grad = None
        peak = op_peak_bytes(functools.partial(forward_backward, kernel, sources, query, gain, dh), dev)
        out["memory"]["kernels"][kernel] = {"peak_extra_bytes": peak}
    naive = out["memory"]["kernels"]["naive"]["peak_extra_bytes"]
    for row in out["memory"]["kernels"].values():
        row["vs_naive"] = row["peak_extra_bytes"] / naive if naive else None
    return out


def report_op_shapes(results: dict) -> None:
    shapes = results["op_shapes"]
    t, m = shapes["time"], shapes["memory"]
    print(f"\nop at its regression shapes, ratios to naive in the same run (times: median over rounds)\n"
          f"  time, {t['sources']} sources x {t['tokens']} tokens x D {t['D']}:")
    for kernel, r in t["kernels"].items():
        print(f"    {kernel:<7} forward {r['forward_s'] * 1e3:8.2f} ms ({r['forward_vs_naive']:.3f}x)   "
              f"forward+backward {r['forward_backward_s'] * 1e3:8.2f} ms ({r['forward_backward_vs_naive']:.3f}x)")
    print(f"  extra peak memory of forward+backward, {m['sources']} sources x {m['tokens']} tokens x D {m['D']} "
          f"(the sources: {m['inputs_bytes'] / 1e6:.0f} MB):")
    for kernel, r in m["kernels"].items():
        ratio = "n/a" if r["vs_naive"] is None else f"{r['vs_naive']:.3f}x"
        print(f"    {kernel:<7} {r['peak_extra_bytes'] / 1e6:8.0f} MB ({ratio})")


def call_traffic(calls: list[tuple[list[int], int, int, int, int, bool]]) -> int:
    """The least bytes a train step's depth-attention calls move (the op's contract, any
    implementation): `calls` are (each source's storage, K queries, prefixes, row bytes, tokens,
    whether the next pre-norm is fused in), in forward order. A row is one (..., D) tensor;
    statistics (r, z, log-sum-exp, 4 bytes a value) are counted too. Forward reads the n sources
    and the prefixes and writes K outputs; backward reads the sources, the K cotangents (and with
    prefixes the outputs), writes the prefixes' gradients, and adds each source's gradient to those
    of the other calls that read it: written by the first call whose backward runs, read and
    rewritten by each later one. A call with the pre-norm fused in also writes h forward and reads
    it backward (2 rows), and takes over the sublayer's own norm, whose 5 rows (forward: read h,
    write y; backward: read dy and h, write dh) standard's step also moves: it counts 3 rows less."""
    readers: dict[int, int] = {}
    total = 0
    for sources, K, P, row, m, normed in calls:
        n = len(sources)
        for s in sources:
            readers[s] = readers.get(s, 0) + 1
        stats = (n + K * n + K + P) * m * 4
        total += (n + P + K) * row + stats  # forward
        total += (n + K + 2 * P) * row + stats  # backward, less the source gradients
        total -= 3 * row if normed else 0
    if not calls:
        return 0
    return total + sum(2 * c - 1 for c in readers.values()) * calls[0][3]  # the sources' gradients


def depth_traffic(case: Case) -> dict | None:
    """The depth-attention calls of one eager train step of `case` and the least bytes they move
    (`call_traffic`), or None for a strategy that makes none. Counted at the implementations'
    entry points (`run_depth_attention`, torch_fused's `merge_one`), whichever the case takes."""
    from attnres.ops import cpu_fused, torch_fused

    modules = [cpu_fused, torch_fused]
    if triton_available():
        from attnres.ops import triton_fused

        modules.append(triton_fused)
    calls: list[tuple[list[int], int, int, int, int, bool]] = []

    def record(sources, queries_rows: int, prefixes: int, normed: bool = False) -> None:
        v = sources[0]
        calls.append(([s.untyped_storage().data_ptr() for s in sources], queries_rows, prefixes,
                      v.numel() * v.element_size(), v.numel() // v.shape[-1], normed))

    originals = [(m, "run_depth_attention", m.run_depth_attention) for m in modules]
    originals.append((torch_fused, "merge_one", torch_fused.merge_one))

    def wrap_run(fn):
        def run(sources, r_cache, queries, prefix_h=(), *rest, **kw):
            record(list(sources), queries.shape[0], len(prefix_h), kw.get("out_norm") is not None)
            return fn(sources, r_cache, queries, prefix_h, *rest, **kw)
        return run

    def wrap_merge(fn):
        def merge(acc, lse, source, query, eps):
            record([source], 1, 1)
            return fn(acc, lse, source, query, eps)
        return merge

    for module, name, fn in originals:
        setattr(module, name, wrap_merge(fn) if name == "merge_one" else wrap_run(fn))
    try:
        case.train_step()
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    if not calls:
        return None
    return {"calls": len(calls), "bytes": call_traffic(calls)}


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def paired_ratio(samples: list[float], base: list[float]) -> tuple[float, float, float]:
    """Quartiles (first, median, third) of each round's time over the base's time in the same
    round: the rounds run the strategies one after another, so a machine that slows down for a
    while moves both sides of a round's ratio, where it moves the medians of each apart."""
    ratios = [x / b for x, b in zip(samples, base, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[1], q[2]


def fmt_ratio(x: float | None, base: float | None) -> str:
    return "n/a" if x is None or not base else f"{x / base:.3f}x"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = keep_freed_memory() if args.keep_freed_memory else False
    dev = args.device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    impl = resolve_kernel(args.kernel, torch.empty(0, device=dev, dtype=args.dtype))
    info = {
        "shape": args.shape, "num_blocks": args.num_blocks, "dtype": str(args.dtype), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "kernel": args.kernel, "kernel_resolved": impl,
        "steps": args.steps, "warmup": args.warmup, "modes": args.modes, "python": sys.version.split()[0],
        "keep_freed_memory": kept, "clock": "thread CPU time" if args.cpu_time and dev.type == "cpu" else "wall",
    }
    print("bench_residuals:", json.dumps(info), flush=True)
    # stages_done: what the file holds in full; a run cut short (a timeout) leaves the figures of the
    # stages before it and, of the mode it was in, those measured so far (the others None)
    results: dict = {"info": info, "stages_done": []}

    def save() -> None:  # after every stage: a run cut short still leaves its figures
        if args.json:
            write_json(args.json, results)  # atomically: a run killed while writing keeps the last figures

    if args.op_shapes:
        results["op_shapes"] = bench_op_shapes(args)
        results["stages_done"].append("op_shapes")
        report_op_shapes(results)
        save()
        if args.json:
            print(f"wrote {args.json}")
        return results
    bandwidth = args.bandwidth or (H200_BANDWIDTH if dev.type == "cuda" else copy_bandwidth(dev, args.cpu_time))
    results["op"] = bench_op(args, bandwidth)
    results["stages_done"].append("op")
    save()
    if not args.op_only:
        timer = Timer(dev, args.cpu_time)
        cases = {name: Case(name, args) for name in args.strategies}
        results["saved_for_backward_bytes"] = {name: case.saved_bytes() for name, case in cases.items()}
        traffic = {name: depth_traffic(case) for name, case in cases.items()}
        cold = cold_stream_bandwidth(args)
        results["cold_stream_bandwidth_bytes_per_s"] = cold
        results["depth_traffic"] = {
            name: {**t, "floor_s": t["bytes"] / bandwidth, "cold_stream_s": None if cold is None else t["bytes"] / cold}
            for name, t in traffic.items() if t is not None
        }
        results["stages_done"].append("saved_and_traffic")
        save()
        for tag in args.modes:
            compiled = tag == "compiled"
            if compiled:
                for case in cases.values():
                    case.compiled = torch.compile(case.model)
            rows = results.setdefault(tag, {})
            train = interleaved({n: functools.partial(c.train_step, compiled) for n, c in cases.items()},
                                args.steps, args.warmup, timer)
            for name in cases:  # a figure not measured yet is None until its stage finishes
                rows[name] = {
                    "train_step_s": train[name]["median_s"],
                    "train_first_call_s": train[name]["first_call_s"],
                    "train_samples_s": train[name]["samples_s"],
                    "prefill_s": None, "prefill_samples_s": None, "peak_train_bytes": None, "peak_prefill_bytes": None,
                }
            save()
            prefill = interleaved({n: functools.partial(c.prefill, compiled) for n, c in cases.items()},
                                  args.steps, args.warmup, timer)
            for name in cases:
                rows[name].update(prefill_s=prefill[name]["median_s"], prefill_samples_s=prefill[name]["samples_s"])
            save()
            for name, case in cases.items():  # each strategy's peaks written as soon as they are measured
                rows[name]["peak_train_bytes"] = peak_bytes(case, functools.partial(case.train_step, compiled), dev)
                rows[name]["peak_prefill_bytes"] = peak_bytes(case, functools.partial(case.prefill, compiled), dev)
                save()
            results["stages_done"].append(tag)
            save()
            print(f"[{tag} done]", flush=True)
    report(results)
    save()
    if args.json:
        print(f"wrote {args.json}")
    return results


def report(results: dict) -> None:
    info = results["info"]
    print(f"\nshape {info['shape']}, N={info['num_blocks']}, {info['dtype']} on {info['device']} "
          f"({info['device_name']}, {info['threads']} threads), kernel={info['kernel']} -> {info['kernel_resolved']}, "
          f"keep_freed_memory={info.get('keep_freed_memory', False)}")
    for tag in ("eager", "compiled"):
        if tag not in results:
            continue
        rows = results[tag]
        base = rows.get("standard", {})
        print(f"\n{tag:<9}| train step        | prefill           | peak train mem  | peak prefill mem")
        for name, r in rows.items():
            cells = []
            for key, unit in (("train_step_s", "ms"), ("prefill_s", "ms"),
                              ("peak_train_bytes", "GiB"), ("peak_prefill_bytes", "GiB")):
                x = r[key]
                value = "n/a" if x is None else (f"{x * 1e3:8.2f} ms" if unit == "ms" else f"{x / 2**30:6.2f} GiB")
                cells.append(f"{value} {fmt_ratio(x, base.get(key)):>7}")
            print(f"{name:<9}| " + " | ".join(cells))
        paired = {name: paired_ratio(r["train_samples_s"], base["train_samples_s"])
                  for name, r in rows.items() if name != "standard" and base.get("train_samples_s")}
        if paired:
            print("train step over standard's in the same round, median (quartiles) over rounds: " + ", ".join(
                f"{name} {q[1]:.3f}x ({q[0]:.3f}-{q[2]:.3f})" for name, q in paired.items()))
    saved = results.get("saved_for_backward_bytes")
    if saved:
        base = saved.get("standard")
        cells = ", ".join(f"{name} {x / 2**20:.1f} MiB ({fmt_ratio(x, base)})" for name, x in saved.items())
        print(f"\nactivations saved for backward (eager, one train forward): {cells}")
    traffic_report(results)
    op = results["op"]
    print(f"\nop: {op['sources']} sources x {op['tokens']} tokens x D {op['D']} {op['dtype']}, floor at "
          f"{op['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s: forward {op['floor_s']['forward'] * 1e6:.1f} us, "
          f"forward+backward {op['floor_s']['forward_backward'] * 1e6:.1f} us")
    for kernel, r in op["kernels"].items():
        f, fb = r["forward"], r["forward_backward"]
        line = (f"  {kernel:<9} forward {f['median_s'] * 1e6:9.1f} us ({f['vs_floor']:5.2f}x floor)   "
                f"forward+backward {fb['median_s'] * 1e6:9.1f} us ({fb['vs_floor']:5.2f}x floor)")
        if "floor_s" in f:  # each arm's own floor (OP_PASSES) and its fastest round, since the fused pre-norm
            line += (f"   floors {f['floor_s'] * 1e6:.1f} / {fb['floor_s'] * 1e6:.1f} us, fastest "
                     f"{f['min_s'] / f['floor_s']:.2f}x / {fb['min_s'] / fb['floor_s']:.2f}x")
        print(line)


def traffic_report(results: dict) -> None:
    """What the depth-attention calls of a step must cost at the least, against what each AttnRes
    strategy costs over standard: the least ratio to standard any implementation can reach."""
    traffic = results.get("depth_traffic")
    if not traffic:
        return
    bw, cold = results["op"]["bandwidth_bytes_per_s"], results.get("cold_stream_bandwidth_bytes_per_s")
    print(f"\ndepth-attention traffic of one train step, the least its calls move: as time at the copy rate "
          f"({bw / 1e9:.1f} GB/s)" + ("" if cold is None else f" and at the rate a sum of as many tensors out of "
                                       f"cache reaches ({cold / 1e9:.1f} GB/s)") + ", and as ratios to standard")
    for name, t in traffic.items():
        line = f"  {name:<9}{t['calls']:3d} calls, {t['bytes'] / 1e6:7.1f} MB, {t['floor_s'] * 1e3:6.2f} ms"
        if t.get("cold_stream_s") is not None:
            line += f" / {t['cold_stream_s'] * 1e3:6.2f} ms"
        for tag in ("eager", "compiled"):
            std, row = results.get(tag, {}).get("standard"), results.get(tag, {}).get(name)
            if std and row:
                base = std["train_step_s"]
                line += f" | {tag}: floor {1 + t['floor_s'] / base:.3f}x"
                if t.get("cold_stream_s") is not None:
                    line += f" / {1 + t['cold_stream_s'] / base:.3f}x"
                line += f", measured {row['train_step_s'] / base:.3f}x"
        print(line)


if __name__ == "__main__":
    main()
