"""The controls of the depth study (issue 51; docs/strategies.md#controls): Block AttnRes's sources
mixed uniformly (residual=block_uniform), the standard residual with CompleteP's depth-scaled
branches (residual=depth_scaled) and Block AttnRes's learned static mix (residual=block_static).
Each is held against a float64 re-expression of its definition written here from the formulas
(never calling the strategy's own code), on every kernel it runs on."""

from __future__ import annotations

import os

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from attnres import StandardResidual, Transformer
from attnres.ops import cpu_fused
from attnres.ops.dispatch import triton_available
from attnres.residual.depth_scaled import DepthScaledResidual
from attnres.residual.uniform import UniformBlockResidual
from tests.helpers import CONF

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TRITON = triton_available() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
KERNELS = [
    pytest.param("naive", torch.float64, id="naive"),
    pytest.param("torch", torch.float64, id="torch_fused"),
    pytest.param("cpu", torch.float32, id="cpu",
                 marks=pytest.mark.skipif(not cpu_fused.available(), reason="the C++ kernel does not build here")),
    pytest.param("triton", torch.float32, id="triton", marks=pytest.mark.skipif(not TRITON, reason="needs triton")),
]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


class Tanh(nn.Module):
    """A sublayer f(h) = tanh(h W): nonlinear, so a wrong input shows in its output."""

    def __init__(self, D: int, seed: int) -> None:  # noqa: N803
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(seed)) / D**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.weight.to(h.dtype))


def sublayers(L: int, D: int) -> nn.ModuleList:  # noqa: N803
    return nn.ModuleList(Tanh(D, seed=l) for l in range(L))  # noqa: E741


def reference_uniform(e: torch.Tensor, fs: nn.ModuleList, sizes: list[int]) -> torch.Tensor:
    """DESIGN.md's Block AttnRes sources with every weight 1 / S: b_0 = e; the first sublayer of
    block n reads the mean of b_0 .. b_{n-1}, its i-th (i >= 2) that of b_0 .. b_{n-1}, b_n^{i-1};
    the output is the mean of all N + 1 blocks. float64."""
    W = [f.weight.double() for f in fs]
    blocks, index = [e.double()], 0
    for size in sizes:
        partial = None
        for _ in range(size):
            sources = blocks if partial is None else [*blocks, partial]
            h = sum(sources) / len(sources)
            out = torch.tanh(h @ W[index])
            partial = out if partial is None else partial + out
            index += 1
        blocks.append(partial)
    return sum(blocks) / len(blocks)


def reference_scaled(e: torch.Tensor, fs: nn.ModuleList, base_depth: int, alpha: float) -> torch.Tensor:
    """h_{l+1} = h_l + m tanh(h_l W_l), m = (base_depth / (L / 2)) ** alpha; float64."""
    m = (base_depth / (len(fs) / 2)) ** alpha
    h = e.double()
    for f in fs:
        h = h + m * torch.tanh(h @ f.weight.double())
    return h


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


UNIFORM_CASES = [pytest.param(6, 3, None, id="L6-N3"), pytest.param(8, 8, None, id="L8-N8-full"),
                 pytest.param(6, None, [3, 1, 2], id="L6-sizes-3-1-2")]


@pytest.mark.parametrize(("L", "N", "sizes"), UNIFORM_CASES)
@pytest.mark.parametrize(("kernel", "dtype"), KERNELS)
def test_the_uniform_mix_is_the_mean_of_block_sources_forward_and_backward(kernel, dtype, L, N, sizes):  # noqa: N803
    D = 8
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    residual = UniformBlockResidual(D, L, **({"num_blocks": N} if N else {"block_sizes": sizes}), kernel=kernel)
    assert list(residual.parameters()) == []  # nothing learned in the mix
    fs = sublayers(L, D)
    e = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    e_run = e.to(device, dtype).clone().requires_grad_()
    fs_run = sublayers(L, D).to(device)
    out = residual(e_run, fs_run)
    e_ref = e.detach().clone().requires_grad_()
    want = reference_uniform(e_ref, fs, list(residual.block_sizes))
    assert out.dtype == dtype and rel(out.cpu(), want) < TOLERANCE[dtype]
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out * probe.to(device, dtype)).sum().backward()
    (want * probe).sum().backward()
    assert rel(e_run.grad.cpu(), e_ref.grad) < 10 * TOLERANCE[dtype]
    for mine, ref in zip(fs_run, fs, strict=True):  # every sublayer's weight gradient: it trains
        assert rel(mine.weight.grad.cpu(), ref.weight.grad) < 10 * TOLERANCE[dtype]


def test_the_uniform_mix_records_uniform_weights():
    residual = UniformBlockResidual(8, 6, num_blocks=3, kernel="naive")
    residual.record_next()
    residual(torch.randn(1, 3, 8), sublayers(6, 8))
    for index, weights in residual.recorded.weights.items():
        S = weights.shape[0]
        assert torch.allclose(weights, torch.full_like(weights, 1 / S)), index


def _tiny(residual, **overrides) -> Transformer:
    torch.manual_seed(0)
    shape = dict(vocab_size=32, n_layer=3, n_head=2, n_embd=16, block_size=16, norm_eps=1e-14)
    return Transformer(**{**shape, **overrides}, residual=residual).double()


