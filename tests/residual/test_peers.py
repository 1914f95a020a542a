"""Peer residual strategies (DenseFormer, Hyper-Connections, mHC) against float64 references
written here as plain loops, their initial state (the standard residual), mHC's Sinkhorn
projection, gradcheck, the recorded heatmap rows, bad options, and a short CLI sweep."""

# Names follow the papers and DESIGN.md (L sublayers, D width, H streams, A_m / A_r / B).
# ruff: noqa: N802, N803, N806, E741

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

import attnres
from attnres import (
    DenseFormerResidual,
    HyperConnectionResidual,
    ManifoldHyperConnectionResidual,
    StandardResidual,
)
from attnres.residual.mhc import sinkhorn_knopp
from tests.helpers import REPO, mlp_sublayers, run_cli, tiny

pytestmark = pytest.mark.usefixtures("torch_single_thread")

D, B, T = 8, 2, 3


def make_sublayers(L: int, d: int = D, seed: int = 0) -> nn.ModuleList:
    """Float64 capturing sublayers, not scale-invariant (a wrongly scaled input shows in the output)."""
    return mlp_sublayers(L, d, seed)


# ------------------------------------------------------------------------------------------------
# sublayers and strategies
# ------------------------------------------------------------------------------------------------


def embedding(seed: int = 3, d: int = D) -> torch.Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def randomize(strategy: nn.Module, seed: int = 1) -> nn.Module:
    """Every parameter moved far from its initial value (O(1) mixing weights), in float64."""
    gen = torch.Generator().manual_seed(seed)
    strategy.double()
    with torch.no_grad():
        for name, p in strategy.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name in ("dynamic_alpha", "dynamic_beta", "phi"):  # projections of normalised inputs
                p.copy_(noise / math.sqrt(p.shape[1]))
            elif name == "bias_res":  # far from the near-identity start, so Sinkhorn has work to do
                p.copy_(noise)
            else:
                p.add_(0.5 * noise)
    return strategy


STRATEGIES = {  # id -> (class, options, L)
    "denseformer": (DenseFormerResidual, {}, 6),
    "denseformer-k2": (DenseFormerResidual, {"dilation": 2}, 8),
    "denseformer-p2": (DenseFormerResidual, {"period": 2}, 6),
    "denseformer-k2p3": (DenseFormerResidual, {"dilation": 2, "period": 3}, 12),
    "hc": (HyperConnectionResidual, {}, 5),
    "hc-static": (HyperConnectionResidual, {"dynamic": False}, 4),
    "hc-n1": (HyperConnectionResidual, {"expansion_rate": 1}, 3),
    "hc-n3": (HyperConnectionResidual, {"expansion_rate": 3}, 4),
    "mhc": (ManifoldHyperConnectionResidual, {}, 5),
    "mhc-n2-sk5": (ManifoldHyperConnectionResidual, {"expansion_rate": 2, "sinkhorn_iterations": 5}, 4),
}


def build(key: str) -> tuple[nn.Module, int]:
    """The strategy in its initial state, in float64 (initialised again in float64, so that
    mHC's logit(1 / n) is exact to float64 rather than float32 rounding)."""
    cls, options, L = STRATEGIES[key]
    strategy = cls(D, L, **options).double()
    strategy.reset_parameters()
    return strategy, L


# ------------------------------------------------------------------------------------------------
# references: the papers' equations as plain loops over blocks and streams
# ------------------------------------------------------------------------------------------------


def reference_denseformer(e, sublayers, strategy):
    """DenseFormer (arXiv 2402.02622): blocks i = 1..d of two sublayers with the standard
    residual inside; Y_i = sum_{j <= i, j = i mod k} alpha_ij X_j if p | i else X_i."""
    k, p, d = strategy.dilation, strategy.period, len(sublayers) // 2
    weights = iter(strategy.dwa_weight)
    X, Y = [e], e
    for i in range(1, d + 1):
        a = Y + sublayers[2 * i - 2](Y)
        X.append(a + sublayers[2 * i - 1](a))
        if i % p == 0:
            alpha = next(weights)
            js = [j for j in range(i + 1) if (i - j) % k == 0]
            assert len(js) == len(alpha)
            Y = sum(alpha[m] * X[j] for m, j in enumerate(js))
        else:
            Y = X[i]
    return Y


