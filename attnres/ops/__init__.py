"""Implementations of the depth-attention op, one file each with identical signatures: `naive.py` the
specification, `torch_fused.py`, `cpu_fused.py`, `triton_fused.py` (loaded on use); `dispatch.py` picks one."""

from attnres.ops.naive import naive_depth_attention
from attnres.ops.torch_fused import fused_depth_attention

__all__ = ["fused_depth_attention", "naive_depth_attention"]