def _losses(model: Transformer, steps: int = 4) -> list[float]:
    idx = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        logits = model(idx[:, :-1])["logits"]
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_uniform_mix_trains_as_the_standard_residual_up_to_the_norms_eps():
    """Every reader of the mix is an RMSNorm and a mean is the standard h_l over S_l, so with a
    negligible eps the two models are one function of the same weights, step after step."""
    standard = _losses(_tiny(StandardResidual))
    uniform = _losses(_tiny(lambda **kw: UniformBlockResidual(**kw, num_blocks=3, kernel="naive")))
    assert standard[0] != standard[-1]  # it trained
    assert max(abs(a - b) for a, b in zip(standard, uniform, strict=True)) < 1e-9


@pytest.mark.parametrize(("L", "base", "alpha"), [(8, 4, 1.0), (24, 4, 1.0), (48, 4, 0.5), (6, 2, 0.0)])
def test_depth_scaled_branches_are_completeps_multiplier(L, base, alpha):  # noqa: N803
    D = 8
    fs = sublayers(L, D)
    e = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    e_run, e_ref = e.clone().requires_grad_(), e.clone().requires_grad_()
    fs_run = sublayers(L, D)
    out = DepthScaledResidual(D, L, base_depth=base, depth_alpha=alpha)(e_run, fs_run)
    want = reference_scaled(e_ref, fs, base, alpha)
    assert rel(out, want) < 1e-12
    out.sum().backward()
    want.sum().backward()
    assert rel(e_run.grad, e_ref.grad) < 1e-12
    assert all(rel(a.weight.grad, b.weight.grad) < 1e-12 for a, b in zip(fs_run, fs, strict=True))


def test_depth_scaled_at_its_base_depth_is_the_standard_residual_to_the_bit():
    assert _losses(_tiny(StandardResidual, n_layer=2, norm_eps=1e-6)) == \
        _losses(_tiny(lambda **kw: DepthScaledResidual(**kw, base_depth=2), n_layer=2, norm_eps=1e-6))
    assert _losses(_tiny(StandardResidual, n_layer=4)) != \
        _losses(_tiny(lambda **kw: DepthScaledResidual(**kw, base_depth=2), n_layer=4))


@pytest.mark.parametrize(("options", "words"), [({"base_depth": 0}, "base_depth=0 must be a positive int"),
                                                ({"base_depth": 2.5}, "base_depth=2.5"),
                                                ({"depth_alpha": 1.5}, "depth_alpha=1.5 must be a number from 0 to 1")])
def test_depth_scaled_refuses_a_bad_option_in_one_line(options, words):
    with pytest.raises(ValueError, match=words) as err:
        DepthScaledResidual(8, 4, **options)
    assert "\n" not in str(err.value)


def _from_yaml(name: str, L: int, D: int) -> nn.Module:  # noqa: N803
    """The strategy as `attnres-run residual=<name> num_blocks=2` composes it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"residual={name}", "num_blocks=2"])
    return hydra.utils.instantiate(cfg.residual)(d_model=D, num_layers=L)


def test_the_static_mix_yaml_is_block_with_learned_input_free_weights_float64():
    """residual=block_static: h_l = sum_i softmax(z_l)_i v_i over Block AttnRes's sources."""
    spec = OmegaConf.load(CONF / "residual" / "block_static.yaml")
    assert spec._target_ == "attnres.BlockAttentionResidual" and spec.mixing == "static"
    L, D = 6, 8
    residual = _from_yaml("block_static", L, D).double()
    z = torch.randn(residual.mixing_logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        residual.mixing_logits.copy_(z)
    fs = sublayers(L, D).double()
    e = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out = residual(e, fs)
    blocks, index = [e], 0
    for _ in range(2):
        partial = None
        for _ in range(3):
            sources = blocks if partial is None else [*blocks, partial]
            w = torch.softmax(z[index, : len(sources)], dim=0)
            out_l = torch.tanh(sum(a * v for a, v in zip(w, sources, strict=True)) @ fs[index].weight)
            partial = out_l if partial is None else partial + out_l
            index += 1
        blocks.append(partial)
    w = torch.softmax(z[L, : len(blocks)], dim=0)
    assert rel(out, sum(a * v for a, v in zip(w, blocks, strict=True))) < 1e-12


@pytest.mark.parametrize("name", ["block_uniform", "depth_scaled", "block_static"])
def test_each_control_yaml_builds_and_trains_under_mup(name):
    def build(**kw):
        return _from_yaml(name, kw["num_layers"], kw["d_model"])

    model = Transformer(vocab_size=32, n_layer=2, n_head=2, n_embd=32, block_size=16, parametrization="mup",
                        base_width=16, base_depth=1, residual=build)
    idx = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = nn.functional.cross_entropy(model(idx[:, :-1])["logits"].reshape(-1, 32), idx[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert set(model.lr_scales()) <= {id(p) for p in model.parameters()}


@pytest.mark.parametrize("name", ["block_uniform", "depth_scaled", "block_static"])
def test_each_control_is_the_same_function_after_a_hugging_face_export(name):
    """The residual spec a run's config holds (its composed YAML) rebuilds the strategy in
    attnres.hf, and the exported model computes the trained one's logits."""
    pytest.importorskip("transformers")
    from attnres.hf import AttnResConfig, AttnResForCausalLM

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        spec = OmegaConf.to_container(compose("config", overrides=[f"residual={name}", "num_blocks=2"]).residual,
                                      resolve=True)
    shape = dict(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=16)
    torch.manual_seed(0)
    model = Transformer(**shape, residual=hydra.utils.instantiate(spec)).eval()
    with torch.no_grad():  # a static mix away from uniform, so that a dropped table would show
        for p in model.residual.parameters():
            p.normal_()
    hf = AttnResForCausalLM(AttnResConfig(transformer=shape, residual=spec)).eval()
    hf.transformer.load_state_dict(model.state_dict())
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(hf(idx).logits, model(idx)["logits"])
