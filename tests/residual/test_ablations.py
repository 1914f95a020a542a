"""The AttnRes ablation options (issue 13; `attnres/residual/ablations.py`) against float64
references written here with plain loops, their reductions to AttnRes, gradcheck, their
errors, and one short CLI sweep that trains each option and reads its heatmaps back."""

# Arguments and loop variables use DESIGN.md's names (L sublayers, D width, W window, l index).
# ruff: noqa: N803, N806, E741

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.func import functional_call

from attnres import BlockAttentionResidual, FullAttentionResidual
from attnres.functional import depth_attention, generalized_depth_attention, resolve_kernel
from tests.helpers import REPO, run_cli, tiny

pytestmark = pytest.mark.usefixtures("torch_single_thread")

D, EPS = 8, 1e-6
SHAPES = {"full": {"L": 5}, "block": {"L": 6, "num_blocks": 2}}  # Block: 2 blocks of 3, so partial sums


# ------------------------------------------------------------------------------------------------
# references (float64, loops)
# ------------------------------------------------------------------------------------------------


def ref_attend(sources, query, gain, scoring="softmax", heads=1, key_norm=True):
    """One depth attention, head by head and source by source. `query` (D,) or (B, T, D)."""
    Dh = sources[0].shape[-1] // heads
    outs, alphas = [], []
    for k in range(heads):
        c = slice(k * Dh, (k + 1) * Dh)  # this head's channels
        logits = []
        for v in sources:
            key = v[..., c]
            if key_norm:
                key = key / torch.sqrt(key.pow(2).mean(dim=-1, keepdim=True) + EPS)
            if gain is not None:
                key = key * gain[c]
            logits.append((key * query[..., c]).sum(dim=-1))
        logits = torch.stack(logits)  # (S, B, T)
        if scoring == "softmax":
            alpha = torch.softmax(logits, dim=0)
        else:
            s = torch.sigmoid(logits)
            alpha = s / s.sum(dim=0)
        out = torch.zeros_like(sources[0][..., c])
        for a, v in zip(alpha, sources, strict=True):
            out = out + a.unsqueeze(-1) * v[..., c]
        outs.append(out)
        alphas.append(alpha)
    return torch.cat(outs, dim=-1), torch.stack(alphas).mean(dim=0)


def ref_row(index, sources, cols, opts, params):
    """Sublayer `index` over the sources of columns `cols`: (h, weights over all sources)."""
    seen = [sources[i] for i in cols]
    if opts.get("mixing") == "static":
        alpha = torch.softmax(params["mixing_logits"][index][cols], dim=0)
        h = sum(a * v for a, v in zip(alpha, seen, strict=True))
        w = alpha[:, None, None].expand(-1, *seen[0].shape[:-1])
    else:
        if opts.get("query") == "input":
            query = seen[-1] @ params["query_proj"][index]  # the newest source, x W_l
        else:
            query = params["pseudo_query"][index]
        gain = params["key_norm_weight"][index] if "key_norm_weight" in params else None
        h, w = ref_attend(seen, query, gain, opts.get("scoring", "softmax"), opts.get("heads", 1),
                          opts.get("key_norm", True))
    full = torch.zeros(len(sources), *w.shape[1:], dtype=w.dtype)
    full[cols] = w
    return h, full


def reference(kind, opts, e, fs, params):
    """The strategy written out: returns (output, [weights of rows 0 .. L])."""
    L, W = len(fs), opts.get("window")

    def cols(n):  # the columns a row of n sources sees
        return list(range(n)) if W is None or n <= W + 1 else [0, *range(n - W, n)]

    rows = []
    if kind == "full":
        sources = [e]
        for l in range(L):
            h, w = ref_row(l, sources, cols(len(sources)), opts, params)
            rows.append(w)
            sources.append(fs[l](h))
    else:
        S = L // SHAPES["block"]["num_blocks"]
        sources, partial = [e], None
        for l in range(L):
            if l and l % S == 0:
                sources, partial = [*sources, partial], None
            here = sources if partial is None else [*sources, partial]
            h, w = ref_row(l, here, cols(len(here)), opts, params)
            rows.append(w)
            out = fs[l](h)
            partial = out if partial is None else partial + out
        sources = [*sources, partial]
    h, w = ref_row(L, sources, cols(len(sources)), opts, params)
    return h, [*rows, w]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def make_sublayers(L, d=D, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(d, d), nn.Tanh()) if i % 2 else nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))
              for i in range(L)]
    return nn.ModuleList(layers).double()


