"""`attnres.TransformerEncoder`: with residual="standard" it is `torch.nn.TransformerEncoder`
(the same numbers to the last bit, masks, both norm placements and layouts, train and eval,
torch's fast path included); with "block_attention" / "full_attention" it is the drop-in
residual module run on the encoder, and owns that module's parameters."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import attnres
from attnres import BlockAttentionResidual, FullAttentionResidual

pytestmark = [
    pytest.mark.usefixtures("torch_single_thread"),
    # torch's own nested-tensor path, which nn.TransformerEncoder takes in eval mode without grad
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
]

D, B, T = 8, 3, 5

MASK_MODES = ["none", "padding", "float-mask", "bool-mask+padding", "causal+is_causal", "causal+is_causal+padding"]


def make_layer(batch_first: bool, norm_first: bool, dropout: float = 0.1, dtype=torch.float64):
    return nn.TransformerEncoderLayer(
        D, nhead=2, dim_feedforward=16, dropout=dropout, batch_first=batch_first, norm_first=norm_first, dtype=dtype
    )


def build_pair(batch_first, norm_first, final_norm=True, num_layers=2, dtype=torch.float64, **kwargs):
    """Our encoder and an `nn.TransformerEncoder` with the same (per-layer different) weights;
    nested tensors where torch can use them (elsewhere torch warns that it cannot)."""
    torch.manual_seed(0)
    layer = make_layer(batch_first, norm_first, dtype=dtype)
    nested = batch_first and not norm_first

    def norm():
        return nn.LayerNorm(D, dtype=dtype) if final_norm else None

    ours = attnres.TransformerEncoder(layer, num_layers, norm=norm(), enable_nested_tensor=nested, **kwargs)
    with torch.no_grad():  # the layers are deep copies of one layer: make them differ
        for name, p in ours.named_parameters():
            if not name.startswith("attn_residual."):
                p.add_(0.1 * torch.randn_like(p))
    ref = nn.TransformerEncoder(layer, num_layers, norm=norm(), enable_nested_tensor=nested)
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("attn_residual.")}
    ref.load_state_dict(state)  # strict: the same keys
    return ours, ref


def mask_kwargs(mode: str, dtype=torch.float64, seq_first: bool = False) -> dict:
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True  # right-padded, so torch's nested-tensor path can take it
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    kw: dict = {}
    if "padding" in mode:
        kw["src_key_padding_mask"] = pad
    if mode == "float-mask":
        kw["mask"] = torch.randn(T, T, generator=gen, dtype=torch.float64).to(dtype)
    if mode == "bool-mask+padding":  # True: may not attend; some later tokens, never token 0 (never padded)
        kw["mask"] = (torch.rand(T, T, generator=gen) < 0.5) & torch.ones(T, T, dtype=torch.bool).triu(1)
    if mode.startswith("causal"):
        kw["mask"], kw["is_causal"] = causal, True
        if "padding" in mode:  # of the float mask's type (mixed types are torch's deprecation)
            kw["src_key_padding_mask"] = torch.zeros(B, T, dtype=dtype).masked_fill(pad, float("-inf"))
    return kw


def source(batch_first: bool, dtype=torch.float64, requires_grad=False):
    src = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    if not batch_first:
        src = src.transpose(0, 1).contiguous()  # (T, B, D)
    return src.requires_grad_(requires_grad)


def run(encoder, src, kwargs, train: bool, seed: int = 11, grad: bool = True):
    encoder.train(train)
    torch.manual_seed(seed)  # the same dropout masks for both encoders
    with torch.set_grad_enabled(grad):
        return encoder(src, **kwargs)


# ------------------------------------------------------------------------------------------------
# residual="standard" is nn.TransformerEncoder
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["train", "eval", "eval-nograd"])
@pytest.mark.parametrize("mode", MASK_MODES)
@pytest.mark.parametrize("norm_first", [True, False], ids=["normfirst", "postnorm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batchfirst", "seqfirst"])
def test_standard_is_nn_transformer_encoder_to_the_bit(batch_first, norm_first, mode, state):
    """float64, dropout 0.1 in training: the same output and the same gradients, bit for bit;
    without grad in eval mode torch may take its fused or nested-tensor path, and so do we."""
    ours, ref = build_pair(batch_first, norm_first)
    assert ours.residual == "standard" and ours.attn_residual is None
    kwargs = mask_kwargs(mode)
    train, grad = state == "train", state != "eval-nograd"
    src = source(batch_first, requires_grad=grad)
    out, ref_out = run(ours, src, kwargs, train, grad=grad), run(ref, src, kwargs, train, grad=grad)
    assert out.shape == src.shape
    if not grad:
        # torch's fused CPU layer reads a float mask's nonzero entries as "masked" (torch 2.13): with
        # the random float mask every row is masked and comes out NaN, in both encoders alike
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0, equal_nan=True)
        return
    assert torch.equal(out, ref_out)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [src, *ours.parameters()], cot)
    ref_grads = torch.autograd.grad(ref_out, [src, *ref.parameters()], cot)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)
    if train and mode == "none":  # dropout is on: another seed gives another output
        assert not torch.equal(run(ours, src, kwargs, train, seed=12), out)


@pytest.mark.parametrize("mode", ["none", "padding", "causal+is_causal"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["normfirst", "postnorm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batchfirst", "seqfirst"])
def test_standard_float32_within_tolerance(batch_first, norm_first, mode, rel_err):
    ours, ref = build_pair(batch_first, norm_first, dtype=torch.float32)
    kwargs = mask_kwargs(mode, dtype=torch.float32)
    src = source(batch_first, dtype=torch.float32)
    assert rel_err(run(ours, src, kwargs, True), run(ref, src, kwargs, True)) < 1e-6
    assert rel_err(run(ours, src, kwargs, False), run(ref, src, kwargs, False)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_standard_takes_torchs_fast_path_where_torch_does(dtype):
    """Eval, no grad, batch_first, post-norm, a padding mask: nn.TransformerEncoder runs nested
    tensors and fills padded positions with exact zeros (no final norm here, so they stay so);
    ours defers to it and returns the same tensor, zeros included."""
    ours, ref = build_pair(True, False, final_norm=False, dtype=dtype)
    kwargs = mask_kwargs("padding")
    src = source(True, dtype=dtype)
    out, ref_out = run(ours, src, kwargs, False, grad=False), run(ref, src, kwargs, False, grad=False)
    assert torch.equal(out, ref_out)
    assert torch.equal(out[0, -2:], torch.zeros(2, D, dtype=dtype)), "torch's nested-tensor path was taken"
    slow = run(ours, src, kwargs, False)  # with grad: the ordinary path, which computes padded rows
    assert not torch.equal(slow[0, -2:], torch.zeros(2, D, dtype=dtype))
    assert torch.allclose(slow[:, :-2], out[:, :-2], rtol=1e-5, atol=1e-5)


def test_standard_has_nn_transformer_encoders_state_and_signature():
    ours, ref = build_pair(True, True)
    assert isinstance(ours, nn.TransformerEncoder)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    # the RFC's two keywords come after nn.TransformerEncoder's own, so positional calls mean the same
    layer = make_layer(True, False)
    enc = attnres.TransformerEncoder(layer, 2, None, False, False)
    assert (enc.num_layers, enc.norm, enc.enable_nested_tensor, enc.mask_check) == (2, None, False, False)


# ------------------------------------------------------------------------------------------------
# residual="block_attention" / "full_attention" is the drop-in module on the encoder
# ------------------------------------------------------------------------------------------------


def randomize_queries(module, seed=5):
    """Nonzero queries and gains other than 1: weights far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.pseudo_query.copy_(0.5 * torch.randn(module.pseudo_query.shape, generator=gen, dtype=torch.float64))
        gain = module.key_norm_weight
        gain.copy_(1 + 0.5 * torch.randn(gain.shape, generator=gen, dtype=torch.float64))
    return module