def reference_hc(e, sublayers, strategy):
    """Hyper-Connections (arXiv 2409.19606): h_in = A_m^T H, H' = B^T f(h_in) + A_r^T H with
    A_m, A_r, B = s * tanh(norm(H) W) + static; streams start as copies of e; output their sum."""
    n = strategy.expansion_rate
    H = [e.clone() for _ in range(n)]  # stream j: (B, T, D)
    for l, f in enumerate(sublayers):
        A = strategy.static_alpha[l]  # (n, n + 1)
        am = [A[j, 0] for j in range(n)]
        ar = [[A[j, 1 + i] for i in range(n)] for j in range(n)]
        b = [strategy.static_beta[l, j] for j in range(n)]
        if strategy.dynamic:
            sa, sb = strategy.dynamic_alpha_scale[l], strategy.dynamic_beta_scale[l]
            Wa, Wb = strategy.dynamic_alpha[l], strategy.dynamic_beta[l]  # (D, n + 1), (D,)
            for j in range(n):
                mu = H[j].mean(-1, keepdim=True)
                Hbar = (H[j] - mu) / torch.sqrt(((H[j] - mu) ** 2).mean(-1, keepdim=True) + strategy.eps)
                am[j] = am[j] + sa * torch.tanh(Hbar @ Wa[:, 0])
                ar[j] = [ar[j][i] + sa * torch.tanh(Hbar @ Wa[:, 1 + i]) for i in range(n)]
                b[j] = b[j] + sb * torch.tanh(Hbar @ Wb)
        x = sum(_col(am[j]) * H[j] for j in range(n))
        out = f(x)
        H = [_col(b[i]) * out + sum(_col(ar[j][i]) * H[j] for j in range(n)) for i in range(n)]
    return sum(H)


def _col(c):
    """A per-token (B, T) coefficient as (B, T, 1); a scalar stays a scalar."""
    return c.unsqueeze(-1) if c.dim() == 2 else c


def reference_sinkhorn(logits, iterations):
    M = torch.exp(logits)
    for _ in range(iterations):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    return M


def reference_mhc(e, sublayers, strategy):
    """mHC (arXiv 2512.24880): x' = RMSNorm(vec(x)); H_pre = sigmoid(a x' phi_pre + b),
    H_post = 2 sigmoid(...), H_res = SinkhornKnopp(...); x_{l+1} = H_res x + H_post^T f(H_pre x)."""
    n = strategy.expansion_rate
    H = [e.clone() for _ in range(n)]
    for l, f in enumerate(sublayers):
        flat = torch.cat(H, dim=-1)  # (B, T, n D), stream-major as vec() stacks rows
        z = flat / torch.sqrt((flat**2).mean(-1, keepdim=True) + strategy.eps) @ strategy.phi[l]
        a_pre, a_post, a_res = strategy.gate[l]
        pre = torch.sigmoid(a_pre * z[..., :n] + strategy.bias_pre[l])
        post = 2 * torch.sigmoid(a_post * z[..., n : 2 * n] + strategy.bias_post[l])
        res = reference_sinkhorn(a_res * z[..., 2 * n :].reshape(B, T, n, n) + strategy.bias_res[l],
                                 strategy.sinkhorn_iterations)
        x = sum(pre[..., j, None] * H[j] for j in range(n))
        out = f(x)
        H = [post[..., i, None] * out + sum(res[..., i, j, None] * H[j] for j in range(n)) for i in range(n)]
    return sum(H)


REFERENCES = {DenseFormerResidual: reference_denseformer, HyperConnectionResidual: reference_hc,
              ManifoldHyperConnectionResidual: reference_mhc}


