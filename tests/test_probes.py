"""Routing probes (attnres.probes): source and layer knock-outs held against independent float64
references written here from their definitions (manual forwards of the Transformer with a
source left out, an output removed, or a sublayer's input replaced by the analytic uniform
mean), batched against one-at-a-time, the figures, the callback and the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

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

REPO = Path(__file__).resolve().parents[1]
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
def test_the_routing_figure_has_the_same_rows_and_columns_on_both_heatmaps():
    from attnres.results import figures, probe_figures
    from attnres.training.routing import probe_arrays

    probe = probe_routing(_model("block"), _batches(1))
    shown = probe_arrays(probe)
    assert set(shown) == {"probe/routing", "probe/layer_knockout"}
    data, meta = shown["probe/routing"]
    assert data.shape == (4, *probe.mass.shape)
    fig = probe_figures.render_probe("probe/routing", data, meta, step=7)
    mass_ax, effect_ax = fig.axes[0], fig.axes[2]
    for axis in ("x", "y"):
        labels = [[t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()] for ax in (mass_ax, effect_ax)]
        assert labels[0] == labels[1]
    assert [t.get_text() for t in mass_ax.get_yticklabels()] == probe.row_labels
    assert [t.get_text() for t in mass_ax.get_xticklabels()] == probe.col_labels
    assert effect_ax.images[0].norm.vmin == -effect_ax.images[0].norm.vmax  # centred on 0
    pixels = figures.to_rgb(fig)
    assert pixels.ndim == 3 and pixels.shape[1] > pixels.shape[0]
    curve = probe_figures.render_probe("probe/layer_knockout", *shown["probe/layer_knockout"], step=7)
    low, high = curve.axes[0].get_ylim()
    assert low <= probe.layer_effect.min() and high >= probe.layer_effect.max()  # negative effects stay in view


@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*val_check_interval")
@pytest.mark.parametrize("enabled", [True, False])
def test_callback_probes_at_the_end_of_training(tmp_path, enabled):
    import pytorch_lightning as pl

    from attnres.training import LitLanguageModel
    from attnres.training.data import SyntheticDataModule
    from attnres.training.routing import RoutingProbes
    from attnres.training.tensorboard import TensorBoardLogger

    pl.seed_everything(0, verbose=False)
    data = SyntheticDataModule(block_size=16, batch_size=4, num_symbols=4, num_hops=1, val_batches=2)
    model = Transformer(vocab_size=data.vocab_size, n_layer=2, n_head=2, n_embd=16, block_size=16,
                        residual=partial(BlockAttentionResidual, num_blocks=2))
    module = LitLanguageModel(model, optimizer=partial(torch.optim.AdamW, lr=1e-3), metric=data.metric)
    probes = RoutingProbes(enabled=enabled, batches=2, dirpath=str(tmp_path))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="", version=""),
                         callbacks=[probes], enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=1, val_check_interval=2,
                         num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    written = tmp_path / "probes.json"
    if not enabled:
        assert not written.exists() and probes.result is None and probes.seconds == 0.0
        return
    result = json.loads(written.read_text())
    assert result["step"] == 2 and result["batches"] == 2 and len(result["layer_effect"]) == 4
    assert (tmp_path / "plots" / "routing.png").is_file() and (tmp_path / "plots" / "layer_knockout.png").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert {"probe/routing", "probe/layer_knockout"} <= set(acc.Tags()["images"])
    assert {"probe/routing_data", "probe/layer_knockout_data"} <= set(acc.Tags()["tensors"])
    assert module.model.residual._knockout is None


@pytest.mark.parametrize("bad", [{"enabled": "yes"}, {"batches": 0}, {"mode": "zero"}, {"layers": 1},
                                 {"max_stack": 0}])
def test_callback_options_are_checked(bad):
    from attnres.training.routing import RoutingProbes

    with pytest.raises(ValueError, match=r"callbacks\.routing_probes\."):
        RoutingProbes(**bad)


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "experiments" / "probe_routing.py"), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_script_refuses_what_it_cannot_probe(tmp_path):
    missing = _script(str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
    empty = _script(str(tmp_path), cwd=tmp_path)
    assert empty.returncode == 2 and "no run folders under" in empty.stderr
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("data: {_target_: nowhere.Nothing}\n")
    broken = _script(str(tmp_path / "run"), cwd=tmp_path)
    assert broken.returncode == 1 and "skipped: cannot rebuild the model" in broken.stderr
    bad = _script(str(tmp_path / "run"), "--batches", "0", cwd=tmp_path)
    assert bad.returncode == 2 and "--batches must be >= 1" in bad.stderr


@pytest.mark.slow
def test_script_on_a_sweep_of_real_runs(tmp_path):
    tiny = ["data=synthetic", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "trainer.max_steps=4",
            "trainer.val_check_interval=2", "trainer.accelerator=cpu", "data.batch_size=8", "data.val_batches=2",
            "data.block_size=64", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    for name, extra in {"standard": ["residual=standard"], "block": ["residual=block", "num_blocks=2"]}.items():
        run = subprocess.run([sys.executable, "-m", "attnres", *tiny, *extra, f"hydra.run.dir={tmp_path / name}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for _ in range(2):  # the same command twice: the same files, one probe event file per run
        done = _script(str(tmp_path), "--batches", "1", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert "mass-vs-effect rank correlation per sublayer" in done.stdout
    reused = _script(str(tmp_path), "--batches", "1", "--reuse", cwd=tmp_path)
    assert reused.returncode == 0 and reused.stdout.count("from its probes.json") == 2, reused.stdout
    again = _script(str(tmp_path), "--batches", "2", "--reuse", cwd=tmp_path)  # other settings: probed again
    assert again.returncode == 0 and "from its probes.json" not in again.stdout
    for name in ("standard", "block"):
        result = json.loads((tmp_path / name / "probes.json").read_text())
        assert result["step"] == 4 and len(result["layer_effect"]) == 4 and result["batches"] == 2
        assert (tmp_path / name / "plots" / "layer_knockout.png").is_file()
        assert len(list((tmp_path / name).glob("events.out.tfevents.*.probe_routing"))) == 1
    assert (tmp_path / "block" / "plots" / "routing.png").is_file()
    assert not (tmp_path / "standard" / "plots" / "routing.png").exists()
    assert (tmp_path / "plots" / "compare_layer_knockout.png").is_file()