def build(kind, opts, d=D):
    cls = FullAttentionResidual if kind == "full" else BlockAttentionResidual
    shape = dict(SHAPES[kind])
    return cls(d, shape.pop("L"), **shape, **opts).double()


def randomize(strategy, seed=1):
    """Parameters far from their initial values: O(1) logits, so every option shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in strategy.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            scale = {"pseudo_query": 2 / D**0.5, "query_proj": 0.7 / D, "mixing_logits": 1.0}.get(name, 0.5)
            p.copy_((1.0 if name == "key_norm_weight" else 0.0) + scale * noise)
    return strategy


def inputs(B=2, T=3, d=D, seed=2):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5


def run(strategy, e, fs):
    strategy.record_next()
    out = strategy(e, fs)
    return out, strategy.recorded.weights


def opts_id(kind, opts):
    return kind + "".join(f"-{k}={v}" for k, v in opts.items())


OPTIONS = [
    ("full", {"query": "input"}), ("full", {"mixing": "static"}), ("full", {"scoring": "sigmoid"}),
    ("full", {"key_norm": False}), ("full", {"heads": 2}),
    ("full", {"heads": 4, "query": "input", "scoring": "sigmoid"}),
    ("full", {"window": 1}), ("full", {"window": 2, "mixing": "static"}),
    ("full", {"window": 3, "query": "input", "heads": 2, "key_norm": False}),
    ("block", {"query": "input"}), ("block", {"mixing": "static"}), ("block", {"scoring": "sigmoid"}),
    ("block", {"key_norm": False}), ("block", {"heads": 2}),
    ("block", {"heads": 4, "query": "input", "key_norm_gain": False}),
]
PARAMS = [pytest.param(k, o, id=opts_id(k, o)) for k, o in OPTIONS]
NO_WINDOW = [p for p in PARAMS if "window" not in p.values[1]]


# ------------------------------------------------------------------------------------------------
# each option against its reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,opts", PARAMS)
def test_option_matches_reference(kind, opts, rel_err):
    strategy = randomize(build(kind, opts))
    L, e = strategy.num_layers, inputs()
    fs = make_sublayers(L)
    out, weights = run(strategy, e, fs)
    params = {n: p.detach() for n, p in strategy.named_parameters()}
    expected, expected_weights = reference(kind, opts, e, fs, params)
    assert rel_err(out, expected) < 1e-12
    assert sorted(weights) == list(range(L + 1))
    for l in range(L + 1):
        assert rel_err(weights[l], expected_weights[l]) < 1e-12, f"row {l}"
        torch.testing.assert_close(weights[l].sum(dim=0), torch.ones(e.shape[:-1], dtype=e.dtype))
    # without recording, the same reference path: the same output
    assert rel_err(strategy(e, fs), expected) < 1e-12


# ------------------------------------------------------------------------------------------------
# reductions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,opts", NO_WINDOW)
def test_at_init_every_option_is_uniform_attnres(kind, opts, rel_err):
    """Zero-initialised query maps and logits, like zero pseudo-queries, give the uniform mean of
    the sources: at step 0 each option computes what default AttnRes does."""
    e, strategy, default = inputs(), build(kind, opts), build(kind, {})
    fs = make_sublayers(strategy.num_layers)
    out, weights = run(strategy, e, fs)
    expected, expected_weights = run(default, e, fs)
    assert rel_err(out, expected) < 1e-12
    for l, w in weights.items():
        assert rel_err(w, expected_weights[l]) < 1e-12
        torch.testing.assert_close(w, torch.full_like(w, 1 / w.shape[0]), rtol=0, atol=1e-15)


@pytest.mark.parametrize("extra", [{}, {"query": "input", "heads": 2}, {"mixing": "static"}],
                         ids=["default", "input-query-2-heads", "static-mixing"])
@pytest.mark.parametrize("over", [0, 3])
def test_a_window_of_at_least_l_is_full_attnres(extra, over, rel_err):
    L = SHAPES["full"]["L"]
    windowed = randomize(build("full", {**extra, "window": L + over}))
    full = build("full", extra)
    full.load_state_dict(windowed.state_dict())
    e, fs = inputs(), make_sublayers(L)
    out, weights = run(windowed, e, fs)
    expected, expected_weights = run(full, e, fs)
    assert rel_err(out, expected) < 1e-12
    for l in range(L + 1):
        assert rel_err(weights[l], expected_weights[l]) < 1e-12
    assert rel_err(windowed(e, fs), full(e, fs)) < 1e-12  # the default's own fast path, for extra={}


def test_window_sees_the_embedding_and_the_last_w_sources():
    L, W = SHAPES["full"]["L"], 2
    strategy = randomize(build("full", {"window": W}))
    _, weights = run(strategy, inputs(), make_sublayers(L))
    for l in range(L + 1):
        seen = [0, *range(max(1, l + 1 - W), l + 1)]
        assert (weights[l][seen] > 0).all() and weights[l][[i for i in range(l + 1) if i not in seen]].eq(0).all()


def test_one_head_and_the_defaults_are_plain_depth_attention(rel_err):
    gen = torch.Generator().manual_seed(3)
    sources = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) * 3 for _ in range(4)]
    query = torch.randn(D, generator=gen, dtype=torch.float64)
    gain = 1 + torch.rand(D, generator=gen, dtype=torch.float64)
    expected = depth_attention(sources, query, gain, EPS, kernel="naive")
    for got in (generalized_depth_attention(sources, query, gain, EPS, heads=1),
                generalized_depth_attention(sources, query.expand(2, 3, D), gain, EPS)):  # a per-token copy
        assert rel_err(got[0], expected[0]) < 1e-12 and rel_err(got[1], expected[1]) < 1e-12


def test_sigmoid_weights_are_normalised_even_when_every_score_underflows(rel_err):
    gen = torch.Generator().manual_seed(4)
    sources = [torch.randn(2, 3, D, generator=gen, dtype=torch.float64) for _ in range(3)]
    query = torch.randn(D, generator=gen, dtype=torch.float64)
    h, w = generalized_depth_attention(sources, query, None, EPS, scoring="sigmoid")
    expected = ref_attend(sources, query, None, "sigmoid")
    assert rel_err(h, expected[0]) < 1e-12 and rel_err(w, expected[1]) < 1e-12
    torch.testing.assert_close(w.sum(dim=0), torch.ones(2, 3, dtype=torch.float64))
    # raw logits -1000, -1000.8, -1008: every sigmoid is 0 in float64, yet their ratios are not
    logits = torch.tensor([-1000.0, -1000.8, -1008.0], dtype=torch.float64)
    constant = [torch.full((2, 3, D), x / D, dtype=torch.float64) for x in logits]  # v . 1 = x
    h, w = generalized_depth_attention(constant, torch.ones(D, dtype=torch.float64), None, EPS, scoring="sigmoid",
                                       key_norm=False)
    assert torch.isfinite(h).all()
    # log sigmoid(x) = x - log(1 + e^x) = x to float64 here, so the weights are softmax(x)
    assert rel_err(w, torch.softmax(logits, dim=0)[:, None, None].expand(-1, 2, 3)) < 1e-12


@pytest.mark.parametrize("kind,opts", PARAMS)
def test_options_train_under_autocast_like_the_default(kind, opts):
    """bf16 autocast gives a float32 embedding and bf16 sublayer outputs: the options take them
    as the default's fast path does, returning its dtype, with gradients for every parameter."""
    strategy, default = build(kind, opts).float(), build(kind, {}).float()
    fs, e = make_sublayers(strategy.num_layers).float(), inputs().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = strategy(e, fs), default(e, fs)
        out.float().pow(2).sum().backward()
    assert out.dtype == expected.dtype and torch.isfinite(out).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in strategy.parameters())


