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

`--profile` takes the op apart at each width: each layer of the call (the C++
op alone, its autograd Function, the public entry) forward and forward + backward at growing
token counts, a line time = a + b * bytes through each (a: the fixed cost of a call; b against the
copy's seconds per byte: the ratio to the floor a long call tends to), the statistics' share
(the forward with the key statistics given), the fixed and per-value cost of a source row (the
per-token slopes across widths).

`--baseline REV` times the C++ ops alone (forward; forward + backward) of this checkout beside
those of git revision REV, built under another library name and loaded in the same process, in
interleaved rounds: a kernel change measured on a loaded machine without a second process.

    python experiments/bench_op_widths.py                      # D 32, 64, 96, 128, 256
    python experiments/bench_op_widths.py --widths 32 --tokens-sweep
    python experiments/bench_op_widths.py --widths 32,64,96 --profile
    python experiments/bench_op_widths.py --baseline HEAD~1 --widths 32,64,96,256
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


# -- --profile: where a call's time goes -------------------------------------------------------------
PROFILE_TOKENS = (64, 128, 256, 512, 1024, 2048)
EPS = 1e-6


def op_layers(n_src: int, tokens: int, d: int) -> dict[str, tuple[int, object]]:
    """{layer: (tensor passes of its floor, a call)} for depth attention over `n_src` sources of
    (`tokens`, D) float32, one query: the C++ ops alone (their allocations included), the autograd
    Function around them (`cpu_fused.run_depth_attention`), and the public entry
    (`functional.depth_attention`: the checks, the query folding, the weights' softmax)."""
    gen = torch.Generator().manual_seed(d)
    plain = [torch.randn(tokens, d, generator=gen) for _ in range(n_src)]
    tracked = [v.clone().requires_grad_() for v in plain]
    query, gain = torch.randn(d, generator=gen) / d**0.5, torch.ones(d)
    folded = (query * gain).unsqueeze(0).contiguous()
    leaf_q, leaf_query, leaf_gain = (x.clone().requires_grad_() for x in (folded, query, gain))
    dh = torch.randn(tokens, d, generator=gen)
    fwd, bwd = torch.ops.attnres_cpu.forward.default, torch.ops.attnres_cpu.backward.default
    outs, z, lse, r, _, _ = fwd(plain, None, folded, [], None, EPS, None, EPS)
    shape, stats = plain[0].shape, (n_src, tokens)

    def clear() -> None:
        for x in (*tracked, leaf_q, leaf_query, leaf_gain):
            x.grad = None

    def op_pair() -> None:
        o, zz, ll, rr, _, _ = fwd(plain, None, folded, [], None, EPS, None, EPS)
        bwd(plain, rr, folded, zz, ll, None, o, [dh], None, None, None, None, None, [])

    def function_pair() -> None:
        cpu_fused.run_depth_attention(tracked, None, leaf_q, eps=EPS)[0][0].backward(dh)
        clear()

    def entry_pair() -> None:
        depth_attention(tracked, leaf_query, leaf_gain, kernel="cpu")[0].backward(dh)
        clear()

    def one_op() -> None:  # what starting autograd's engine costs a call, whatever the op
        (leaf_gain * 1.0).backward(dh[0])
        clear()

    def no_grad(fn):
        def call() -> None:
            with torch.no_grad():
                fn()
        return call

    n, fb = n_src + 1, 3 * n_src + 2
    return {
        "forward: results allocated only": (n, lambda: [torch.empty(shape), torch.empty((1, *stats)),
                                                          torch.empty((1, tokens)), torch.empty(stats),
                                                          torch.empty(0), torch.empty(0)]),
        "forward: C++ op": (n, lambda: fwd(plain, None, folded, [], None, EPS, None, EPS)),
        "forward: C++ op, statistics given": (n, lambda: fwd(plain, r, folded, [], None, EPS, None, EPS)),
        "forward: autograd Function (graph kept)": (n, lambda: cpu_fused.run_depth_attention(tracked, None, leaf_q,
                                                                                               eps=EPS)),
        "forward: depth_attention": (n, no_grad(lambda: depth_attention(plain, query, gain, kernel="cpu"))),
        "backward: C++ op": (2 * n_src + 1, lambda: bwd(plain, r, folded, z, lse, None, outs, [dh], None, None,
                                                         None, None, None, [])),
        "forward+backward: C++ ops": (fb, op_pair),
        "forward+backward: autograd Function": (fb, function_pair),
        "forward+backward: depth_attention": (fb, entry_pair),
        "backward() of a one-op graph": (0, one_op),
    }


def time_layers(n_src: int, tokens: int, d: int, rounds: int) -> dict[str, float]:
    """The least CPU time of a call of each layer, in seconds: every layer in each round, each
    sample the mean of enough calls to run about 8,192 tokens (a short call alone is below the
    clock's grain of noise)."""
    layers = op_layers(n_src, tokens, d)
    inner = max(1, 8192 // tokens)
    best = {name: float("inf") for name in layers}
    for _, fn in layers.values():
        fn()
    for _ in range(rounds):
        for name, (_, fn) in layers.items():
            start = time.thread_time()
            for _ in range(inner):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / inner)
    return best


def profile_width(d: int, n_src: int, rounds: int, rate: float) -> dict:
    passes = {name: p for name, (p, _) in op_layers(n_src, 8, d).items()}
    timed = {t: time_layers(n_src, t, d, rounds) for t in PROFILE_TOKENS}
    out: dict = {"D": d, "sources": n_src, "tokens": list(PROFILE_TOKENS), "layers": {}}
    print(f"D {d}: {n_src} sources, the least CPU time of a call (us) at {list(PROFILE_TOKENS)} tokens; "
          f"a line time = a + b * bytes through them; b * rate: the ratio to the floor a long call tends to; "
          f"at 2,048 tokens: the ratio to the floor, and a's share of the call", flush=True)
    for name, p in passes.items():
        xs = [p * t * d * 4 for t in PROFILE_TOKENS]
        ys = [timed[t][name] for t in PROFILE_TOKENS]
        if not p:  # no bytes of its own: a fixed cost
            out["layers"][name] = {"seconds": ys, "a_us": statistics.median(ys) * 1e6}
            print(f"  {name:38s} {' '.join(f'{y * 1e6:8.1f}' for y in ys)} | a {statistics.median(ys) * 1e6:6.1f} us "
                  "(the median)", flush=True)
            continue
        b, a = statistics.linear_regression(xs, ys)
        at = PROFILE_TOKENS.index(2048)
        floor = xs[at] / rate
        out["layers"][name] = {"passes": p, "seconds": ys, "a_us": a * 1e6, "b_s_per_byte": b,
                               "b_times_rate": b * rate, "vs_floor_2048": ys[at] / floor, "a_share_2048": a / ys[at]}
        print(f"  {name:38s} {' '.join(f'{y * 1e6:8.1f}' for y in ys)} | a {a * 1e6:6.1f} us, b * rate "
              f"{b * rate:5.2f} | 2,048: {ys[at] / floor:5.2f}x floor, a {100 * a / ys[at]:4.1f}%", flush=True)
    return out


def profile_widths(widths: list[int], n_src: int, rounds: int, rate: float) -> dict:
    """`--profile`: each width's layers (`profile_width`), then across widths the cost of a source
    row in the C++ forward, per token over the sources (the forward's slope in tokens), as c + e * D
    (c: what a row costs whatever its width; e against the floor's per value). Every time is the
    thread's CPU time: torch.profiler's tables are wall clock, which on a loaded machine counts the
    other jobs' turns."""
    print(f"copy rate {rate / 1e9:.1f} GB/s (CPU time): the floor's seconds per byte 1 / rate", flush=True)
    per_width = [profile_width(d, n_src, rounds, rate) for d in widths]
    result: dict = {"copy_bytes_per_s": rate, "widths": per_width}
    rows = []
    for w in per_width:
        slope = w["layers"]["forward: C++ op"]["b_s_per_byte"] * w["layers"]["forward: C++ op"]["passes"] * w["D"] * 4
        rows.append(slope / n_src)  # seconds per source row (its share of the output's write included)
    if len(widths) >= 2:
        e, c = statistics.linear_regression([float(d) for d in widths], rows)
        floor_value = 4 * (n_src + 1) / n_src / rate
        result["row"] = {"per_row_ns": [x * 1e9 for x in rows], "c_ns": c * 1e9, "e_ns_per_value": e * 1e9,
                         "floor_ns_per_value": floor_value * 1e9}
        print(f"a source row in the C++ forward at D {widths}: {[round(x * 1e9, 1) for x in rows]} ns = "
              f"{c * 1e9:.1f} ns + {e * 1e9:.3f} ns a value (floor {floor_value * 1e9:.3f} ns a value)", flush=True)
    return result


# -- --baseline REV: the C++ ops of another revision beside this one's ---------------------------------
def baseline_ops(rev: str):
    """torch.ops of the C++ source at git revision `rev`, built under the library name
    attnres_cpu_base (so that it loads beside this checkout's attnres_cpu) with the flags
    `cpu_fused` builds with."""
    import hashlib
    import subprocess
    from pathlib import Path

    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:attnres/ops/csrc/depth_attention_cpu.cpp"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"):
        text = text.replace(f"{macro}(attnres_cpu,", f"{macro}(attnres_cpu_base,")
    flags = cpu_fused._cflags(cpu_fused._state.get("threads") == "openmp")
    name = "attnres_cpu_base_" + hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:12]
    build = Path(cpp_extension.get_default_build_root()) / name
    build.mkdir(parents=True, exist_ok=True)
    (build / "depth_attention_cpu_base.cpp").write_text(text)
    cpp_extension.load(name=name, sources=[str(build / "depth_attention_cpu_base.cpp")], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else None, is_python_module=False,
                       build_directory=str(build), verbose=False)
    return torch.ops.attnres_cpu_base


