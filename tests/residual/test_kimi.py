"""The released Kimi K3's layout, numerics and parameters in attnres terms: `block_size_layers`
gives K3's schedule (sources per site, from the description in tests/kimi_reference.py), the
`kimi` preset its eps and query init, every fast path its numerics site by site, and
the functions at the end of block.py map a K3-format state dict in and out."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import attnres
from attnres.ops import cpu_fused
from attnres.ops.dispatch import triton_available
from attnres.residual.block import (
    kimi_attn_res_state_dict,
    kimi_block_attention_residual,
    kimi_names,
    load_kimi_attn_res,
)
from tests.helpers import CONF, Capture
from tests.kimi_reference import K3_EPS, bf16_bound, k3_mix, k3_replay, k3_sources_per_site, mix_scale

pytestmark = pytest.mark.usefixtures("torch_single_thread")
HAS_CUDA = torch.cuda.is_available()
if triton_available() and not HAS_CUDA:  # as tests/ops/test_kernels.py: before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON = triton_available() and (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")


def k3_residual(n_layer: int, k: int, D: int, **options) -> attnres.BlockAttentionResidual:  # noqa: N803
    return attnres.BlockAttentionResidual(D, 2 * n_layer, block_size_layers=k, eps=K3_EPS, **options)


def randomise(residual: attnres.BlockAttentionResidual, seed: int = 0) -> None:
    """Queries that route away from uniform and gains away from 1, as after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        residual.pseudo_query.copy_(torch.randn(residual.pseudo_query.shape, generator=g) * 3 / residual.d_model**0.5)
        residual.key_norm_weight.copy_(1 + 0.3 * torch.randn(residual.key_norm_weight.shape, generator=g))


def capturing(L: int, D: int, dtype: torch.dtype, seed: int = 0) -> nn.ModuleList:  # noqa: N803
    torch.manual_seed(seed)
    layers = (Capture(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))) for _ in range(L))
    return nn.ModuleList(layers).to(dtype)


# -- the layout ---------------------------------------------------------------------------------------
def test_k3s_own_schedule_is_reachable_in_layers():
    residual = attnres.BlockAttentionResidual(8, 186, block_size_layers=12)
    assert residual.block_sizes == (24,) * 7 + (18,)
    assert residual.block_sizes == attnres.BlockAttentionResidual(8, 186, block_sizes=[24] * 7 + [18]).block_sizes


@pytest.mark.parametrize(("n_layer", "k"), [(3, 2), (4, 2), (5, 3), (2, 5)], ids=["3-layers-k2", "4-layers-k2",
                                                                                  "5-layers-k3", "2-layers-k5"])
def test_layout_gives_k3s_sources_per_site(n_layer, k):
    """The sources each site mixes (a recording pass: one row per site), against the description:
    3 layers at block size 2 give [emb], then [emb, partial] three times, [emb, block 1],
    [emb, block 1, partial], and the output over [emb, block 1, block 2]."""
    D = 8
    residual = k3_residual(n_layer, k, D)
    expected = k3_sources_per_site(n_layer, k)
    if (n_layer, k) == (3, 2):
        assert [len(s) for s in expected] == [1, 2, 2, 2, 2, 3, 3]
    residual.record_next()
    residual(torch.randn(2, 3, D), capturing(2 * n_layer, D, torch.float32))
    recorded = residual.recorded.weights
    assert sorted(recorded) == list(range(2 * n_layer + 1))  # one mix per sublayer, and one before the final norm
    assert [recorded[i].shape[0] for i in range(2 * n_layer + 1)] == [len(s) for s in expected]