# ------------------------------------------------------------------------------------------------
# gradients
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,opts", PARAMS)
def test_gradcheck(kind, opts):
    d = 4
    cls = FullAttentionResidual if kind == "full" else BlockAttentionResidual
    L, shape = (3, {}) if kind == "full" else (4, {"num_blocks": 2})
    strategy = randomize(cls(d, L, **shape, **{k: min(v, 2) if k == "heads" else v for k, v in opts.items()}).double())
    fs = make_sublayers(L, d)
    names = [n for n, _ in strategy.named_parameters()]
    e = inputs(1, 2, d).requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in strategy.parameters()]

    def f(e, *ps):
        return functional_call(strategy, dict(zip(names, ps, strict=True)), (e, fs))

    assert torch.autograd.gradcheck(f, (e, *params))


# ------------------------------------------------------------------------------------------------
# parameters, paths, errors, config
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "block"])
def test_parameters_follow_the_options(kind):
    L = SHAPES[kind]["L"]
    sources = L + 1 if kind == "full" else SHAPES["block"]["num_blocks"] + 1

    def shapes(**opts):
        return {n: tuple(p.shape) for n, p in build(kind, opts).named_parameters()}

    assert shapes() == {"pseudo_query": (L + 1, D), "key_norm_weight": (L + 1, D)}
    assert shapes(query="input") == {"query_proj": (L + 1, D, D), "key_norm_weight": (L + 1, D)}
    assert shapes(mixing="static") == {"mixing_logits": (L + 1, sources)}
    assert shapes(key_norm=False) == {"pseudo_query": (L + 1, D)}
    assert shapes(scoring="sigmoid") == shapes(heads=4) == shapes()
    assert build(kind, {"query": "input"}).query_proj.abs().max() == 0


