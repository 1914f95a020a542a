"""Routing probes (attnres/probes.py, with the knock-out passes of attnres/knockout.py): source and
layer knock-outs held against independent float64 references written here from their definitions
(manual forwards of the Transformer with a source left out, an output removed, or a sublayer's
input replaced by the analytic uniform mean), batched against one-at-a-time. The figures:
tests/results/test_probe_figures.py; the callback and experiments/probe_routing.py:
tests/training/test_routing.py."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnres import BlockAttentionResidual, FullAttentionResidual, Transformer
from attnres.probes import (
    Knockout,
    ProbesStopped,
    knockout,
    layer_knockout,
    probe_routing,
    rank_correlation,
    source_knockout,
    top_agreement,
)
from attnres.residual import StandardResidual
from attnres.residual.denseformer import DenseFormerResidual
from attnres.residual.hc import HyperConnectionResidual
from attnres.residual.mhc import ManifoldHyperConnectionResidual

V, N_LAYER, D, T = 24, 2, 16, 12  # L = 4 sublayers
L = 2 * N_LAYER
STRATEGIES = {
    "standard": StandardResidual,
    "block": partial(BlockAttentionResidual, num_blocks=2),
    "block_unequal": partial(BlockAttentionResidual, block_sizes=[1, 2, 1]),
    "full": FullAttentionResidual,
    "full_window": partial(FullAttentionResidual, window=1),
    "block_static_mixing": partial(BlockAttentionResidual, num_blocks=2, mixing="static"),
    "denseformer": DenseFormerResidual,
    "hc": HyperConnectionResidual,
    "mhc": ManifoldHyperConnectionResidual,
}
ATTNRES = ["block", "block_unequal", "full", "full_window", "block_static_mixing"]


@pytest.fixture(autouse=True)
def _one_thread(torch_single_thread):
    yield


def _model(kind: str, seed: int = 0, trained: bool = True, **model_kw) -> Transformer:
    """A float64 tiny model; `trained`: random pseudo-queries, gains and static logits (else the
    zero queries of initialisation), so that the weights are not uniform."""
    torch.manual_seed(seed)
    model = Transformer(vocab_size=V, n_layer=N_LAYER, n_head=2, n_embd=D, block_size=T,
                        residual=STRATEGIES[kind], **model_kw).double()
    if trained:
        with torch.no_grad():
            for name, p in model.residual.named_parameters():
                if "pseudo_query" in name or "mixing_logits" in name:
                    p.normal_(0.0, 2.0)
                elif "key_norm_weight" in name:
                    p.uniform_(0.5, 1.5)
    return model.eval()


def _batches(n: int = 2, b: int = 3, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (b, T), generator=g)
        y = torch.randint(0, V, (b, T), generator=g)
        y[0, :3] = -100  # some unscored positions: the loss is over scored tokens only
        out.append((x, y))
    return out


def _loss(logits: torch.Tensor, batches_targets: list[torch.Tensor]) -> float:
    """Mean cross-entropy over every scored token of the evaluation set."""
    total, count = 0.0, 0
    for lg, y in zip(logits, batches_targets, strict=True):
        total += F.cross_entropy(lg.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((y != -100).sum())
    return total / count


def _head(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    return model.head(model.norm(h))


def _rope(model: Transformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return model.rope_cos[: x.shape[1]], model.rope_sin[: x.shape[1]]


# == independent references ===========================================================================
def _manual_attnres(model: Transformer, idx: torch.Tensor, ref_attention, removed=(), drop=None) -> torch.Tensor:
    """Logits of Block AttnRes (Full: blocks of one) written from DESIGN.md with the reference depth
    attention: `removed` sublayers' outputs are left out of every sum and every softmax (a block
    with no output left is no source); `drop=(row, column)` leaves that source out of that row only."""
    res = model.residual
    sizes = getattr(res, "block_sizes", (1,) * res.num_layers)
    gain = res.key_norm_weight
    e, rope = model.embed(idx), _rope(model, idx)

    def attend(index, sources):
        columns = list(range(len(sources)))
        if drop is not None and drop[0] == index:
            columns.remove(drop[1])
        h, _ = ref_attention([sources[c] for c in columns], res.pseudo_query[index], gain[index], res.eps)
        return h

    blocks, index = [e], 0
    for size in sizes:
        partial_sum = None
        for _ in range(size):
            h = attend(index, blocks if partial_sum is None else [*blocks, partial_sum])
            out = model.sublayers[index](h, rope=rope)
            if index not in removed:
                partial_sum = out if partial_sum is None else partial_sum + out
            index += 1
        if partial_sum is not None:
            blocks.append(partial_sum)
    return _head(model, attend(res.num_layers, blocks))


def _manual_standard(model: Transformer, idx: torch.Tensor, removed: int) -> torch.Tensor:
    h, rope = model.embed(idx), _rope(model, idx)
    for index, sublayer in enumerate(model.sublayers):
        if index != removed:
            h = h + sublayer(h, rope=rope)
    return _head(model, h)


def _clean(model, batches) -> float:
    with torch.no_grad():
        return _loss([model(x)["logits"] for x, _ in batches], [y for _, y in batches])


# == source knock-outs ==================================================================================
@pytest.mark.parametrize("kind", ["block", "block_unequal", "full"])
def test_source_knockout_equals_the_source_left_out_of_that_row(kind, ref_depth_attention):
    model, batches = _model(kind), _batches()
    probe = probe_routing(model, batches)
    clean = _clean(model, batches)
    assert probe.clean_loss == pytest.approx(clean, rel=1e-12)
    checked = 0
    with torch.no_grad():
        for r, row in enumerate(probe.rows):
            for c in range(probe.mass.shape[1]):
                if np.isnan(probe.mass[r, c]) or np.isnan(probe.source_effect[r, c]):
                    continue
                logits = [_manual_attnres(model, x, ref_depth_attention, drop=(row, c)) for x, _ in batches]
                expected = _loss(logits, [y for _, y in batches]) - clean
                assert probe.source_effect[r, c] == pytest.approx(expected, rel=1e-9, abs=1e-12), (row, c)
                checked += 1
    assert checked >= 8
    assert np.abs(probe.source_effect[np.isfinite(probe.source_effect)]).max() > 1e-4  # the check has teeth


def test_a_source_with_zero_weight_changes_nothing():
    # Full AttnRes, float64, with sublayer 1's output made a constant c (its down projection 0, bias c):
    # row 3 sees it as source 2 and its query points against RMSNorm(c), so the softmax gives it
    # exactly 0 (the logit gap is ~1e5 >> 745, where float64 exp underflows)
    model = _model("full", bias=True)
    res = model.residual
    with torch.no_grad():
        mlp = model.sublayers[1]
        mlp.down.weight.zero_()
        c = torch.randn(D, dtype=torch.float64)
        mlp.down.bias.copy_(c)
        key = c / c.pow(2).mean().add(res.eps).sqrt() * res.key_norm_weight[3]
        res.pseudo_query[3] = -1e5 * key / key.pow(2).sum()
    batches = _batches()
    probe = probe_routing(model, batches)
    row = probe.rows.index(3)
    assert probe.mass[row, 2] == 0.0  # exactly: it is the zero-weight source
    assert probe.source_effect[row, 2] == pytest.approx(0.0, abs=1e-12)
    assert source_knockout(model, batches, 3, 2) == pytest.approx(0.0, abs=1e-12)
    assert abs(probe.source_effect[row, int(np.nanargmax(probe.mass[row]))]) > 1e-6  # a weighted one does count


def test_sources_outside_a_window_have_zero_weight_and_zero_effect():
    probe = probe_routing(_model("full_window"), _batches())
    row = probe.rows.index(3)  # sources: emb, out 0, out 1, out 2; the window of 1 sees emb and out 2
    assert probe.mass[row, 1] == 0.0 and probe.mass[row, 2] == 0.0
    assert probe.source_effect[row, 1] == 0.0 and probe.source_effect[row, 2] == 0.0
    assert probe.source_effect[row, 3] != 0.0


def test_the_only_source_of_the_first_sublayer_is_refused():
    model, batches = _model("block"), _batches(1)
    with pytest.raises(ValueError, match=r"sublayer L0 attn reads a single source \(emb\).*two or more sources"):
        source_knockout(model, batches, 0, 0)
    assert model.residual._knockout is None  # disarmed after the refusal
    probe = probe_routing(model, batches)
    assert np.isnan(probe.source_effect[0]).all() and probe.mass[0, 0] == 1.0  # in the matrix: left out
    # and by the hook itself, should anyone arm one by hand
    with pytest.raises(ValueError, match="single source"), torch.no_grad():
        with knockout(model.residual, Knockout(row=0, columns=[0])):
            model(batches[0][0])
    assert model.residual._knockout is None


@pytest.mark.parametrize("kind", ["standard", "denseformer", "hc"])
def test_strategies_without_a_softmax_have_no_source_knockouts(kind):
    model, batches = _model(kind), _batches(1)
    with pytest.raises(ValueError, match="has no source knock-outs.*use layer knock-outs"):
        source_knockout(model, batches, 1, 0)
    probe = probe_routing(model, batches)
    assert probe.source_effect is None and probe.layer_effect.shape == (L,)


def test_bad_indices_are_refused_with_the_valid_ones():
    model, batches = _model("block"), _batches(1)
    with pytest.raises(ValueError, match=r"row=9 is not a sublayer with depth weights; valid rows: 0, 1, 2, 3, 4"):
        source_knockout(model, batches, 9, 0)
    with pytest.raises(ValueError, match=r"sublayer L1 attn has sources 0..1, not source=5"):
        source_knockout(model, batches, 2, 5)
    with pytest.raises(ValueError, match=r"layer=4 must be a sublayer index 0..3"):
        layer_knockout(model, batches, 4)
    with pytest.raises(ValueError, match="mode must be one of 'remove', 'mean'"):
        probe_routing(model, batches, mode="zero")
    with pytest.raises(ValueError, match="evaluation set is empty"):
        probe_routing(model, [])


def test_zero_queries_match_the_analytic_change_of_the_uniform_mean():
    # at initialisation every row is the uniform mean h = sum(v) / S; without source i it is
    # (S h - v_i) / (S - 1). Reference: the intact model with sublayer l's input (or the final
    # norm's, for the output row) replaced by that, v_i read from the intact pass.
    model, batches = _model("block", trained=False), _batches()
    res = model.residual
    probe = probe_routing(model, batches)
    clean = _clean(model, batches)
    intact: list[list[torch.Tensor]] = []  # per batch, every sublayer's output in the intact model
    hooks = [s.register_forward_hook(lambda m, a, out: intact[-1].append(out)) for s in model.sublayers]
    try:
        with torch.no_grad():
            for x, _ in batches:
                intact.append([])
                model(x)
    finally:
        for h in hooks:
            h.remove()

    def sources(index, outs, e):  # Block N=2, S=2: [e, b1] then [e, b1, b2 partial] etc.
        blocks, part = [e], []
        for k in range(index):
            part.append(outs[k])
            if (k + 1) % res.block_size == 0:
                blocks.append(sum(part))
                part = []
        return blocks + ([sum(part)] if part else [])

    checked = 0
    for r, row in enumerate(probe.rows):
        for i in range(probe.mass.shape[1]):
            if np.isnan(probe.source_effect[r, i]):
                continue
            logits = []
            for (x, _), outs in zip(batches, intact, strict=True):
                src = sources(row, outs, model.embed(x))
                S = len(src)
                target = model.norm if row == res.num_layers else model.sublayers[row]
                new_input = (sum(src) - src[i]) / (S - 1)  # the uniform mean of the others
                hook = target.register_forward_pre_hook(lambda m, args, new=new_input: (new, *args[1:]))
                try:
                    with torch.no_grad():
                        logits.append(model(x)["logits"])
                finally:
                    hook.remove()
            expected = _loss(logits, [y for _, y in batches]) - clean
            assert probe.mass[r, i] == pytest.approx(1 / len(src), rel=1e-12)
            assert probe.source_effect[r, i] == pytest.approx(expected, rel=1e-8, abs=1e-12), (row, i)
            checked += 1
    assert checked == 2 + 2 + 3 + 3  # rows 1, 2, 3 (2, 2 and 3 sources) and the output (3)


@pytest.mark.parametrize("mode", ["remove", "mean"])
@pytest.mark.parametrize("kind", ATTNRES)
def test_batched_knockouts_equal_one_at_a_time(kind, mode):
    model, batches = _model(kind), _batches()
    batched = probe_routing(model, batches, mode=mode)
    stacked_in_twos = probe_routing(model, batches, mode=mode, max_stack=2)  # a row split over passes
    alone = probe_routing(model, batches, mode=mode, batched=False)
    for other in (stacked_in_twos, alone):
        np.testing.assert_allclose(batched.source_effect, other.source_effect, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(batched.layer_effect, other.layer_effect, rtol=1e-9, atol=1e-12)
    for r, row in enumerate(batched.rows):  # and the single-knock-out entry point agrees
        c = int(np.nanargmax(batched.mass[r]))
        if np.isfinite(batched.source_effect[r, c]):
            assert batched.source_effect[r, c] == pytest.approx(source_knockout(model, batches, row, c, mode),
                                                                rel=1e-9, abs=1e-12)


def test_mean_mode_replaces_the_source_by_its_mean_over_the_evaluation_set(ref_depth_attention):
    model, batches = _model("full"), _batches()
    res = model.residual
    row, column = 3, 1  # Full: source 1 of row 3 is sublayer 0's output
    outputs: list[torch.Tensor] = []
    hook = model.sublayers[0].register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        clean = _clean(model, batches)
    finally:
        hook.remove()
    mean = torch.cat([o.flatten(0, 1) for o in outputs]).mean(0)  # (D,) over every token of the set
    logits = []
    with torch.no_grad():
        for x, _ in batches:
            e, rope = model.embed(x), _rope(model, x)
            srcs = [e]
            for index, sublayer in enumerate(model.sublayers):
                use = [mean.expand_as(s) if (index == row and j == column) else s for j, s in enumerate(srcs)]
                h, _ = ref_depth_attention(use, res.pseudo_query[index], res.key_norm_weight[index], res.eps)
                srcs.append(sublayer(h, rope=rope))
            h, _ = ref_depth_attention(srcs, res.pseudo_query[L], res.key_norm_weight[L], res.eps)
            logits.append(_head(model, h))
    expected = _loss(logits, [y for _, y in batches]) - clean
    assert source_knockout(model, batches, row, column, mode="mean") == pytest.approx(expected, rel=1e-9)


# == layer knock-outs ===================================================================================
def test_layer_knockout_of_standard_equals_removing_that_sublayers_add():
    model, batches = _model("standard"), _batches()
    probe = probe_routing(model, batches)
    clean = _clean(model, batches)
    with torch.no_grad():
        for layer in range(L):
            expected = _loss([_manual_standard(model, x, layer) for x, _ in batches], [y for _, y in batches]) - clean
            assert probe.layer_effect[layer] == pytest.approx(expected, rel=1e-9, abs=1e-12)
            assert layer_knockout(model, batches, layer) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert probe.layer_effect.min() != probe.layer_effect.max()


@pytest.mark.parametrize("kind", ["block", "block_unequal", "full"])
def test_layer_knockout_of_attnres_drops_the_output_from_every_softmax(kind, ref_depth_attention):
    # block_unequal has blocks [1, 2, 1]: removing sublayer 0 or 3 removes a whole block as a
    # source; removing sublayer 1 leaves sublayer 2 with no partial sum, its block then being
    # sublayer 2's output alone
    model, batches = _model(kind), _batches()
    probe = probe_routing(model, batches)
    clean = _clean(model, batches)
    with torch.no_grad():
        for layer in range(L):
            logits = [_manual_attnres(model, x, ref_depth_attention, removed={layer}) for x, _ in batches]
            expected = _loss(logits, [y for _, y in batches]) - clean
            assert probe.layer_effect[layer] == pytest.approx(expected, rel=1e-9, abs=1e-12), layer
    # a zero source is not the same thing: it would take a share of the softmax
    assert np.abs(probe.layer_effect).max() > 1e-4


@pytest.mark.parametrize("kind", ["denseformer", "hc", "mhc"])
def test_layer_knockout_of_the_other_strategies_zeroes_the_output(kind):
    model, batches = _model(kind), _batches()
    probe = probe_routing(model, batches)
    clean = _clean(model, batches)
    for layer in (0, L - 1):
        hook = model.sublayers[layer].register_forward_hook(lambda m, a, out: torch.zeros_like(out))
        try:
            expected = _clean(model, batches) - clean
        finally:
            hook.remove()
        assert probe.layer_effect[layer] == pytest.approx(expected, rel=1e-9, abs=1e-12)


# == everything is left as it was =====================================================================
@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_every_strategy_probes_and_is_left_as_it_was(kind):
    model, batches = _model(kind), _batches(1)
    model.train()
    before = model(batches[0][0])["logits"].detach()
    probe = probe_routing(model, batches)
    res = model.residual
    assert model.training and res._knockout is None and res.recorded is None and not res._record_next
    assert torch.equal(model(batches[0][0])["logits"].detach(), before)
    if hasattr(res, "fast_kernel") and not res.ablated:
        assert res.fast_kernel(batches[0][0].double()) is not None  # the fast path is back
    assert probe.layer_effect.shape == (L,) and np.isfinite(probe.layer_effect).all()
    if res.has_depth_attention:
        assert probe.mass.shape[0] == len(probe.row_labels) and probe.row_labels[-1] == "output"
        np.testing.assert_allclose(np.nansum(probe.mass, axis=1), 1.0, rtol=1e-6)  # DenseFormer, HC: float32 rows
    else:
        assert probe.mass is None
    assert (probe.source_effect is not None) == res.source_knockouts
    assert json.dumps(probe.to_dict(), allow_nan=True)
    for m in model.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks)


def test_a_stop_request_ends_the_probes_and_disarms():
    model, batches = _model("block"), _batches(1)
    calls = []
    with pytest.raises(ProbesStopped):
        probe_routing(model, batches, should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert model.residual._knockout is None and not model.training


def test_a_nonfinite_model_is_reported_not_probed():
    model, batches = _model("block"), _batches(1)
    with torch.no_grad():
        model.sublayers[1].up.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="loss on the evaluation set is nan.*before the loss diverged"):
        probe_routing(model, batches)


def test_rank_correlation_and_top_agreement_match_scipy():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    mass = rng.random((5, 6))
    effect = rng.normal(size=(5, 6))
    mass[0, 2:] = effect[0, 2:] = np.nan  # two sources: no correlation
    mass[1, 4:] = effect[1, 4:] = np.nan
    effect[2, :3] = 0.25  # ties
    rho = rank_correlation(mass, effect)
    assert np.isnan(rho[0])
    for r in range(1, 5):
        ok = np.isfinite(mass[r])
        assert rho[r] == pytest.approx(spearmanr(mass[r][ok], effect[r][ok]).statistic, rel=1e-12)
    top = top_agreement(mass, effect)
    for r in range(5):
        ok = np.flatnonzero(np.isfinite(mass[r]))
        assert top[r] == float(ok[np.argmax(mass[r][ok])] == ok[np.argmax(effect[r][ok])])


# == figures, callback, script ===========================================================================