def test_layout_excludes_other_block_settings_and_needs_whole_layers():
    with pytest.raises(ValueError, match="drop num_blocks and block_sizes"):
        attnres.BlockAttentionResidual(8, 6, num_blocks=3, block_size_layers=2)
    with pytest.raises(ValueError, match="drop num_blocks and block_sizes"):
        attnres.BlockAttentionResidual(8, 6, block_sizes=[4, 2], block_size_layers=2)
    with pytest.raises(ValueError, match="num_layers must be even"):
        attnres.BlockAttentionResidual(8, 5, block_size_layers=2)
    with pytest.raises(ValueError, match="positive int"):
        attnres.BlockAttentionResidual(8, 6, block_size_layers=0)
    with pytest.raises(ValueError, match="query_init_std"):
        attnres.BlockAttentionResidual(8, 6, query_init_std=-1.0)


def test_queries_start_at_zero_by_default_and_normal_with_the_k3_init():
    default = attnres.BlockAttentionResidual(64, 186, num_blocks=2)
    assert not default.pseudo_query.any()  # the paper's init, unchanged
    torch.manual_seed(0)
    k3 = attnres.BlockAttentionResidual(64, 186, block_size_layers=12, query_init_std=0.02)
    q = k3.pseudo_query.detach().clone()
    assert abs(float(q.std()) - 0.02) < 0.001 and abs(float(q.mean())) < 0.001
    assert bool((k3.key_norm_weight == 1).all())
    k3.reset_parameters()
    assert not torch.equal(k3.pseudo_query.detach(), q) and abs(float(k3.pseudo_query.detach().std()) - 0.02) < 0.001


def test_the_kimi_preset_builds_k3s_layout():
    spec = OmegaConf.to_container(OmegaConf.load(CONF / "residual" / "kimi.yaml"))
    assert spec["_target_"] == "attnres.BlockAttentionResidual"
    options = {k: v for k, v in spec.items() if not k.startswith("_")}
    residual = attnres.BlockAttentionResidual(d_model=16, num_layers=186, **options)
    assert residual.block_sizes == (24,) * 7 + (18,) and residual.eps == 1e-5 and residual.output_aggregation
    assert residual.query_init_std == 0.02 and residual.pseudo_query.abs().sum() > 0
    model = attnres.Transformer(vocab_size=32, n_layer=3, n_embd=16, n_head=2,
                                residual=lambda **kw: attnres.BlockAttentionResidual(**kw, **{**options,
                                                                                             "block_size_layers": 2}))
    assert model.residual.block_sizes == (4, 2)
    assert model(torch.randint(0, 32, (1, 5)))["logits"].shape == (1, 5, 32)