def test_only_the_default_takes_the_fast_path():
    e = inputs().float()
    for kind, opts in OPTIONS:
        assert build(kind, opts).float().fast_kernel(e) is None, opts_id(kind, opts)
    L = SHAPES["full"]["L"]
    for kind, opts in [("full", {}), ("block", {}), ("full", {"window": L}), ("full", {"window": L + 9})]:
        fast = resolve_kernel("auto", e)  # the C++ kernel, or the plain-PyTorch path where it cannot be built
        assert build(kind, opts).float().fast_kernel(e) == fast, opts_id(kind, opts)  # W >= L hides nothing


def test_repr_names_the_options_set():
    assert repr(build("full", {})).endswith("kernel='auto')")
    assert "query='input', heads=2)" in repr(build("block", {"query": "input", "heads": 2}))
    assert "mixing='static', window=3)" in repr(build("full", {"mixing": "static", "window": 3}))


@pytest.mark.parametrize("kind,opts,match", [
    ("full", {"query": "dynamic"}, r"query must be one of 'static', 'input'"),
    ("full", {"mixing": "dense"}, r"mixing must be one of"),
    ("block", {"scoring": "relu"}, r"scoring must be one of 'softmax', 'sigmoid'"),
    ("full", {"key_norm": "no"}, r"key_norm must be true or false"),
    ("full", {"heads": 3}, r"heads=3 must divide d_model=8 .*valid values: 1, 2, 4, 8"),
    ("block", {"heads": 0}, r"heads=0 must divide"),
    ("full", {"mixing": "static", "scoring": "sigmoid"}, r"mixing='static' has no queries or keys, so scoring="),
    ("block", {"mixing": "static", "query": "input", "heads": 2}, r"query='input', heads=2 mean nothing"),
    ("full", {"window": 0}, r"window=0 must be a positive int W .* or null"),
    ("full", {"window": True}, r"window=True must be a positive int"),
    ("block", {"window": 2}, r"window=2 is a Full AttnRes option.*use residual=full"),
], ids=lambda x: x if isinstance(x, str) and len(x) <= 5 else opts_id("", x)[1:] if isinstance(x, dict) else "")
def test_bad_options_raise(kind, opts, match):
    with pytest.raises(ValueError, match=match):
        build(kind, opts)


