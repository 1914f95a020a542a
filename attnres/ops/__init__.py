"""Implementations of the depth-attention op, one file each, identical signatures.

`naive.py` is the specification every faster path is held against.
"""

from attnres.ops.naive import naive_depth_attention

__all__ = ["naive_depth_attention"]
