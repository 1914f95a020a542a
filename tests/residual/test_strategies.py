"""The residual strategies (attnres/residual/base.py, standard.py, full.py, block.py) against
float64 references of DESIGN.md section 2, their initial state, recording, errors, gradcheck, and
drop-in use on a `torch.nn.TransformerEncoder`."""

# Arguments and loop variables use DESIGN.md's names (L sublayers, N blocks, Q/G queries and
# gains, l the sublayer index), as pyproject's N806 exception does for variables.
# ruff: noqa: N803, E741

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attnres import (
    BlockAttentionResidual,
    DepthRecord,
    FullAttentionResidual,
    ResidualStrategy,
    StandardResidual,
)
from tests.helpers import mixed_sublayers

pytestmark = pytest.mark.usefixtures("torch_single_thread")

D = 8


def make_sublayers(L: int, d: int = D, seed: int = 0) -> nn.ModuleList:
    """Float64 capturing sublayers; every other one is not scale-invariant, so a wrongly scaled input shows."""
    return mixed_sublayers(L, d, seed)


# ------------------------------------------------------------------------------------------------
# helpers: sublayers, strategies, references
# ------------------------------------------------------------------------------------------------


def randomize(strategy: ResidualStrategy, seed: int = 1) -> ResidualStrategy:
    """Nonzero random pseudo-queries and key-norm gains (O(1) logits: far from uniform)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        q = strategy.pseudo_query
        q.copy_(torch.randn(q.shape, generator=gen, dtype=torch.float64) * 2 / q.shape[-1] ** 0.5)
        if strategy.key_norm_weight is not None:
            g = strategy.key_norm_weight
            g.copy_(1 + 0.5 * torch.randn(g.shape, generator=gen, dtype=torch.float64))
    return strategy


# (kind, L, num_blocks, key_norm_gain, output_aggregation)
CONFIGS = [
    ("full", 1, None, True, True),
    ("full", 4, None, True, True),
    ("full", 5, None, False, True),
    ("full", 4, None, True, False),
    ("block", 4, 1, True, True),
    ("block", 4, 2, True, True),
    ("block", 4, 4, True, True),
    ("block", 6, 3, True, True),
    ("block", 6, 2, False, True),
    ("block", 6, 2, True, False),
    ("block", 2, 1, True, True),
    # explicit block sizes: a shorter last block, odd stacks, a block longer than 4 queries
    ("block", 6, (4, 2), True, True),
    ("block", 7, (3, 3, 1), True, True),
    ("block", 7, (2, 5), False, True),
    ("block", 7, (2, 3, 2), True, True),  # the middle block the longest
    ("block", 5, (1, 1, 3), True, False),
    # phase 1 a block early (`ahead_blocks`): the default's pairs (blocks 3-4, 5-6, 7-8 of 8), 6 queries in one pass
    ("block", 16, 8, True, True),
    ("block", 15, (3, 3, 3, 3, 3), False, True),
]


def config_id(kind, L, N, gain, agg) -> str:
    blocks = "" if not N else f"-N{N}" if isinstance(N, int) else "-sizes" + "_".join(map(str, N))
    return f"{kind}-L{L}" + blocks + ("" if gain else "-nogain") + ("" if agg else "-noagg")


def sizes_of(L, N) -> list[int]:
    """Sublayers per block: N equal blocks, or N itself when it is a tuple of block sizes."""
    return [L // N] * N if isinstance(N, int) else list(N)


CONFIG_PARAMS = [pytest.param(*c, id=config_id(*c)) for c in CONFIGS]


def build(kind, L, N, gain, agg, d=D, eps=1e-6, kernel="auto"):
    if kind == "full":
        s = FullAttentionResidual(d, L, eps=eps, key_norm_gain=gain, output_aggregation=agg, kernel=kernel)
    else:
        blocks = {"num_blocks": N} if isinstance(N, int) else {"block_sizes": list(N)}
        s = BlockAttentionResidual(d, L, **blocks, eps=eps, key_norm_gain=gain, output_aggregation=agg, kernel=kernel)
    return s.double()


def expected_num_sources(kind, L, N) -> list[int]:
    """S_l for l = 0 .. L-1 and (index L) the output aggregation, from DESIGN.md section 2."""
    if kind == "full":
        return [l + 1 for l in range(L)] + [L + 1]
    counts = []
    for n, S in enumerate(sizes_of(L, N)):  # the embedding, n completed blocks, and the partial sum from i = 1
        counts += [1 + n + (1 if i else 0) for i in range(S)]
    return counts + [len(sizes_of(L, N)) + 1]


def ref_full(attend, e, fs, Q, G, eps, agg):
    """Full AttnRes: sublayer l attends over [e, f_0(h_0), ..., f_{l-1}(h_{l-1})]."""
    L = len(fs)
    gain = (lambda i: None) if G is None else (lambda i: G[i])
    sources, alphas = [e], []
    for l in range(L):
        h, alpha = attend(sources, Q[l], gain(l), eps)
        alphas.append(alpha)
        sources.append(fs[l](h))
    if not agg:
        return sum(sources[1:], sources[0]), alphas
    out, alpha = attend(sources, Q[L], gain(L), eps)
    return out, [*alphas, alpha]


def ref_block(attend, e, fs, N, Q, G, eps, agg):
    """Block AttnRes: b_0 = e on its own; sublayer i of block n attends over the completed blocks
    and (i >= 2) the partial sum of the block's earlier outputs; never a zero source. N is the
    number of equal blocks, or a tuple of block sizes."""
    L = len(fs)
    gain = (lambda i: None) if G is None else (lambda i: G[i])
    completed, alphas = [e], []
    l = 0
    for S in sizes_of(L, N):
        outputs = []
        for _ in range(S):
            sources = completed if not outputs else [*completed, sum(outputs[1:], outputs[0])]
            h, alpha = attend(sources, Q[l], gain(l), eps)
            alphas.append(alpha)
            outputs.append(fs[l](h))
            l += 1
        completed.append(sum(outputs[1:], outputs[0]))
    if not agg:
        return sum(completed[1:], completed[0]), alphas
    out, alpha = attend(completed, Q[L], gain(L), eps)
    return out, [*alphas, alpha]


def ref_standard(e, fs):
    h = e
    for f in fs:
        h = h + f(h)
    return h


def reference(attend, kind, N, e, fs, Q, G, eps, agg):
    if kind == "full":
        return ref_full(attend, e, fs, Q, G, eps, agg)
    return ref_block(attend, e, fs, N, Q, G, eps, agg)


# ------------------------------------------------------------------------------------------------
# strategies against the references
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,L,N,gain,agg", CONFIG_PARAMS)
def test_attnres_strategy_matches_reference(kind, L, N, gain, agg, rel_err, ref_depth_attention):
    strategy = randomize(build(kind, L, N, gain, agg))
    sublayers = make_sublayers(L)
    e = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    strategy.record_next()
    out = strategy(e, sublayers)
    params = [strategy.pseudo_query] + ([strategy.key_norm_weight] if gain else [])

    Q = strategy.pseudo_query.detach().clone().requires_grad_()
    G = strategy.key_norm_weight.detach().clone().requires_grad_() if gain else None
    ref_out, ref_alphas = reference(ref_depth_attention, kind, N, e, list(sublayers), Q, G, strategy.eps, agg)
    assert rel_err(out, ref_out) < 1e-12

    # every recorded weight row is the reference's, at the right index
    record = strategy.recorded
    assert sorted(record.weights) == list(range(L + (1 if agg else 0)))
    for l, alpha in enumerate(ref_alphas):
        assert rel_err(record.weights[l], alpha) < 1e-12

    # gradients w.r.t. the embedding, the queries and the gains
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [e, *params], cot)
    ref_grads = torch.autograd.grad(ref_out, [e, Q] + ([G] if gain else []), cot)
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-12
    if not agg:  # the output is the plain sum: the last query and gain get no gradient
        assert grads[1][L].abs().max() == 0


@pytest.mark.parametrize("kernel", ["torch", "naive"])
@pytest.mark.parametrize("kind,L,N,gain,agg", CONFIG_PARAMS)
def test_fast_path_matches_reference(kind, L, N, gain, agg, kernel, rel_err, ref_depth_attention):
    """A pass that does not record takes the two-phase fast path (kernel="torch"), unequal blocks
    included; "naive" runs one reference attention per sublayer. Both against the reference."""
    strategy = randomize(build(kind, L, N, gain, agg, kernel=kernel), seed=L)
    sublayers = make_sublayers(L, seed=1)
    e = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    out = strategy(e, sublayers)
    assert strategy.recorded is None
    Q = strategy.pseudo_query.detach().clone().requires_grad_()
    G = strategy.key_norm_weight.detach().clone().requires_grad_() if gain else None
    ref_out, _ = reference(ref_depth_attention, kind, N, e, list(sublayers), Q, G, strategy.eps, agg)
    assert rel_err(out, ref_out) < 1e-12
    params = [strategy.pseudo_query] + ([strategy.key_norm_weight] if gain else [])
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [e, *params, *sublayers.parameters()], cot)
    ref_grads = torch.autograd.grad(ref_out, [e, Q, *([G] if gain else []), *sublayers.parameters()], cot)
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-12


def test_standard_matches_reference(rel_err):
    sublayers = make_sublayers(4)
    e = torch.randn(2, 3, D, dtype=torch.float64)
    strategy = StandardResidual(D, 4)
    assert list(strategy.parameters()) == []
    assert rel_err(strategy(e, sublayers), ref_standard(e, list(sublayers))) < 1e-12


@pytest.mark.parametrize("L", [2, 4, 6])
def test_block_with_one_sublayer_per_block_is_full(L):
    full = randomize(build("full", L, None, True, True), seed=L)
    block = build("block", L, L, True, True)
    block.load_state_dict(full.state_dict())
    sublayers = make_sublayers(L)
    e = torch.randn(2, 3, D, dtype=torch.float64)
    full.record_next()
    block.record_next()
    assert torch.equal(full(e, sublayers), block(e, sublayers))
    for l in range(L + 1):
        assert torch.equal(full.recorded.weights[l], block.recorded.weights[l])


@pytest.mark.parametrize("record", [False, True], ids=["fast", "recording"])
@pytest.mark.parametrize("kernel", ["torch", "naive"])
@pytest.mark.parametrize("L,N", [(6, 3), (8, 2), (4, 4), (6, 1)], ids=["L6-N3", "L8-N2", "L4-N4", "L6-N1"])
def test_uniform_block_sizes_are_num_blocks_exactly(L, N, kernel, record):
    by_count = randomize(build("block", L, N, True, True, kernel=kernel), seed=2)
    by_sizes = build("block", L, (L // N,) * N, True, True, kernel=kernel)
    by_sizes.load_state_dict(by_count.state_dict())
    assert by_sizes.block_sizes == by_count.block_sizes == (L // N,) * N
    assert by_sizes.num_blocks == N and by_sizes.block_size == L // N
    sublayers = make_sublayers(L)
    e = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for strategy in (by_count, by_sizes):
        if record:
            strategy.record_next()
        out = strategy(e, sublayers)
        outs.append(out)
        grads.append(torch.autograd.grad(out.sum(), [e, *strategy.parameters()]))
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    if record:
        assert by_count.recorded.weights.keys() == by_sizes.recorded.weights.keys()
        for l, w in by_count.recorded.weights.items():
            assert torch.equal(w, by_sizes.recorded.weights[l])


def test_unequal_blocks_have_the_listed_boundaries():
    """L = 7 in blocks (3, 3, 1): sublayer 6 starts the last block, so it reads the embedding and
    the two completed blocks only (3 sources), and the output aggregation 4 sources."""
    strategy = build("block", 7, (3, 3, 1), True, True)
    assert strategy.num_blocks == 3 and strategy.block_size is None and strategy.block_sizes == (3, 3, 1)
    assert "block_sizes=[3, 3, 1]" in repr(strategy)
    strategy.record_next()
    strategy(torch.randn(1, 2, D, dtype=torch.float64), make_sublayers(7))
    counts = [strategy.recorded.weights[l].shape[0] for l in range(8)]
    assert counts == [1, 2, 2, 2, 3, 3, 3, 4]


# ------------------------------------------------------------------------------------------------
# state at initialisation: uniform means of exactly the listed sources
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,L,N,gain,agg", CONFIG_PARAMS)
def test_at_init_every_sublayer_reads_the_uniform_mean_of_its_sources(kind, L, N, gain, agg, rel_err):
    strategy = build(kind, L, N, gain, agg)
    assert torch.equal(strategy.pseudo_query, torch.zeros(L + 1, D, dtype=torch.float64))
    if gain:
        assert torch.equal(strategy.key_norm_weight, torch.ones(L + 1, D, dtype=torch.float64))
    sublayers = make_sublayers(L)
    e = torch.randn(2, 3, D, dtype=torch.float64)
    strategy.record_next()
    out = strategy(e, sublayers)
    record = strategy.recorded
    assert isinstance(record, DepthRecord) and record.num_layers == L

    counts = expected_num_sources(kind, L, N)
    for l in range(L + (1 if agg else 0)):
        w = record.weights[l]
        assert w.shape == (counts[l], 2, 3), f"sublayer {l}"
        assert torch.equal(w, torch.full_like(w, 1.0 / counts[l])), f"sublayer {l}"

    outputs = [s.outputs[0] for s in sublayers]
    if kind == "full":
        expected_sources = [[e, *outputs[:l]] for l in range(L + 1)]
    else:
        sizes = sizes_of(L, N)
        starts = [sum(sizes[:n]) for n in range(len(sizes))]
        blocks = [e] + [sum(outputs[a : a + S]) for a, S in zip(starts, sizes, strict=True)]
        expected_sources = []
        for n, (a, S) in enumerate(zip(starts, sizes, strict=True)):
            for l in range(a, a + S):
                expected_sources.append(blocks[: n + 1] + ([sum(outputs[a:l])] if l > a else []))
        expected_sources.append(blocks)
    for l in range(L):
        assert len(expected_sources[l]) == counts[l]
        mean = torch.stack(expected_sources[l]).mean(0)
        assert rel_err(sublayers[l].inputs[0], mean) < 1e-12, f"sublayer {l}"
    all_sources = torch.stack(expected_sources[L])
    assert rel_err(out, all_sources.mean(0) if agg else all_sources.sum(0)) < 1e-12


@pytest.mark.parametrize("kind,L,N,gain,agg", [CONFIG_PARAMS[1], CONFIG_PARAMS[5]])
def test_recording_applies_to_the_next_forward_only(kind, L, N, gain, agg):
    strategy = randomize(build(kind, L, N, gain, agg))
    sublayers = make_sublayers(L)
    e = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    strategy(e, sublayers)
    assert strategy.recorded is None

    strategy.record_next()
    strategy(e, sublayers)
    record = strategy.recorded
    assert record is not None and len(record.input_rms) == len(record.output_rms) == L
    assert all(not w.requires_grad for w in record.weights.values())
    for l, sublayer in enumerate(sublayers):
        x, y = sublayer.inputs[-1], sublayer.outputs[-1]
        assert torch.allclose(record.input_rms[l].double(), x.pow(2).mean(-1).sqrt().mean(), rtol=1e-6)
        assert torch.allclose(record.output_rms[l].double(), y.pow(2).mean(-1).sqrt().mean(), rtol=1e-6)

    strategy(e, sublayers)
    assert strategy.recorded is None


def test_standard_records_magnitudes_but_no_weights():
    strategy = StandardResidual(D, 4)
    sublayers = make_sublayers(4)
    strategy.record_next()
    strategy(torch.randn(1, 2, D, dtype=torch.float64), sublayers)
    assert strategy.recorded.weights == {}
    assert len(strategy.recorded.input_rms) == 4 and len(strategy.recorded.output_rms) == 4


# ------------------------------------------------------------------------------------------------
# construction: options and errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "L,num_blocks,valid",
    [
        pytest.param(6, 4, "1, 2, 3, 6", id="L6-N4"),
        pytest.param(8, 3, "1, 2, 4, 8", id="L8-N3"),
        pytest.param(8, 16, "1, 2, 4, 8", id="L8-N16"),
        pytest.param(8, 0, "1, 2, 4, 8", id="L8-N0"),
    ],
)
def test_num_blocks_must_divide_num_layers(L, num_blocks, valid):
    with pytest.raises(ValueError, match=f"num_blocks={num_blocks}.*block_sizes=.*valid values: {valid}$") as info:
        BlockAttentionResidual(D, L, num_blocks=num_blocks)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"block_sizes": [4, 1]}, r"block_sizes=\[4, 1\] must be positive.*summing to the 6", id="sum"),
        pytest.param({"block_sizes": [4, 2, 0]}, r"positive ints", id="zero"),
        pytest.param({"block_sizes": [7, -1]}, r"positive ints", id="negative"),
        pytest.param({"block_sizes": [4.0, 2]}, r"positive ints", id="float"),
        pytest.param({"block_sizes": [True, 5]}, r"positive ints", id="bool"),
        pytest.param({"block_sizes": []}, r"positive ints", id="empty"),
        pytest.param({"block_sizes": "42"}, r"positive ints", id="string"),
        pytest.param({"block_sizes": 6}, r"positive ints", id="int"),
        pytest.param(
            {"num_blocks": 3, "block_sizes": [4, 2]}, r"num_blocks=3 disagrees with block_sizes=\[4, 2\] \(2 blocks\)",
            id="inconsistent",
        ),
        pytest.param({"num_blocks": 8, "block_sizes": [4, 2]}, r"num_blocks=8 disagrees", id="explicit-8"),
    ],
)
def test_bad_block_sizes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        BlockAttentionResidual(D, 6, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs,sizes",
    [
        pytest.param({}, (1,) * 8, id="default-N8"),
        pytest.param({"block_sizes": (5, 3)}, (5, 3), id="sizes-win-over-the-default"),
        pytest.param({"num_blocks": 2, "block_sizes": [6, 2]}, (6, 2), id="consistent"),
        pytest.param({"num_blocks": None, "block_sizes": [6, 2]}, (6, 2), id="num-blocks-none"),
    ],
)
def test_block_sizes_and_num_blocks(kwargs, sizes):
    strategy = BlockAttentionResidual(D, 8, **kwargs)
    assert strategy.block_sizes == sizes and strategy.num_blocks == len(sizes)
    assert type(strategy.num_blocks) is int  # not the default's marker type


@pytest.mark.parametrize("cls", [StandardResidual, FullAttentionResidual, BlockAttentionResidual])
@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"d_model": 0, "num_layers": 2}, "positive", id="d0"),
        pytest.param({"d_model": 8, "num_layers": 0}, "positive", id="L0"),
        pytest.param({"d_model": 8, "num_layers": 2, "eps": 0.0}, "eps", id="eps0"),
    ],
)
def test_bad_construction_raises(cls, kwargs, match):
    if cls is BlockAttentionResidual:
        kwargs = {**kwargs, "num_blocks": 1}
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [StandardResidual, FullAttentionResidual])
def test_wrong_number_of_sublayers_raises(cls):
    with pytest.raises(ValueError, match="num_layers=4.*got 3"):
        cls(D, 4).double()(torch.randn(1, 2, D, dtype=torch.float64), make_sublayers(3))


@pytest.mark.parametrize("kind", ["full", "block"])
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "nogain"])
def test_parameters_owned(kind, gain):
    L = 6
    strategy = build(kind, L, 3, gain, True)
    names = dict(strategy.named_parameters())
    assert set(names) == ({"pseudo_query", "key_norm_weight"} if gain else {"pseudo_query"})
    assert sum(p.numel() for p in strategy.parameters()) == (2 if gain else 1) * (L + 1) * D


# ------------------------------------------------------------------------------------------------
# gradcheck (float64) through the strategies
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,L,N", [("full", 3, None), ("block", 4, 2)], ids=["full-L3", "block-L4-N2"])
def test_gradcheck_strategy(kind, L, N):
    d = 4
    strategy = randomize(build(kind, L, N, True, True, d=d), seed=5)
    sublayers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh()) for _ in range(L)).double()
    e = torch.randn(1, 2, d, dtype=torch.float64, requires_grad=True)
    q = strategy.pseudo_query.detach().clone().requires_grad_()
    g = strategy.key_norm_weight.detach().clone().requires_grad_()

    def fn(e, q, g):
        return torch.func.functional_call(strategy, {"pseudo_query": q, "key_norm_weight": g}, (e, sublayers))

    assert torch.autograd.gradcheck(fn, (e, q, g))


# ------------------------------------------------------------------------------------------------
# drop-in use on torch.nn.TransformerEncoder
# ------------------------------------------------------------------------------------------------

MASK_MODES = ["none", "padding", "is_causal", "is_causal+padding", "causal-mask+padding"]


def make_encoder(batch_first: bool, norm_first: bool, final_norm: bool, num_layers: int = 2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=batch_first, norm_first=norm_first
    )
    norm = nn.LayerNorm(D) if final_norm else None
    encoder = nn.TransformerEncoder(layer, num_layers, norm=norm, enable_nested_tensor=False)
    with torch.no_grad():  # layers are deep copies of one layer: make them differ
        for p in encoder.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return encoder.double().eval()


def mask_inputs(mode: str, batch: int, seq_len: int):
    """Keyword arguments for the strategy and the (mask, padding, is_causal) the reference uses."""
    B, T = batch, seq_len
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    bool_causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True: not allowed to attend
    additive_pad = torch.zeros(B, T, dtype=torch.float64).masked_fill(pad, float("-inf"))
    if mode == "none":
        return {}, (None, None, False)
    if mode == "padding":
        return {"src_key_padding_mask": pad}, (None, additive_pad, False)
    if mode == "is_causal":
        return {"is_causal": True}, (causal, None, True)
    if mode == "is_causal+padding":
        return {"is_causal": True, "src_key_padding_mask": pad}, (causal, additive_pad, True)
    # a boolean causal mask next to the boolean padding mask (mixed types are torch's deprecation)
    return {"mask": bool_causal, "src_key_padding_mask": pad}, (causal, additive_pad, False)


def encoder_sublayers(encoder, mask, pad, is_causal):
    """DESIGN.md section 2: the pre-norm halves of each layer, whatever its norm_first says."""
    fs = []
    for layer in encoder.layers:
        fs.append(lambda h, layer=layer: layer._sa_block(layer.norm1(h), mask, pad, is_causal))
        fs.append(lambda h, layer=layer: layer._ff_block(layer.norm2(h)))
    return fs


@pytest.mark.parametrize("kind", ["full", "block"])
@pytest.mark.parametrize("mode", MASK_MODES)
@pytest.mark.parametrize("final_norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["normfirst", "postnorm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batchfirst", "seqfirst"])
def test_encoder_drop_in_matches_reference(
    batch_first, norm_first, final_norm, mode, kind, rel_err, ref_depth_attention
):
    B, T = 2, 5
    encoder = make_encoder(batch_first, norm_first, final_norm)
    strategy = randomize(build(kind, 4, 2, True, True), seed=3)
    src = torch.randn(B, T, D, dtype=torch.float64)
    if not batch_first:
        src = src.transpose(0, 1)  # (T, B, D)
    kwargs, (mask, pad, is_causal) = mask_inputs(mode, B, T)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. no mask-type mismatch warning from torch
        strategy.record_next()
        out = strategy(encoder, src, **kwargs)
    assert len(strategy.recorded.weights) == 5

    def ref_encoder(mask, pad, is_causal):
        fs = encoder_sublayers(encoder, mask, pad, is_causal)
        q, g = strategy.pseudo_query, strategy.key_norm_weight
        out, _ = reference(ref_depth_attention, kind, 2, src, fs, q, g, strategy.eps, True)
        return encoder.norm(out) if final_norm else out

    assert out.shape == src.shape
    assert rel_err(out, ref_encoder(mask, pad, is_causal)) < 1e-12
    if mode != "none":  # the masks reached the attention: without them the result differs
        assert rel_err(out, ref_encoder(None, None, False)) > 1e-3


@pytest.mark.parametrize("mode", ["none", "padding", "causal-mask+padding"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batchfirst", "seqfirst"])
def test_standard_residual_on_a_prenorm_encoder_is_the_encoder(batch_first, mode, rel_err):
    encoder = make_encoder(batch_first, norm_first=True, final_norm=True)
    src = torch.randn(2, 5, D, dtype=torch.float64)
    if not batch_first:
        src = src.transpose(0, 1)
    kwargs, _ = mask_inputs(mode, 2, 5)
    assert rel_err(StandardResidual(D, 4)(encoder, src, **kwargs), encoder(src, **kwargs)) < 1e-12


@pytest.mark.parametrize("cls", [StandardResidual, FullAttentionResidual, BlockAttentionResidual])
def test_encoder_with_wrong_num_layers_raises(cls):
    encoder = make_encoder(True, True, False, num_layers=3)
    strategy = cls(D, 4) if cls is not BlockAttentionResidual else cls(D, 4, num_blocks=2)
    with pytest.raises(ValueError, match=r"3 layers has 6 sublayers.*num_layers=6, not 4"):
        strategy.double()(encoder, torch.randn(2, 5, D, dtype=torch.float64))


def test_block_runs_phase_one_a_block_early_where_that_reads_less(monkeypatch):
    """`ahead_blocks`: a block shares its phase-1 pass with the next when 4c > 5 S' (c completed
    blocks, S' the next block's sublayers); the fast path then merges only the newest block into
    the next block's results (`merge_completed`), once per pair. The output's query joins the last
    phase-1 pass when that reads 2 blocks or more, and merges the blocks completed since."""
    from attnres.residual import block as block_module
    from attnres.residual.block import ahead_blocks

    f, t = False, True
    assert ahead_blocks((2,) * 8) == (f, f, t, f, t, f, t, f)  # the default: blocks 3-4, 5-6, 7-8 of 8
    assert ahead_blocks((1,) * 4) == (f, t, f, f)  # S' = 1: from c = 2
    assert ahead_blocks((2, 2)) == (f, f) and ahead_blocks((4,)) == (f,)
    assert ahead_blocks((3,) * 5) == (f, f, f, t, f)  # c = 4 > 3.75
    calls = []
    real = block_module.merge_completed
    monkeypatch.setattr(block_module, "merge_completed", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    strategy = build("block", 16, 8, True, True, kernel="torch")
    strategy(torch.randn(1, 2, D, dtype=torch.float64), make_sublayers(16))
    # each pair's second block (its 2 queries), then the output: its query ran with the last pair
    assert calls == [2, 2, 2, 1]
    calls.clear()
    build("block", 4, 1, True, True, kernel="torch")(torch.randn(1, 2, D, dtype=torch.float64), make_sublayers(4))
    assert calls == []  # one block: its phase 1 reads the embedding alone, the output reads both