@pytest.mark.parametrize("kind,cls", [("full", FullAttentionResidual), ("block", BlockAttentionResidual)])
def test_yaml_keys_are_constructor_arguments_with_their_defaults(kind, cls):
    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "residual" / f"{kind}.yaml"))
    assert cfg.pop("_target_") == f"attnres.{cls.__name__}" and cfg.pop("_partial_") is True
    cfg.pop("num_blocks", None)  # ${num_blocks}, the top-level key
    strategy = cls(D, 8, **cfg)
    assert not strategy.ablated
    for key in ("query", "mixing", "scoring", "key_norm", "heads", "window", "fuse_prenorm"):
        if key in cfg:
            assert getattr(strategy, key) == cfg[key]


# ------------------------------------------------------------------------------------------------
# end to end: one CLI sweep over the options
# ------------------------------------------------------------------------------------------------

TINY = tiny("data.block_size=64", "callbacks.depth_dashboard.every_n_steps=2", steps=4, val_every=4,
            progress_bar=False, logger=True)
# One job per dict; each residual key reads the job's dict, or keeps its default. `++` because the
# sweep's parent composes the config before `residual=full` applies. Block's options are the same
# code (`ablated_mix`), held to the reference above.
SWEPT = {"query": "static", "scoring": "softmax", "key_norm": "true", "heads": 1, "mixing": "attention",
         "window": "null"}
JOBS = {"attention": {"query": "input", "scoring": "sigmoid", "key_norm": False, "heads": 2, "window": 2},
        "static": {"mixing": "static", "window": 1}}  # two jobs: each CLI job costs ~20 s on 2 cores


@pytest.mark.slow
def test_cli_sweep_trains_every_option_and_its_heatmap_rows_are_distributions(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jobs = ",".join("{" + ",".join(f"{k}:{v}" for k, v in {"job": name, **o}.items()) + "}" for name, o in JOBS.items())
    # +ablation={job:attention,query:input,...},{job:static,...}; ++residual.query=${oc.select:ablation.query,static}
    reads = [f"++residual.{k}=${{oc.select:ablation.{k},{v}}}" for k, v in SWEPT.items()]
    result = run_cli(
        "-m", "hydra/launcher=basic", "residual=full", *TINY,
        f"+ablation={jobs}", *reads, f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"}, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    L, seen = 4, set()
    for run_dir in sorted({p.parent for p in (tmp_path / "sweep").rglob("events.out.tfevents.*")}):
        name = OmegaConf.load(run_dir / ".hydra" / "config.yaml").ablation.job
        seen.add(name)
        W = JOBS[name].get("window")
        acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
        acc.Reload()
        meta = json.loads(acc.SummaryMetadata("depth/heatmap_data").plugin_data.content)
        assert meta["rows"][-1] == "output" and meta["cols"][0] == "emb"
        events = acc.Tensors("depth/heatmap_data")
        assert [e.step for e in events] == [0, 2, 4]
        for event in events:
            proto = event.tensor_proto
            grid = np.asarray(proto.float_val, dtype=np.float32).reshape([d.size for d in proto.tensor_shape.dim])
            assert grid.shape == (L + 1, L + 1)
            assert [int(np.isfinite(row).sum()) for row in grid] == list(range(1, L + 2))
            np.testing.assert_allclose(np.nansum(grid, axis=1), 1.0, atol=1e-5)
            for l, row in enumerate(grid):
                outside = [] if W is None else [i for i in range(1, l + 1 - W)]
                assert (row[outside] == 0).all() and (row[: l + 1] >= 0).all()
                if event.step == 0:  # zero-initialised: uniform over the sources the row sees
                    seen_cols = [i for i in range(l + 1) if i not in outside]
                    np.testing.assert_allclose(row[seen_cols], 1 / len(seen_cols), atol=1e-6)
    assert seen == set(JOBS)
