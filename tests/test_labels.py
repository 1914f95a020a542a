"""Sublayer names (attnres/labels.py) as figures, tags and heatmap columns show them."""

from __future__ import annotations

from attnres.labels import sublayer_label


def test_sublayer_labels():
    assert [sublayer_label(i, 4) for i in range(5)] == ["L0 attn", "L0 mlp", "L1 attn", "L1 mlp", "output"]
    assert sublayer_label(7, 24) == "L3 mlp" and sublayer_label(24, 24) == "output"
