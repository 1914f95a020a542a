"""The Triton depth-attention kernels as the device loaded them, for experiments/gpu_check.sh's
stage (e): beside experiments/kernel_resources.py's compile for a target (no GPU needed), this runs
the Block and Full fast paths and the op alone on the GPU (forward and backward, kernel="triton"),
then reads each kernel the driver loaded: registers and spills as loaded, shared memory, warps, and
the resident blocks per multiprocessor the driver itself reports
(cuOccupancyMaxActiveBlocksPerMultiprocessor), against which kernel_resources.py's occupancy
formula can be held. Without a GPU it writes why it measured nothing.

    python experiments/gpu_check_device.py --json device.json [--d 768 --sublayers 24 --num-blocks 8]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

from gpu_check_env import write_json  # this folder, as for any script run from it

KERNELS = ("_fwd_kernel", "_bwd_kernel", "_inv_rms_kernel")


def run_fast_paths(d: int, sublayers: int, num_blocks: int) -> None:
    """Block, Full and the op alone, forward and backward, on CUDA: every kernel variant a GPT-small
    run launches is compiled and loaded (T 64: Triton specialises on divisibility, not on sizes)."""
    import torch

    from attnres import BlockAttentionResidual, FullAttentionResidual
    from attnres.functional import depth_attention

    dtype, dev = torch.bfloat16, "cuda"
    for residual in (BlockAttentionResidual(d, sublayers, num_blocks=num_blocks, kernel="triton"),
                     FullAttentionResidual(d, sublayers, kernel="triton")):
        residual = residual.to(dev, dtype)
        embedding = torch.randn(1, 64, d, device=dev, dtype=dtype, requires_grad=True)
        sublayers_fn = [lambda h: torch.tanh(h) for _ in range(sublayers)]
        residual(embedding, sublayers_fn).float().sum().backward()
    sources = [torch.randn(1, 64, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(num_blocks + 1)]
    query = (torch.randn(d, device=dev) * d**-0.5).requires_grad_()
    gain = torch.ones(d, device=dev, requires_grad=True)
    depth_attention(sources, query, gain, kernel="triton")[0].float().sum().backward()
    torch.cuda.synchronize()


def occupancy(function: int, threads: int, shared: int) -> int | None:
    """Resident blocks per multiprocessor, as the CUDA driver computes it for this loaded kernel."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    blocks = ctypes.c_int(0)
    err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(function), ctypes.c_int(threads), ctypes.c_size_t(shared))
    return blocks.value if err == 0 else None


def loaded_kernels() -> list[dict]:
    from attnres.ops import triton_fused

    rows = []
    for name in KERNELS:
        jit = getattr(triton_fused, name)
        for entry in getattr(jit, "device_caches", {}).values():
            for compiled in entry[0].values():  # the kernel cache: one compiled variant per specialisation
                try:
                    compiled._init_handles()  # loads it, if the launch has not (a no-op then)
                except Exception as err:  # a triton whose CompiledKernel differs: say so, keep the rest
                    rows.append({"kernel": name, "error": f"{type(err).__name__}: {err}"[:300]})
                    continue
                warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
                blocks = occupancy(compiled.function, warps * 32, shared)
                rows.append({"kernel": name, "num_warps": warps, "n_regs": compiled.n_regs,
                             "n_spills": compiled.n_spills, "shared_bytes": shared, "blocks_per_sm": blocks,
                             "warps_per_sm": None if blocks is None else blocks * warps})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--sublayers", type=int, default=24)
    p.add_argument("--num-blocks", type=int, default=8)
    args = p.parse_args(argv)
    import torch
    import triton

    out: dict = {"triton": triton.__version__, "shape": {"D": args.d, "L": args.sublayers, "N": args.num_blocks}}
    if not torch.cuda.is_available():
        write_json(args.json, {**out, "gpu": None, "reason": "no CUDA device: nothing was loaded"})
        print("gpu_check_device: no CUDA device, nothing measured")
        return 0
    props = torch.cuda.get_device_properties(0)
    out["gpu"] = {k: getattr(props, k, None) for k in (
        "name", "major", "minor", "multi_processor_count", "regs_per_multiprocessor",
        "max_threads_per_multi_processor", "shared_memory_per_block_optin", "shared_memory_per_multiprocessor",
        "L2_cache_size", "total_memory")}
    try:
        run_fast_paths(args.d, args.sublayers, args.num_blocks)
        out["kernels"] = loaded_kernels()
    except Exception as err:  # the file says what failed; the exit status tells gpu_check.sh
        out["error"] = f"{type(err).__name__}: {err}"[:1000]
        write_json(args.json, out)
        raise
    write_json(args.json, out)
    for r in out["kernels"]:
        if "error" in r:
            print(f"{r['kernel']:<16} {r['error']}")
            continue
        print(f"{r['kernel']:<16} warps {r['num_warps']:>2} regs {r['n_regs']:>4} spills {r['n_spills']:>4} "
              f"smem {r['shared_bytes']:>6} blocks/SM {r['blocks_per_sm']} warps/SM {r['warps_per_sm']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
