"""Compile the Triton depth-attention kernels for a CUDA GPU, without one, and report what
each compiled variant costs: registers per thread, spill stack, shared memory, resident warps,
and the instructions its loops over sources issue per byte moved.

Runs the Block and Full AttnRes fast paths and the op alone (forward and backward) on tiny CPU
tensors with kernel="triton", but instead of launching a kernel it records the launch, as the host code
in `attnres/ops/triton_fused.py` chose it (constexprs, BLOCK_M, num_warps, sources per
launch). Each distinct variant is then compiled by Triton for the target architecture
(default sm_90: H100 / H200) and read back with the `cuobjdump` that ships with Triton.
T stays 16 and the width is the real one, so the compiled variants are those a real run
compiles (Triton specialises on divisibility by 16, not on sizes).

These are what a kernel can be tuned on without the GPU: a spilling variant goes through local
memory, and one whose `issue/floor` (see `issue_bound`) is above 1 cannot issue its instructions
as fast as memory delivers its bytes; neither can reach the bandwidth floor. Timing still needs
the GPU (`bench_residuals.py`).

    python experiments/kernel_resources.py                       # GPT-small: D 768, 24 sublayers, N 8
    python experiments/kernel_resources.py --d 4096 --sublayers 64 --num-blocks 8
    python experiments/kernel_resources.py --d 200 --sublayers 4 --num-blocks 2 --max-spill 0
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_residuals import H200_BANDWIDTH  # this folder, as for any script run from it

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KERNELS = ("_fwd_kernel", "_bwd_kernel", "_inv_rms_kernel")
H200_ISSUE_RATE = 132 * 4 * 1.98e9  # warp-instructions/s: SMs x schedulers x boost clock


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability as one number (90: H100/H200)")
    p.add_argument("--d", type=int, default=768, help="model width D (default 768, GPT-small)")
    p.add_argument("--sublayers", type=int, default=24, help="L, sublayers (2 per transformer layer; default 24)")
    p.add_argument("--num-blocks", type=int, default=8, help="N for Block AttnRes (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--strategies", default="block,full,op",
                   help="comma-separated subset of block,full,op (op: depth_attention alone over N + 1 sources, "
                        "as bench_residuals.py times it)")
    p.add_argument("--max-spill", type=int, default=None, metavar="BYTES",
                   help="exit 1 if a variant spills more than BYTES per thread (0: any spill)")
    p.add_argument("--dump", type=Path, default=None, metavar="DIR",
                   help="write each variant's TTGIR, PTX and SASS here")
    return p.parse_args(argv)


class _Target:
    """Stands in for Triton's CUDA driver: just enough for the compiler to target `arch`."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class _Recorder:
    """Replaces a kernel object: `kernel[grid](*args, **kw)` records the launch instead."""

    def __init__(self, name: str, fn: Any, launches: dict) -> None:
        self.name, self.fn, self.launches = name, fn, launches

    def __getitem__(self, grid: tuple) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            n_src = len(args[0]) if isinstance(args[0], tuple) else 0
            key = (self.name, n_src, tuple(sorted(kwargs.items())))
            self.launches.setdefault(key, (self.fn, args, kwargs, grid))

        return record


def record_launches(args: argparse.Namespace) -> dict:
    """Run the strategies' fast paths forward and backward, recording every kernel launch."""
    from attnres import BlockAttentionResidual, FullAttentionResidual
    from attnres.functional import depth_attention
    from attnres.ops import triton_fused

    launches: dict = {}
    for name in KERNELS:
        setattr(triton_fused, name, _Recorder(name, getattr(triton_fused, name), launches))
    # kernel="triton" accepts CPU tensors only with the interpreter flag; the kernels above were
    # defined before it was set, so they stay compiled kernels (and are never run here)
    os.environ["TRITON_INTERPRET"] = "1"
    dtype, D, L = DTYPES[args.dtype], args.d, args.sublayers
    strategies = {
        "block": lambda: BlockAttentionResidual(D, L, num_blocks=args.num_blocks, kernel="triton"),
        "full": lambda: FullAttentionResidual(D, L, kernel="triton"),
        "op": None,
    }
    for name in args.strategies.split(","):
        if name not in strategies:
            raise SystemExit(f"error: unknown strategy {name!r}; choose from {', '.join(strategies)}")
        if name == "op":
            sources = [torch.zeros(1, 16, D, dtype=dtype, requires_grad=True) for _ in range(args.num_blocks + 1)]
            query, gain = torch.zeros(D, requires_grad=True), torch.ones(D, requires_grad=True)
            depth_attention(sources, query, gain, kernel="triton")[0].float().sum().backward()
            continue
        residual = strategies[name]().to(dtype)
        embedding = torch.zeros(1, 16, D, dtype=dtype, requires_grad=True)
        sublayers = [lambda h: h * 0.5 for _ in range(L)]
        residual(embedding, sublayers).float().sum().backward()
    return launches