# -- the numerics, site by site -----------------------------------------------------------------------
KERNEL_CASES = [
    pytest.param("naive", torch.bfloat16, id="reference-bf16"),
    pytest.param("naive", torch.float32, id="reference-f32"),
    pytest.param("torch", torch.bfloat16, id="torch-bf16"),
    pytest.param("torch", torch.float32, id="torch-f32"),
    pytest.param("cpu", torch.float32, id="cpu-f32",
                 marks=pytest.mark.skipif(not cpu_fused.available(), reason="the C++ kernel does not build here")),
    *(pytest.param("triton", dt, id=f"triton-{n}", marks=pytest.mark.skipif(not TRITON, reason="needs triton"))
      for dt, n in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))),
]


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("tokens", [(2, 6), (1, 1)], ids=["prefill", "one-token"])
@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_CASES)
def test_every_site_is_the_k3_recipe_of_its_sources(kernel, dtype, tokens, grad):
    """A model-dtype run (fast path unless the reference), then each site's input replayed through
    K3's float64 recipe over the sources K3 would build from the same sublayer outputs. A mix
    computed in one pass (the reference path, the C++ kernel) is that recipe rounded once: half an
    ulp, plus float32's error relative to the terms' magnitude (sum_i alpha_i |v_i|). The torch
    path's merged sites (phase 2: a block's phase-1 result, already rounded to the model dtype,
    merged with the partial sum by an online softmax) are allowed one more bf16 rounding of the
    terms' magnitude: the bf16 rounding tolerance (docs/strategies.md, "The released model").
    Without gradients (inference: decoding, a short prefill) every fast path mixes in one pass."""
    n_layer, k, D = 5, 2, 64
    device = "cuda" if kernel == "triton" and HAS_CUDA else "cpu"  # else Triton's CPU interpreter
    residual = k3_residual(n_layer, k, D, kernel=kernel).to(device, dtype)
    randomise(residual)
    sublayers = capturing(2 * n_layer, D, dtype).to(device)
    embedding = (0.02 * torch.randn(*tokens, D)).to(device, dtype)
    with torch.set_grad_enabled(grad):
        out = residual(embedding, sublayers)
    inputs = [s.inputs[0].cpu() for s in sublayers] + [out.detach().cpu()]
    outputs = [s.outputs[0].cpu() for s in sublayers]
    q, g = residual.pseudo_query.detach().cpu(), residual.key_norm_weight.detach().cpu()
    one_pass = kernel in ("naive", "cpu") or (not grad and kernel != "triton")  # Triton: two-phase always
    # Triton's CPU interpreter rounds to bf16 toward zero (tests/ops/test_k3_numerics.py): one ulp there
    ulps = 1.0 if kernel == "triton" and not HAS_CUDA and dtype == torch.bfloat16 else 0.5

    def check(site, sources):
        want, w = k3_mix(sources, q[site], g[site])
        got = inputs[site]
        assert got.dtype == dtype
        scale = mix_scale(sources, w)
        bound = bf16_bound(want, dtype, scale, ulps=ulps) + (0 if one_pass else ulps * 2**-7 * scale)
        err = (got.double() - want).abs()
        assert bool((err <= bound).all()), (site, float((err / bound).max()))
        return float((err / scale).max())

    worst = k3_replay(embedding.cpu(), outputs, n_layer, k, check)
    assert len(worst) == 2 * n_layer + 1 and max(worst) > 0


# -- the parameters in and out ---------------------------------------------------------------------------
def k3_state_dict(n_layer: int, D: int, prefix: str = "model.", seed: int = 0) -> dict[str, torch.Tensor]:  # noqa: N803
    """A synthetic K3-shaped state dict: the AttnRes tensors (bf16, as K3 stores them, each
    distinct) among other weights of the checkpoint that the mapping must leave alone."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"{prefix}embed_tokens.weight": torch.randn(11, D, generator=g).bfloat16(),
          f"{prefix}norm.weight": torch.ones(D).bfloat16(), "lm_head.weight": torch.randn(11, D).bfloat16()}
    for i in range(n_layer):
        sd[f"{prefix}layers.{i}.input_layernorm.weight"] = torch.ones(D).bfloat16()
        for site in ("self_attention", "mlp"):
            sd[f"{prefix}layers.{i}.{site}_res_proj.weight"] = torch.randn(1, D, generator=g).bfloat16()
            sd[f"{prefix}layers.{i}.{site}_res_norm.weight"] = (1 + torch.rand(D, generator=g)).bfloat16()
    sd[f"{prefix}output_attn_res_proj.weight"] = torch.randn(1, D, generator=g).bfloat16()
    sd[f"{prefix}output_attn_res_norm.weight"] = (1 + torch.rand(D, generator=g)).bfloat16()
    return sd


@pytest.mark.parametrize("prefix", ["model.", "language_model.model."], ids=["text", "language_model"])
def test_a_k3_state_dict_loads_into_the_rows_of_its_sites_and_back(prefix):
    n_layer, D = 3, 16
    sd = k3_state_dict(n_layer, D, prefix)
    residual = k3_residual(n_layer, 2, D)
    used = load_kimi_attn_res(residual, sd)
    assert len(used) == 2 * (2 * n_layer + 1) and set(used) <= set(sd)
    # site 2 i is layer i's mix before attention, 2 i + 1 before its MLP, 2 n_layer the output
    assert torch.equal(residual.pseudo_query[3], sd[f"{prefix}layers.1.mlp_res_proj.weight"][0].float())
    assert torch.equal(residual.key_norm_weight[4], sd[f"{prefix}layers.2.self_attention_res_norm.weight"].float())
    assert torch.equal(residual.pseudo_query[6], sd[f"{prefix}output_attn_res_proj.weight"][0].float())
    back = kimi_attn_res_state_dict(residual, prefix, dtype=torch.bfloat16)
    assert set(back) == set(used)
    for key, value in back.items():
        assert value.dtype == torch.bfloat16 and value.shape == sd[key].shape and torch.equal(value, sd[key]), key
    built = kimi_block_attention_residual(sd, attn_res_block_size=2)
    assert built.block_sizes == (4, 2) and built.eps == 1e-5
    assert torch.equal(built.pseudo_query, residual.pseudo_query)


def test_loaded_k3_parameters_route_as_k3_does():
    """The mapping's meaning, not only its rows: a site's mix with loaded parameters is K3's
    recipe with that site's projection and norm weight."""
    n_layer, D = 3, 16
    sd = k3_state_dict(n_layer, D)
    residual = kimi_block_attention_residual(sd, attn_res_block_size=2).double()
    sources = [torch.randn(2, 4, D, dtype=torch.float64) for _ in range(3)]
    h, w = residual.reference_mix(5, sources)
    want_h, want_w = k3_mix(sources, sd["model.layers.2.mlp_res_proj.weight"], sd["model.layers.2.mlp_res_norm.weight"])
    torch.testing.assert_close(h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=1e-12)