def reference(strategy, e, sublayers):
    return REFERENCES[type(strategy)](e, sublayers, strategy)


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_matches_float64_reference(key):
    strategy, L = build(key)
    randomize(strategy)
    sublayers, e = make_sublayers(L), embedding()
    with torch.no_grad():
        out = strategy(e, sublayers)
        inputs = [s.inputs[-1] for s in sublayers]
        expected = reference(strategy, e, sublayers)
    assert out.dtype == torch.float64 and out.shape == e.shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for l, s in enumerate(sublayers):  # and each sublayer read what the reference fed it
        torch.testing.assert_close(inputs[l], s.inputs[-1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_initial_state_is_the_standard_residual(key):
    """DenseFormer: the standard residual exactly. HC and mHC: every sublayer reads exactly the
    standard h_l, and the output is the sum of n equal streams, n * h_L (the final RMSNorm maps
    it to the standard model's up to its eps)."""
    strategy, L = build(key)
    sublayers, e = make_sublayers(L), embedding()
    with torch.no_grad():
        out = strategy(e, sublayers)
        inputs = [s.inputs[-1] for s in sublayers]
        standard = StandardResidual(D, L)(e, sublayers)
    for l, s in enumerate(sublayers):
        torch.testing.assert_close(inputs[l], s.inputs[-1], rtol=1e-12, atol=1e-12)
    n = getattr(strategy, "expansion_rate", 1)
    torch.testing.assert_close(out, n * standard, rtol=1e-12, atol=1e-12)


def test_initial_parameters_follow_the_papers():
    """HC (section 2.3): A_m = e_{l mod n}, A_r = I, B = 1, W = 0, s = 0.01. mHC: phi = 0, gates
    0.01, sigmoid(b_pre) = 1 / n, 2 sigmoid(b_post) = 1, H_res near I. DenseFormer: alpha_ii = 1."""
    n, L = 3, 5
    hc = HyperConnectionResidual(D, L, expansion_rate=n)
    for l in range(L):
        torch.testing.assert_close(hc.static_alpha[l, :, 0], torch.eye(n)[l % n])
        torch.testing.assert_close(hc.static_alpha[l, :, 1:], torch.eye(n))
    assert bool((hc.static_beta == 1).all()) and not hc.dynamic_alpha.any() and not hc.dynamic_beta.any()
    assert bool((hc.dynamic_alpha_scale == 0.01).all()) and bool((hc.dynamic_beta_scale == 0.01).all())
    mhc = ManifoldHyperConnectionResidual(D, L, expansion_rate=n)
    assert not mhc.phi.any() and bool((mhc.gate == 0.01).all())
    torch.testing.assert_close(torch.sigmoid(mhc.bias_pre), torch.full((L, n), 1 / n))
    torch.testing.assert_close(2 * torch.sigmoid(mhc.bias_post), torch.ones(L, n))
    res = sinkhorn_knopp(mhc.bias_res, 20)
    torch.testing.assert_close(res, torch.eye(n).expand(L, n, n), rtol=0, atol=1e-3)
    df = DenseFormerResidual(D, 8, dilation=2)
    for i, w in zip(df.dwa_blocks, df.dwa_weight, strict=True):
        assert df.dwa_sources(i)[-1] == i and w.tolist() == [0.0] * (len(w) - 1) + [1.0]


def test_initial_logits_agree_in_the_transformer():
    """Same seed, same weights: logits at step 0 agree (DenseFormer exactly; the stream sum of
    HC / mHC differs from standard only through the final RMSNorm's eps)."""
    idx = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for cls in (StandardResidual, DenseFormerResidual, HyperConnectionResidual, ManifoldHyperConnectionResidual):
        torch.manual_seed(0)
        model = attnres.Transformer(40, n_layer=2, n_head=2, n_embd=16, block_size=12, norm_eps=1e-12,
                                    residual=cls).double()
        logits[cls] = model(idx)["logits"]
    for cls, value in logits.items():
        torch.testing.assert_close(value, logits[StandardResidual], rtol=1e-7, atol=1e-7, msg=cls.__name__)


def test_sinkhorn_is_doubly_stochastic():
    gen = torch.Generator().manual_seed(0)
    ones = torch.ones(500, 4)
    logits = torch.randn(500, 4, 4, generator=gen)  # float32, as in training
    M = sinkhorn_knopp(logits, 100)
    assert bool((M >= 0).all())
    torch.testing.assert_close(M.sum(-1), ones, rtol=0, atol=1e-5)  # rows
    torch.testing.assert_close(M.sum(-2), ones, rtol=0, atol=1e-5)  # columns
    torch.testing.assert_close(M, reference_sinkhorn(logits.double(), 100).float(), rtol=1e-5, atol=1e-6)
    # the paper's t_max = 20: columns are normalised last, so exact; rows converge with the
    # logits' spread (here N(0, 0.5^2): to 1e-5; N(0, 1) can leave ~1e-4, see sinkhorn_knopp)
    M = sinkhorn_knopp(0.5 * logits, 20)
    torch.testing.assert_close(M.sum(-2), ones, rtol=0, atol=1e-6)
    torch.testing.assert_close(M.sum(-1), ones, rtol=0, atol=1e-5)


def test_mhc_mixing_is_doubly_stochastic_and_non_negative():
    L = 5
    strategy = randomize(ManifoldHyperConnectionResidual(D, L, sinkhorn_iterations=200))
    H = torch.randn(B, T, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ones = torch.ones(B, T, 4, dtype=torch.float64)
    for l in range(L):
        with torch.no_grad():
            pre, post, res = strategy.mixing(l, H)
        assert bool((pre >= 0).all()) and bool((post >= 0).all()) and bool((post <= 2).all())
        assert bool((res >= 0).all()) and float((res - torch.eye(4, dtype=res.dtype)).abs().max()) > 0.1  # mixes
        torch.testing.assert_close(res.sum(-1), ones, rtol=0, atol=1e-5)
        torch.testing.assert_close(res.sum(-2), ones, rtol=0, atol=1e-5)
    init, _ = build("mhc")  # at step 0: near the identity, exactly doubly stochastic, H_post = 1
    _, post, res = init.mixing(0, H)
    torch.testing.assert_close(post, torch.ones_like(post), rtol=0, atol=1e-12)
    torch.testing.assert_close(res.sum(-1), ones, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.sum(-2), ones, rtol=0, atol=1e-12)
    torch.testing.assert_close(res, torch.eye(4, dtype=torch.float64).expand_as(res), rtol=0, atol=2e-3)


@pytest.mark.parametrize("key", ["denseformer-k2p3", "hc", "hc-static", "mhc-n2-sk5"])
def test_gradcheck(key):
    cls, options, L = STRATEGIES[key]
    strategy = randomize(cls(3, L, **options))
    sublayers = make_sublayers(L, d=3)
    names = [n for n, _ in strategy.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in strategy.parameters()]
    e = torch.randn(1, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def fn(e, *ps):
        return functional_call(strategy, dict(zip(names, ps, strict=True)), (e, sublayers))

    assert torch.autograd.gradcheck(fn, (e, *params), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# recording: each source's share of each sublayer's input
# ------------------------------------------------------------------------------------------------


def recorded_rows(strategy, L, e, sublayers):
    strategy.record_next()
    with torch.no_grad():
        out = strategy(e, sublayers)
    record = strategy.recorded
    assert sorted(record.weights) == list(range(L + 1))
    return record.weights, out


def solved_rows(e, sublayers, out, L):
    """|c| / sum |c| where x = sum_s c_s v_s over the sources v (embedding, then each output),
    solved per token by least squares (the sources are independent: L + 1 <= D)."""
    assert L + 1 <= D
    sources = [e, *(s.outputs[-1] for s in sublayers)]  # (B, T, D) each
    targets = [*(s.inputs[-1] for s in sublayers), out]
    rows = []
    for l, x in enumerate(targets):
        V = torch.stack(sources[: l + 1], dim=-1)  # (B, T, D, S)
        c = torch.linalg.lstsq(V, x.unsqueeze(-1)).solution.squeeze(-1)  # (B, T, S)
        torch.testing.assert_close(torch.einsum("btds,bts->btd", V, c), x, rtol=1e-9, atol=1e-9)  # in the span
        rows.append((c.abs() / c.abs().sum(-1, keepdim=True)).movedim(-1, 0))  # (S, B, T)
    return rows


@pytest.mark.parametrize("key", ["denseformer", "denseformer-k2", "denseformer-p2", "hc", "hc-static", "hc-n1",
                                 "mhc", "mhc-n2-sk5"])
def test_recorded_rows_are_each_sources_share_of_the_input(key):
    cls, options, L = STRATEGIES[key]
    L = min(L, 6)  # the L + 1 sources must stay linearly independent in D = 8
    strategy = randomize(cls(D, L, **options))
    sublayers, e = make_sublayers(L), embedding()
    weights, out = recorded_rows(strategy, L, e, sublayers)
    for l, expected in enumerate(solved_rows(e, sublayers, out, L)):
        w = weights[l]
        assert w.shape == (l + 1, B, T) and bool((w >= 0).all())
        torch.testing.assert_close(w.sum(0).double(), torch.ones(B, T, dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(w.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_recorded_rows_are_uniform_at_init(key):
    """At step 0 each sublayer reads e + sum of the earlier outputs (times n streams' share for
    the output), so every row is 1 / (l + 1) over its l + 1 sources."""
    strategy, L = build(key)
    sublayers, e = make_sublayers(L), embedding()
    weights, _ = recorded_rows(strategy, L, e, sublayers)
    for l in range(L + 1):
        torch.testing.assert_close(weights[l].double(), torch.full((l + 1, B, T), 1 / (l + 1), dtype=torch.float64),
                                   rtol=0, atol=1e-6)
    strategy(e, sublayers)  # the next pass does not record
    assert strategy.recorded is None


@pytest.mark.parametrize("cls", [DenseFormerResidual, HyperConnectionResidual, ManifoldHyperConnectionResidual])
def test_depth_layout_names_the_same_columns_as_full_attnres(cls):
    strategy = cls(D, 4)
    full = attnres.FullAttentionResidual(D, 4)
    title, cols, sources = strategy.depth_layout()
    assert cls.has_depth_attention and title and sources
    assert cols == full.depth_layout()[1] == ["emb", "L0 attn", "L0 mlp", "L1 attn", "L1 mlp"]


@pytest.mark.parametrize("cls", [DenseFormerResidual, HyperConnectionResidual, ManifoldHyperConnectionResidual])
def test_drop_in_on_a_torch_transformer_encoder(cls):
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    strategy = cls(D, 4)
    out = strategy(encoder, torch.randn(B, T, D), is_causal=True)
    assert out.shape == (B, T, D) and bool(torch.isfinite(out).all())


def test_parameter_counts():
    n, L, d = 4, 6, D
    assert sum(p.numel() for p in DenseFormerResidual(d, L).parameters()) == 3 * (3 + 3) // 2  # d (d + 3) / 2
    assert sum(p.numel() for p in DenseFormerResidual(d, 12, dilation=2, period=3).parameters()) == 2 + 4  # DWA_3, _6
    assert sum(p.numel() for p in HyperConnectionResidual(d, L).parameters()) == L * (n * n + 2 * n + d * (n + 2) + 2)
    assert sum(p.numel() for p in HyperConnectionResidual(d, L, dynamic=False).parameters()) == L * (n * n + 2 * n)
    assert sum(p.numel() for p in ManifoldHyperConnectionResidual(d, L).parameters()) == L * (
        n * d * (n * n + 2 * n) + n * n + 2 * n + 3)


# ------------------------------------------------------------------------------------------------
# options and exports
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "options", "L", "fix"), [
    (DenseFormerResidual, {"dilation": 0}, 4, "dilation must be a positive int"),
    (DenseFormerResidual, {"period": -1}, 4, "period must be a positive int"),
    (DenseFormerResidual, {"dilation": 1.5}, 4, "dilation must be a positive int"),
    (DenseFormerResidual, {}, 5, "must be even"),
    (HyperConnectionResidual, {"expansion_rate": 0}, 4, "expansion_rate .* must be an int >= 1"),
    (HyperConnectionResidual, {"expansion_rate": True}, 4, "expansion_rate .* must be an int >= 1"),
    (HyperConnectionResidual, {"dynamic": "no"}, 4, "dynamic must be true or false"),
    (ManifoldHyperConnectionResidual, {"expansion_rate": 1}, 4, "expansion_rate .* must be an int >= 2"),
    (ManifoldHyperConnectionResidual, {"sinkhorn_iterations": -1}, 4, "sinkhorn_iterations must be an int >= 1"),
    (ManifoldHyperConnectionResidual, {"sinkhorn_iterations": 0}, 4, "sinkhorn_iterations must be an int >= 1"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_bad_options_name_the_fix(cls, options, L, fix):
    with pytest.raises(ValueError, match=fix):
        cls(D, L, **options)


def test_exported_and_configured():
    from omegaconf import OmegaConf

    for name in ("DenseFormerResidual", "HyperConnectionResidual", "ManifoldHyperConnectionResidual"):
        assert name in attnres.__all__ and getattr(attnres, name) is getattr(attnres.residual, name)
    for key, cls in (("denseformer", DenseFormerResidual), ("hc", HyperConnectionResidual),
                     ("mhc", ManifoldHyperConnectionResidual)):
        cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "residual" / f"{key}.yaml"))
        assert cfg.pop("_target_") == f"attnres.{cls.__name__}" and cfg.pop("_partial_") is True
        strategy = cls(D, 4, **cfg)  # every key is a constructor argument with its default
        assert all(getattr(strategy, k) == v for k, v in cfg.items())


# ------------------------------------------------------------------------------------------------
# end to end: one CLI sweep over the three strategies
# ------------------------------------------------------------------------------------------------

TINY = tiny("data.block_size=64", "callbacks.depth_dashboard.every_n_steps=2", steps=2, val_every=2,
            progress_bar=False, logger=True)


@pytest.mark.slow
def test_cli_sweep_trains_and_draws_heatmaps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_cli(
        "-m", "hydra/launcher=basic", "residual=denseformer,hc,mhc", *TINY,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"}, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    runs = sorted({p.parent for p in (tmp_path / "sweep").rglob("events.out.tfevents.*")})
    titles = set()
    L = 4
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={"tensors": 0, "images": 0})
        acc.Reload()
        if "depth/heatmap_data" not in acc.Tags()["tensors"]:
            continue
        meta = json.loads(acc.SummaryMetadata("depth/heatmap_data").plugin_data.content)
        titles.add(meta["strategy"])
        assert meta["cols"] == ["emb", "L0 attn", "L0 mlp", "L1 attn", "L1 mlp"] and meta["rows"][-1] == "output"
        events = acc.Tensors("depth/heatmap_data")
        assert [e.step for e in events] == [0, 2] and acc.Images("depth/heatmap")
        for event in events:
            proto = event.tensor_proto
            grid = np.asarray(proto.float_val, dtype=np.float32).reshape([d.size for d in proto.tensor_shape.dim])
            assert grid.shape == (L + 1, L + 1)
            assert [int(np.isfinite(row).sum()) for row in grid] == list(range(1, L + 2))
            assert np.nanmin(grid) >= 0
            np.testing.assert_allclose(np.nansum(grid, axis=1), 1.0, atol=1e-5)
        first = np.asarray(events[0].tensor_proto.float_val, dtype=np.float32).reshape(L + 1, L + 1)
        for l, row in enumerate(first):  # step 0: the standard residual's uniform rows
            np.testing.assert_allclose(row[: l + 1], 1 / (l + 1), atol=1e-5)
    assert titles == {"DenseFormer (1x1)", "Hyper-Connections (n=4)", "mHC (n=4)"}, titles