def cuobjdump(tool: Path, cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def resources(cubin: bytes, tool: Path) -> dict[str, int]:
    """REG, STACK (bytes of spill stack per thread) and SHARED from `cuobjdump -res-usage`."""
    words = cuobjdump(tool, cubin, "--dump-resource-usage").split()
    fields = dict(w.split(":", 1) for w in words if w.split(":", 1)[0] in ("REG", "STACK", "SHARED"))
    return {k: int(v) for k, v in fields.items()}


def loop_sizes(sass: str) -> tuple[int, list[int], int]:
    """From a kernel's SASS: its instruction count, the sizes of its innermost loops (the loops
    over sources) and of the loop around them (the backward's loop over token blocks; 0 if
    none). An if/else inside a loop counts with its shorter arm only: in these kernels the
    longer one is the rescaling for squares that overflow (_row_inv_rms), which real data never
    takes."""
    instrs = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2)))
    index = {addr: i for i, (addr, _) in enumerate(instrs)}

    def target(i: int) -> int | None:
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", instrs[i][1])
        return index.get(int(m.group(1), 16)) if m else None

    loops = [(t, i) for i in range(len(instrs)) if (t := target(i)) is not None and t < i]
    cold = []  # the longer arm of each if/else: [first, last] instruction index
    for i in range(len(instrs)):
        t = target(i)
        if t is not None and t > i and instrs[i][1].startswith("@") and not instrs[t - 1][1].startswith("@"):
            u = target(t - 1)  # an unconditional jump ending the first arm, over the second
            if u is not None and u > t:
                arms = [(i + 1, t - 1), (t, u - 1)]
                cold.append(max(arms, key=lambda arm: arm[1] - arm[0]))

    def size(first: int, last: int) -> int:
        return last - first + 1 - sum(b - a + 1 for a, b in cold if first <= a and b <= last)

    def inside(x, y):
        return y[0] <= x[0] and x[1] <= y[1] and x != y

    inner = [x for x in loops if not any(inside(y, x) for y in loops)]
    outer = [x for x in loops if any(inside(y, x) for y in loops)]
    return size(0, len(instrs) - 1), [size(*x) for x in inner], max((size(*x) for x in outer), default=0)


def issue_bound(name: str, kw: dict, sass: str, n: int, d: int, elem_bytes: int) -> float | None:
    """Lower bound on the kernel's time over its memory floor from instruction issue alone, for
    n sources: warp-instructions executed per byte moved, times bandwidth over issue rate (H200:
    4.8 TB/s; 132 SMs x 4 schedulers x 1.98 GHz, one warp-instruction per scheduler and cycle).
    Above 1, issuing instructions limits the kernel, not memory. Counts each loop n times and
    the straight-line code once (a close estimate: the code outside loops has few branches)."""
    total, inner, outer = loop_sizes(sass)
    if name == "_inv_rms_kernel" or not inner:
        return None
    if name != "_fwd_kernel" and not outer:  # the loop over token blocks was not found (seen at D 64): no
        return None                          # count, rather than one without the backward's loop body
    k, prefix = kw["K"], int(kw["HAS_PREFIX"])
    if name == "_fwd_kernel":  # per program: read n sources (+ the prefix), write K outputs
        instr = total - sum(inner) + n * sum(inner)
        tiles = n + k + prefix
    else:  # per token block: read dO_k; per source read it once per loop (and dv when accumulating), write dv
        instr = outer - sum(inner) + n * sum(inner)
        tiles = k + n * (len(inner) + int(kw["ACCUMULATE"]) + 1) + 2 * prefix  # prefix: read out, write dh
    tile = kw["BLOCK_M"] * d * elem_bytes  # one (BLOCK_M, D) tile, bytes
    return kw.get("num_warps", 4) * instr / (tiles * tile) * H200_BANDWIDTH / H200_ISSUE_RATE