# (residual, TransformerEncoder keywords, the module it must equal for L sublayers)
ATTNRES = [
    pytest.param(
        "block_attention", {"attn_residual_num_blocks": 2}, lambda n: BlockAttentionResidual(D, n, 2), id="block-N2"
    ),
    pytest.param(
        "block_attention", {"attn_residual_num_blocks": 4}, lambda n: BlockAttentionResidual(D, n, 4), id="block-N4"
    ),
    pytest.param(
        "block_attention",
        {"block_sizes": [3, 1]},
        lambda n: BlockAttentionResidual(D, n, block_sizes=[3, 1]),
        id="block-sizes3_1",
    ),
    pytest.param("full_attention", {}, lambda n: FullAttentionResidual(D, n), id="full"),
]


@pytest.mark.parametrize("residual,options,module", ATTNRES)
@pytest.mark.parametrize("mode", MASK_MODES)
@pytest.mark.parametrize("norm_first", [True, False], ids=["normfirst", "postnorm"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batchfirst", "seqfirst"])
def test_attnres_is_the_residual_module_on_the_encoder(batch_first, norm_first, mode, residual, options, module):
    ours, ref = build_pair(batch_first, norm_first, **{"residual": residual, **options})
    randomize_queries(ours.attn_residual)
    strategy = module(4).double()
    strategy.load_state_dict(ours.attn_residual.state_dict())
    kwargs = mask_kwargs(mode)
    src = source(batch_first, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. no mask-type mismatch warning from torch
        out = run(ours, src, kwargs, True)
    torch.manual_seed(11)
    ref_out = strategy(ref, src, **kwargs)
    assert out.shape == src.shape
    assert torch.equal(out, ref_out)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [src, *ours.parameters()], cot)
    ref_grads = torch.autograd.grad(ref_out, [src, *ref.parameters(), *strategy.parameters()], cot)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)
    if mode == "none":  # not the standard residual
        assert not torch.allclose(out, run(ref, src, kwargs, True))


def test_is_causal_reaches_the_layers():
    """Without a mask, is_causal=True means the causal mask: torch refuses it in training (it
    needs the mask itself), the AttnRes encoders build it."""
    src = source(True)
    standard, ref = build_pair(True, True)
    for encoder in (standard, ref):
        with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
            run(encoder, src, {"is_causal": True}, True)
    ours, _ = build_pair(True, True, residual="full_attention")
    randomize_queries(ours.attn_residual)
    causal = mask_kwargs("causal+is_causal")["mask"]
    out = run(ours, src, {"is_causal": True}, False)
    assert torch.equal(out, run(ours, src, {"mask": causal}, False))
    assert not torch.allclose(out, run(ours, src, {}, False))


@pytest.mark.parametrize("residual,options,module", ATTNRES)
def test_attnres_owns_its_parameters_and_round_trips_its_state(residual, options, module):
    ours, _ = build_pair(True, True, residual=residual, **options)
    names = [n for n, _ in ours.named_parameters()]
    assert {"attn_residual.pseudo_query", "attn_residual.key_norm_weight"} <= set(names)
    assert ours.attn_residual.pseudo_query.shape == (5, D)  # 2 * num_layers + 1
    assert torch.equal(ours.attn_residual.pseudo_query, torch.zeros(5, D, dtype=torch.float64)), "zero at init"
    randomize_queries(ours.attn_residual)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    fresh, _ = build_pair(True, True, residual=residual, **options)
    assert not torch.equal(fresh.attn_residual.pseudo_query, ours.attn_residual.pseudo_query)
    fresh.load_state_dict(torch.load(buffer))  # strict
    src = source(True)
    assert torch.equal(run(fresh, src, {}, False), run(ours, src, {}, False))
    with pytest.raises(RuntimeError, match="attn_residual.pseudo_query"):  # a standard encoder has no such key
        build_pair(True, True)[0].load_state_dict(ours.state_dict())


@pytest.mark.parametrize("residual", ["block_attention", "full_attention"])
def test_to_moves_the_queries(residual):
    torch.manual_seed(0)
    layer = make_layer(True, True, dropout=0.0, dtype=torch.float32)
    enc = attnres.TransformerEncoder(layer, 2, enable_nested_tensor=False, residual=residual,
                                     attn_residual_num_blocks=2)
    assert enc.attn_residual.pseudo_query.dtype == torch.float32  # built where the layers are
    enc.to(torch.float64)
    assert enc.attn_residual.pseudo_query.dtype == torch.float64
    assert enc.attn_residual.key_norm_weight.dtype == torch.float64
    assert enc(source(True)).dtype == torch.float64
    assert copy.deepcopy(enc).attn_residual.pseudo_query.dtype == torch.float64


def test_queries_follow_a_float64_layer():
    enc = attnres.TransformerEncoder(make_layer(True, True), 2, enable_nested_tensor=False, residual="full_attention")
    assert enc.attn_residual.pseudo_query.dtype == torch.float64


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        pytest.param(
            {"residual": "block"}, ValueError, r"one of 'standard', 'block_attention', 'full_attention', got 'block'",
            id="unknown-residual",
        ),
        pytest.param(
            {"residual": "block_attention", "attn_residual_num_blocks": 4},
            ValueError,
            r"attn_residual_num_blocks=4: num_blocks=4 must divide the 6 .*block_sizes.*valid values: 1, 2, 3, 6$",
            id="blocks-do-not-divide",
        ),
        pytest.param({"residual": "block_attention"}, ValueError, r"num_blocks=8 must divide the 6", id="default-N8"),
        pytest.param(
            {"residual": "block_attention", "block_sizes": [4, 1]}, ValueError, r"summing to the 6", id="bad-sizes"
        ),
        pytest.param(
            {"residual": "block_attention", "attn_residual_num_blocks": 3, "block_sizes": [4, 2]},
            ValueError,
            r"num_blocks=3 disagrees with block_sizes=\[4, 2\]",
            id="inconsistent",
        ),
        pytest.param({"block_sizes": [4, 2]}, ValueError, r"block_sizes applies to residual='block_attention'",
                     id="sizes-with-standard"),
        pytest.param({"residual": "full_attention", "block_sizes": [6]}, ValueError, r"block_sizes applies",
                     id="sizes-with-full"),
    ],
)
def test_bad_configuration_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        attnres.TransformerEncoder(make_layer(True, True), 3, enable_nested_tensor=False, **kwargs)


def test_block_sizes_over_an_odd_count_of_blocks_work():
    enc = attnres.TransformerEncoder(make_layer(True, True), 3, enable_nested_tensor=False,
                                     residual="block_attention", block_sizes=[4, 2])
    assert enc.attn_residual.block_sizes == (4, 2) and enc.attn_residual.num_blocks == 2
    assert enc(source(True)).shape == (B, T, D)


def test_attnres_needs_transformer_encoder_layers():
    class Layer(nn.Module):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: enable_nested_tensor and a layer of another class
        assert len(attnres.TransformerEncoder(Layer(), 2).layers) == 2  # standard: whatever torch takes
    with pytest.raises(TypeError, match="torch.nn.TransformerEncoderLayer, got Layer"):
        attnres.TransformerEncoder(Layer(), 2, residual="full_attention")
