"""The knock-out a probe pass arms on a strategy (attnres/knockout.py), by hand: a removed output
leaves every later softmax (not a zero source that keeps a share of it), a knocked-out source
leaves its row only, its plan is checked, knock-outs do not nest and are always disarmed. What
the probes compute with it, against float64 references: tests/test_probes.py."""

from __future__ import annotations

import pytest
import torch

from attnres import StandardResidual
from attnres.knockout import Knockout, knockout
from tests.helpers import mlp_sublayers

D, L = 8, 4


def _full():
    from attnres import FullAttentionResidual

    strategy = FullAttentionResidual(D, L).double()
    with torch.no_grad():
        strategy.pseudo_query.normal_(0.0, 1.0)  # weights far from uniform
    return strategy


def test_a_removed_output_leaves_every_later_softmax(ref_depth_attention, rel_err):
    strategy, sublayers = _full(), mlp_sublayers(L, D)
    e = torch.randn(2, 3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), knockout(strategy, Knockout(layer=1)) as plan:
        out = strategy(e, sublayers)
    assert strategy._knockout is None and len(plan.removed) == 1
    with torch.no_grad():  # by hand: sublayer 1 computes nothing and is no source anywhere
        sources = [e]
        for index, sublayer in enumerate(sublayers):
            h, _ = ref_depth_attention(sources, strategy.pseudo_query[index], strategy.key_norm_weight[index])
            if index != 1:
                sources.append(sublayer.inner(h))
        expected, _ = ref_depth_attention(sources, strategy.pseudo_query[L], strategy.key_norm_weight[L])
        intact = strategy(e, sublayers)
    assert rel_err(out, expected) < 1e-12
    assert rel_err(out, intact) > 1e-6  # the knock-out changed the pass


def test_a_knocked_out_source_leaves_its_row_only(ref_depth_attention, rel_err):
    strategy, sublayers = _full(), mlp_sublayers(L, D)
    e = torch.randn(1, 2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), knockout(strategy, Knockout(row=3, columns=[1])):
        out = strategy(e, sublayers)
    with torch.no_grad():
        sources = [e]
        for index, sublayer in enumerate(sublayers):
            seen = [s for c, s in enumerate(sources) if (index, c) != (3, 1)]
            h, _ = ref_depth_attention(seen, strategy.pseudo_query[index], strategy.key_norm_weight[index])
            sources.append(sublayer.inner(h))
        expected, _ = ref_depth_attention(sources, strategy.pseudo_query[L], strategy.key_norm_weight[L])
    assert rel_err(out, expected) < 1e-12


def test_the_plan_is_checked_and_knockouts_do_not_nest():
    with pytest.raises(ValueError, match="mode must be one of 'remove', 'mean'"):
        Knockout(mode="zero")
    with pytest.raises(ValueError, match="one column per copy: 1 columns, 2 copies"):
        Knockout(copies=2, row=1, columns=[0])
    strategy = StandardResidual(D, L)
    with knockout(strategy, Knockout(layer=0)):
        with pytest.raises(RuntimeError, match="do not nest"):
            with knockout(strategy, Knockout(layer=1)):
                pass
    assert strategy._knockout is None
    with pytest.raises(KeyError), knockout(strategy, Knockout(layer=0)):
        raise KeyError("a failure inside the pass")
    assert strategy._knockout is None  # disarmed all the same