def warps_per_sm(regs: int, warps: int, smem: int) -> int:
    """Resident warps per SM on sm_80/sm_90 (64K registers allocated per warp in units of 256,
    at most 64 warps and 32 blocks, 227 KiB of shared memory per block and SM)."""
    per_warp = -(-regs * 32 // 256) * 256
    blocks = min(32, 65536 // (per_warp * warps), 64 // warps, (227 * 1024) // max(smem, 1))
    return blocks * warps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")  # compile times, not cache hits
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("error: unset TRITON_INTERPRET: this script compiles the kernels, it does not interpret them")
    try:
        import triton
        import triton.backends.nvidia as nvidia
        from triton.runtime.driver import driver
    except ImportError:
        raise SystemExit("error: needs triton with its CUDA backend: pip install 'attnres[triton]'") from None
    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        raise SystemExit(f"error: {tool} not found; this triton wheel ships no CUDA binutils")
    driver.set_active(_Target(args.arch))

    launches = record_launches(args)
    print(f"triton {triton.__version__}, sm_{args.arch}, D {args.d}, {args.dtype}, L {args.sublayers}, "
          f"N {args.num_blocks}: {len(launches)} kernel variants (srcs<=: one variant serves up to that many "
          "sources; K: queries per launch)")
    header = f"{'kernel':<16}{'srcs<=':>8}{'K':>3}{'prefix':>7}{'BLOCK_M':>8}{'BLOCK_D':>8}{'warps':>6}"
    print(header + f"{'regs':>6}{'spill B':>8}{'smem B':>8}{'warps/SM':>9}{'loop instr':>11}{'issue/floor':>12}"
          f"{'compile s':>10}")
    spilled, worst = 0, 0
    for number, ((name, n_src, _), (fn, fargs, kwargs, grid)) in enumerate(
        sorted(launches.items(), key=lambda kv: kv[0][:2])
    ):
        t0 = time.perf_counter()
        compiled = fn.warmup(*fargs, grid=grid, **kwargs)
        seconds = time.perf_counter() - t0
        res = resources(compiled.asm["cubin"], tool)
        sass = cuobjdump(tool, compiled.asm["cubin"], "-sass")
        bound = issue_bound(name, kwargs, sass, n_src, args.d, DTYPES[args.dtype].itemsize)
        loops = loop_sizes(sass)[1]
        spilled += res["STACK"] > 0
        worst = max(worst, res["STACK"])
        if args.dump is not None:
            args.dump.mkdir(parents=True, exist_ok=True)
            stem = args.dump / f"{number:02d}{name}-n{n_src}"
            stem.with_suffix(".ptx").write_text(compiled.asm["ptx"])
            stem.with_suffix(".ttgir").write_text(compiled.asm["ttgir"])
            stem.with_suffix(".sass").write_text(sass)
        warps = kwargs.get("num_warps", 4)
        occupancy = warps_per_sm(res["REG"], warps, res["SHARED"])
        print(f"{name:<16}{n_src:>8}{kwargs.get('K', 1):>3}{str(kwargs.get('HAS_PREFIX', '-')):>7}"
              f"{kwargs['BLOCK_M']:>8}{kwargs['BLOCK_D']:>8}{warps:>6}"
              f"{res['REG']:>6}{res['STACK']:>8}{res['SHARED']:>8}{occupancy:>9}"
              f"{'+'.join(map(str, loops)) or '-':>11}{'-' if bound is None else f'{bound:.2f}x':>12}{seconds:>10.1f}",
              flush=True)
    print(f"{spilled} of {len(launches)} variants spill, at most {worst} bytes per thread" if spilled
          else "no variant spills")
    return 1 if args.max_spill is not None and worst > args.max_spill else 0


if __name__ == "__main__":
    sys.exit(main())