def test_a_state_dict_that_does_not_fit_is_refused():
    sd = k3_state_dict(3, 16)
    with pytest.raises(ValueError, match="3 layers"):
        load_kimi_attn_res(k3_residual(2, 2, 16), sd)
    with pytest.raises(ValueError, match="width 16"):
        load_kimi_attn_res(k3_residual(3, 2, 8), sd)
    broken = dict(sd)
    del broken["model.layers.1.mlp_res_norm.weight"]
    with pytest.raises(KeyError, match="layers.1.mlp_res_norm"):
        load_kimi_attn_res(k3_residual(3, 2, 16), broken)
    with pytest.raises(ValueError, match="one '...model.output_attn_res_proj.weight'"):
        load_kimi_attn_res(k3_residual(3, 2, 16), {})
    with pytest.raises(ValueError, match="key_norm_gain=True"):
        load_kimi_attn_res(k3_residual(3, 2, 16, key_norm_gain=False), sd)
    assert kimi_names(2)[-1] == ("model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight")


def test_a_bad_tensor_is_refused_before_any_row_is_copied():
    """One wrong shape (the last site's) or one NaN leaves every row as it was, and the error names the key."""
    sd = k3_state_dict(3, 16)
    for key, bad in (("model.output_attn_res_norm.weight", torch.ones(15).bfloat16()),
                     ("model.layers.2.mlp_res_proj.weight", torch.full((1, 16), float("nan")).bfloat16())):
        residual = k3_residual(3, 2, 16)
        randomise(residual)
        before = (residual.pseudo_query.clone(), residual.key_norm_weight.clone())
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_kimi_attn_res(residual, {**sd, key: bad})
        assert torch.equal(residual.pseudo_query, before[0]) and torch.equal(residual.key_norm_weight, before[1])


def test_a_prefix_on_some_layers_only_is_named():
    sd = k3_state_dict(3, 16)
    mixed = {("language_model." + k if ".layers.1." in k else k): v for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"prefix 'model\.'.*language_model\.model\.layers\.1\."):
        load_kimi_attn_res(k3_residual(3, 2, 16), mixed)
    # the other way round: the output under language_model., layer 2 not
    other = {("language_model." + k if ".layers.2." not in k else k): v for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"prefix 'language_model\.model\.'.*model\.layers\.2\."):
        load_kimi_attn_res(k3_residual(3, 2, 16), other)
