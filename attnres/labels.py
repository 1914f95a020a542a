"""Names of sublayers as figures, tags and heatmap columns show them (no torch: cheap to import)."""

from __future__ import annotations


def sublayer_label(index: int, num_sublayers: int) -> str:
    """'L3 mlp' for sublayer 7; 'output' for the output aggregation (index == L)."""
    if index == num_sublayers:
        return "output"
    return f"L{index // 2} {'attn' if index % 2 == 0 else 'mlp'}"