def compare_ops(d: int, tokens: int, n_src: int, rounds: int, base, rate: float) -> dict:
    """The C++ ops alone (forward; forward + backward), `base`'s and this checkout's, interleaved
    in rounds: the least CPU time of each against the floor at `rate` (10 and 29 tensor passes
    at 9 sources, as `measure`)."""
    gen = torch.Generator().manual_seed(d)
    plain = [torch.randn(tokens, d, generator=gen) for _ in range(n_src)]
    folded = (torch.randn(d, generator=gen) / d**0.5).unsqueeze(0).contiguous()
    dh = torch.randn(tokens, d, generator=gen)

    def arms(ops):
        def fwd() -> None:
            ops.forward(plain, None, folded, [], None, EPS, None, EPS)

        def pair() -> None:
            o, z, lse, r, _, _ = ops.forward(plain, None, folded, [], None, EPS, None, EPS)
            ops.backward(plain, r, folded, z, lse, None, o, [dh], None, None, None, None, None, [])
        return {"forward": fwd, "forward_backward": pair}

    calls = {(who, arm): fn for who, ops in (("base", base), ("new", torch.ops.attnres_cpu))
             for arm, fn in arms(ops).items()}
    inner = max(1, 8192 // tokens)
    best = {key: float("inf") for key in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for key, fn in calls.items():
            start = time.thread_time()
            for _ in range(inner):
                fn()
            best[key] = min(best[key], (time.thread_time() - start) / inner)
    tensor = tokens * d * 4
    out: dict = {"D": d, "tokens": tokens, "sources": n_src}
    for arm, p in (("forward", n_src + 1), ("forward_backward", 3 * n_src + 2)):
        floor = p * tensor / rate
        out[arm] = {"floor_us": floor * 1e6, "base_us": best["base", arm] * 1e6, "new_us": best["new", arm] * 1e6,
                    "base_vs_floor": best["base", arm] / floor, "new_vs_floor": best["new", arm] / floor}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="32,64,96,128,256", help="comma-separated D")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sources", type=int, default=9)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tokens-sweep", action="store_true", help="also the forward at 1/8, 1/2, 1 and 4 x --tokens")
    p.add_argument("--profile", action="store_true", help="where a call's time goes (module docstring), not the table")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--baseline", metavar="REV", help="the C++ ops alone, this checkout's beside git revision REV's "
                   "(built as library attnres_cpu_base), not the table")
    args = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    if not cpu_fused.available():
        raise SystemExit(f"bench_op_widths: the C++ kernel is not available ({cpu_fused.load_error()})")
    if args.baseline:
        base = baseline_ops(args.baseline)
        rate = copy_rate(args.rounds)
        print(f"the C++ ops alone, least CPU time of {args.rounds} rounds, {args.sources} sources x {args.tokens} "
              f"tokens, floor at {rate / 1e9:.1f} GB/s: {args.baseline} -> this checkout", flush=True)
        results = []
        for d in (int(x) for x in args.widths.split(",")):
            r = compare_ops(d, args.tokens, args.sources, args.rounds, base, rate)
            results.append(r)
            arms = (("forward", r["forward"]), ("+backward", r["forward_backward"]))
            line = [f"{name} floor {a['floor_us']:7.1f} us: {a['base_us']:8.1f} ({a['base_vs_floor']:.2f}x) -> "
                    f"{a['new_us']:8.1f} us ({a['new_vs_floor']:.2f}x)" for name, a in arms]
            print(f"D {d:4d}: " + " | ".join(line), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"copy_bytes_per_s": rate, "baseline": args.baseline, "widths": results}, fh, indent=1)
        return
    if args.profile:
        results = profile_widths([int(x) for x in args.widths.split(",")], args.sources, args.rounds,
                                 copy_rate(args.rounds))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
        return
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
