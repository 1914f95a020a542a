"""Which implementation runs a depth-attention call (`kernel=`, `attnres.functional`), and the
checks every call passes once before it is handed over.
"""


from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from attnres.ops import cpu_fused

KERNELS = ("auto", "triton", "cpu", "torch", "naive")
SCORINGS = ("softmax", "sigmoid")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_MAX_D = 8192  # whole rows live in registers; wider rows spill (experiments/kernel_resources.py)


def triton_available() -> bool:
    """Whether a triton recent enough for the kernels (>= 3.2: tuples of tensors as kernel
    arguments) is installed, found without importing it."""
    if importlib.util.find_spec("triton") is None:
        return False
    for dist in ("triton", "pytorch-triton"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
        return (major, minor) >= (3, 2)
    return True  # a source build without metadata: assume it is recent


def resolve_kernel(kernel: str, like: Tensor) -> str:
    """The implementation `kernel` stands for with inputs like `like`: "triton", "cpu", "torch"
    or "naive". Raises ValueError for an unknown name or a Triton request it cannot serve."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    if kernel == "auto":
        usable = like.is_cuda and like.dtype in _TRITON_DTYPES and like.shape[-1] <= _TRITON_MAX_D
        if usable and triton_available():
            return "triton"
        # under torch.compile the C++ kernel too, as two opaque ops in the graph, when an earlier
        # call built it (nothing is built while Dynamo traces: `cpu_fused.available()`); else
        # the plain-PyTorch path, which Inductor fuses itself
        if not _cpu_usable(like):
            return "torch"
        return "cpu" if cpu_fused.available() else "torch"
    if kernel == "cpu":
        if not _cpu_usable(like):
            raise ValueError(f"kernel='cpu' takes CPU tensors of float32 or float64, got {like.dtype} on "
                             f"{like.device}: use kernel='auto' or 'torch'")
        if not cpu_fused.available():
            if torch.compiler.is_compiling():
                raise ValueError("kernel='cpu' under torch.compile needs the C++ kernel built before compiling: "
                                 "call attnres.ops.cpu_fused.available() first, or use kernel='auto' or 'torch'")
            raise ValueError(f"kernel='cpu': the C++ kernel could not be built ({cpu_fused.load_error()}); "
                             "use kernel='torch'")
    if kernel == "triton":
        if not triton_available():
            raise ValueError("kernel='triton' needs the triton package (>= 3.2): pip install 'attnres[triton]'")
        if like.dtype not in _TRITON_DTYPES:
            raise ValueError(f"kernel='triton' supports float32, bfloat16 and float16 inputs, got {like.dtype}")
        if not like.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"kernel='triton' needs CUDA tensors (got {like.device}), or TRITON_INTERPRET=1 in the "
                "environment before triton is imported to run the kernels in Triton's CPU interpreter"
            )
    return kernel


def _cpu_usable(like: Tensor) -> bool:
    return like.device.type == "cpu" and like.dtype in cpu_fused.DTYPES


def implementation(kernel: str) -> ModuleType:
    if kernel == "cpu":
        return cpu_fused
    if kernel == "triton":
        from attnres.ops import triton_fused  # lazy: `import attnres` never imports triton

        return triton_fused
    from attnres.ops import torch_fused

    return torch_fused


def promoted(sources: Sequence[Tensor]) -> Sequence[Tensor]:
    """The sources in their promoted dtype, as the fast path mixes them: under autocast
    (bf16-mixed) the embedding is float32 and the sublayer outputs bfloat16, which the depth
    attention op refuses to mix. Unchanged (the same objects) when they share one dtype."""
    dtype = sources[0].dtype
    for v in sources[1:]:
        dtype = torch.promote_types(dtype, v.dtype)
    return [v.to(dtype) for v in sources] if any(v.dtype != dtype for v in sources) else sources


def check_sources(sources: Sequence[Tensor]) -> None:
    if not sources:
        raise ValueError("depth attention needs at least one source, got none")
    first = sources[0]
    if first.dim() == 0 or first.shape[-1] == 0:
        raise ValueError(
            f"sources must be (..., D) tensors with D >= 1 (at least one dimension), source 0 has shape "
            f"{tuple(first.shape)}"
        )
    for i, v in enumerate(sources[1:], start=1):
        if v.shape != first.shape:
            raise ValueError(
                f"all sources must share one shape: source 0 is {tuple(first.shape)}, source {i} is {tuple(v.shape)}"
            )
        if v.dtype != first.dtype or v.device != first.device:
            raise ValueError(
                f"all sources must share dtype and device: source 0 is {first.dtype} on {first.device}, "
                f"source {i} is {v.dtype} on {v.device}"
            )


def check_call(
    sources: Sequence[Tensor],
    pseudo_query: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    output_norm_weight: Tensor | None = None,
    per_token_query: bool = False,
) -> None:
    if sources and not (isinstance(eps, (int, float)) and eps > 0):  # no sources is reported first
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    check_sources(sources)
    first = sources[0]
    d = first.shape[-1]
    if per_token_query and pseudo_query.dim() > 1:  # one query per token: the sources' shape
        if pseudo_query.shape != first.shape:
            raise ValueError(
                f"a per-token pseudo_query must have the sources' shape {tuple(first.shape)}, "
                f"got {tuple(pseudo_query.shape)}"
            )
    elif pseudo_query.shape != (d,):
        raise ValueError(f"pseudo_query must have shape ({d},) to match D={d}, got {tuple(pseudo_query.shape)}")
    for name, weight in (("norm_weight", norm_weight), ("output_norm_weight", output_norm_weight)):
        if weight is not None and weight.shape != (d,):
            raise ValueError(f"{name} must have shape ({d},) to match D={d}, got {tuple(weight.shape)}")
