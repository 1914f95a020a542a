"""Implementations of the depth-attention op, one file each, identical signatures.

`naive.py` is the specification every faster path is held against; `torch_fused.py` is the
fast formulation in plain PyTorch; `triton_fused.py` (imported only on use, never by
`import attnres`) holds the Triton kernels.
"""

from attnres.ops.naive import naive_depth_attention
from attnres.ops.torch_fused import fused_depth_attention

__all__ = ["fused_depth_attention", "naive_depth_attention"]
