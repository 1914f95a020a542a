"""The fused CPU depth-attention op against its byte floor across widths, in CPU time.

For each D: depth attention over `--sources` sources of (`--tokens`, D) float32 through
`attnres.functional.depth_attention(kernel="cpu")`, forward (no grad) and forward + backward, as
`bench_residuals.py` times the op alone, and against the same floor: 10 tensor passes forward and
29 forward + backward (N + 1 = 9 sources) at the rate of a large copy. Here every time is the
thread's CPU time (`time.thread_time`), not the wall clock, the copy's included: on a machine
shared with other jobs the wall clock counts the time the scheduler gives to them, and the longer
a call the more of it. The arms are interleaved in rounds; the figures are the minimum and the
median over rounds. The copy still competes with the other jobs for memory bandwidth, so on a
loaded machine the floor is low and the ratios high.

`--tokens-sweep` also times the forward at several token counts per width: the intercept of time
against tokens is the per-call cost (Python, allocation), the slope the per-token one.

    python experiments/bench_op_widths.py                      # D 32, 64, 96, 128, 256
    python experiments/bench_op_widths.py --widths 32 --tokens-sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnres.functional import depth_attention
from attnres.ops import cpu_fused
from attnres.training.devices import keep_freed_memory


def cpu_time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        out.append(time.thread_time() - start)
    return out


_COPY: list[torch.Tensor] = []


def copy_rate(rounds: int) -> float:
    """Bytes/s (read + write) of a 64 MB float32 copy, best of `rounds`, in CPU time. The two
    buffers are made and touched once per process: a fresh destination would time its page faults."""
    if not _COPY:
        _COPY.extend([torch.empty(16 * 2**20).uniform_(), torch.zeros(16 * 2**20)])
    src, dst = _COPY
    best = min(cpu_time(lambda: dst.copy_(src), rounds))
    return 2 * src.numel() * src.element_size() / best


def measure(d: int, tokens: int, n_src: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(d)
    sources = [torch.randn(tokens, d, generator=gen).requires_grad_() for _ in range(n_src)]
    query = torch.randn(d, generator=gen) / d**0.5
    gain = torch.ones(d, requires_grad=True)
    dh = torch.randn(tokens, d, generator=gen)

    def fwd() -> None:
        with torch.no_grad():
            depth_attention(sources, query, gain, kernel="cpu")

    def fwd_bwd() -> None:
        h, _ = depth_attention(sources, query, gain, kernel="cpu")
        h.backward(dh)

    arms = {"forward": fwd, "forward_backward": fwd_bwd}
    times: dict[str, list[float]] = {k: [] for k in arms}
    rates = []
    for fn in arms.values():
        fn()
    for _ in range(rounds):
        rates.append(copy_rate(1))
        for name, fn in arms.items():
            times[name] += cpu_time(fn, 3)
    rate = max(rates)
    tensor = tokens * d * 4
    passes = {"forward": n_src + 1, "forward_backward": 3 * n_src + 2}
    out = {"D": d, "tokens": tokens, "sources": n_src, "copy_bytes_per_s": rate}
    for name, xs in times.items():
        floor = passes[name] * tensor / rate
        out[name] = {"floor_us": floor * 1e6, "min_us": min(xs) * 1e6, "median_us": statistics.median(xs) * 1e6,
                     "min_vs_floor": min(xs) / floor, "median_vs_floor": statistics.median(xs) / floor}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="32,64,96,128,256", help="comma-separated D")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sources", type=int, default=9)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens-sweep", action="store_true", help="also the forward at 1/8, 1/2, 1 and 4 x --tokens")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    if not cpu_fused.available():
        raise SystemExit(f"bench_op_widths: the C++ kernel is not available ({cpu_fused.load_error()})")
    results = []
    for d in (int(x) for x in args.widths.split(",")):
        r = measure(d, args.tokens, args.sources, args.rounds)
        results.append(r)
        print(f"D {d:4d}: floor at {r['copy_bytes_per_s'] / 1e9:5.1f} GB/s | forward {r['forward']['min_us']:8.1f} us "
              f"({r['forward']['min_vs_floor']:.2f}x floor, median {r['forward']['median_vs_floor']:.2f}x) | "
              f"forward+backward {r['forward_backward']['min_us']:8.1f} us "
              f"({r['forward_backward']['min_vs_floor']:.2f}x, median {r['forward_backward']['median_vs_floor']:.2f}x)",
              flush=True)
        if args.tokens_sweep:
            sweep = [measure(d, max(1, int(args.tokens * f)), args.sources, max(3, args.rounds // 2))
                     for f in (0.125, 0.5, 1, 4)]
            xs = [s["tokens"] for s in sweep]
            ys = [s["forward"]["min_us"] for s in sweep]
            slope, intercept = statistics.linear_regression(xs, ys)
            r["tokens_sweep"] = {"tokens": xs, "forward_min_us": ys, "per_call_us": intercept,
                                 "per_token_ns": slope * 1e3}
            print(f"         forward vs tokens {xs}: {[round(y) for y in ys]} us -> {intercept:.1f} us a call + "
                  f"{slope * 1e3:.1f} ns a token", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
