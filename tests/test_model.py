"""The Transformer (attnres/model.py) with each residual strategy: outputs, training, parameter
counts, the step-0 agreement of DESIGN.md section 2b, a light `import attnres`; and KV-cached
decoding, which equals full forwards for every strategy.

A new token's depth sources are its own earlier sublayer outputs, computed in the same pass, so
no strategy needs a cache of its own: only attention reads other positions. The decoding checks
run in float64 with every strategy's parameters moved off their (symmetric) initial values, so the
depth weights are not uniform and a strategy that mixed positions would show."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnres
from attnres import BlockAttentionResidual, FullAttentionResidual, StandardResidual, Transformer
from attnres.model import KVCache
from attnres.residual.depth_scaled import DepthScaledResidual
from attnres.residual.uniform import UniformBlockResidual

pytestmark = pytest.mark.usefixtures("torch_single_thread")

STRATEGIES = {
    "standard": StandardResidual,
    "full": FullAttentionResidual,
    "block": functools.partial(BlockAttentionResidual, num_blocks=2),
    "block-sizes": functools.partial(BlockAttentionResidual, block_sizes=[3, 1]),  # a shorter last block
    # the depth study's controls (tests/residual/test_controls.py)
    "block-uniform": functools.partial(UniformBlockResidual, num_blocks=2),
    "depth-scaled": functools.partial(DepthScaledResidual, base_depth=1),
}
ATTNRES = ("full", "block", "block-sizes")
TINY = {"vocab_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}


def tiny_model(residual: str, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**{**TINY, **overrides}, residual=STRATEGIES[residual])


def tokens(batch: int, seq_len: int, seed: int = 0, vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


MODEL_VARIANTS = [
    pytest.param(mlp, tie, id=f"{mlp}-{'tied' if tie else 'untied'}")
    for mlp in ("gelu", "swiglu")
    for tie in (True, False)
]


@pytest.mark.parametrize("residual", list(STRATEGIES))
def test_forward_outputs(residual):
    model = tiny_model(residual).eval()
    idx = tokens(3, 7)
    out = model(idx)
    assert set(out) == {"logits"} and out["logits"].shape == (3, 7, 32)

    targets = tokens(3, 7, seed=1)
    targets[0, :3] = -100
    targets[2, -1] = -100
    out = model(idx, targets=targets, return_hidden=True)
    assert set(out) == {"logits", "loss", "hidden"}
    assert out["hidden"].shape == (3, 7, 16)
    assert torch.allclose(out["logits"], model.head(out["hidden"]))
    keep = targets != -100
    expected = F.cross_entropy(out["logits"][keep], targets[keep])
    assert torch.allclose(out["loss"], expected, rtol=1e-6)


@pytest.mark.parametrize("residual", list(STRATEGIES))
def test_trains_end_to_end(residual):
    model = tiny_model(residual)
    idx, targets = tokens(4, 16, seed=2), tokens(4, 16, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss = model(idx, targets=targets)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    if residual in ATTNRES:  # the pseudo-queries learned something (the controls have none)
        assert model.residual.pseudo_query.abs().max() > 0


@pytest.mark.parametrize("mlp,tie", MODEL_VARIANTS)
def test_parameter_counts(mlp, tie):
    models = {name: tiny_model(name, mlp=mlp, tie_embeddings=tie) for name in STRATEGIES}
    L, D, V = 2 * TINY["n_layer"], TINY["n_embd"], TINY["vocab_size"]
    base = models["standard"].num_parameters()
    assert models["standard"].num_parameters(exclude_residual=True) == base
    for name in ATTNRES:
        assert models[name].num_parameters(exclude_residual=True) == base
        assert models[name].num_parameters() - base == 2 * (L + 1) * D
    assert (models["standard"].head.weight is models["standard"].embed.weight) == tie
    untied = tiny_model("standard", mlp=mlp, tie_embeddings=False).num_parameters()
    assert untied - base == (0 if not tie else V * D)


@pytest.mark.parametrize("mlp,tie", MODEL_VARIANTS)
def test_same_seed_gives_same_weights_and_same_step0_logits(mlp, tie, rel_err):
    """DESIGN.md 2b: zero queries read a uniform mean, a scaled sum, and every consumer of the
    stream normalises it first, so with the same weights the three strategies agree up to eps."""
    models = {
        name: tiny_model(name, seed=7, mlp=mlp, tie_embeddings=tie, norm_eps=1e-12).double() for name in STRATEGIES
    }
    reference = {k: v for k, v in models["standard"].state_dict().items()}
    for name in ATTNRES:
        state = {k: v for k, v in models[name].state_dict().items() if not k.startswith("residual.")}
        assert state.keys() == reference.keys()
        for key, value in state.items():
            assert torch.equal(value, reference[key]), key

    idx = tokens(2, 16, seed=4)
    logits = {name: model(idx)["logits"] for name, model in models.items()}
    for name in ATTNRES:
        assert rel_err(logits[name], logits["standard"]) < 1e-6, name
    # not vacuous: once a query moves, the functions differ
    with torch.no_grad():
        models["full"].residual.pseudo_query.normal_()
    assert rel_err(models["full"](idx)["logits"], logits["standard"]) > 1e-3


def test_sequence_longer_than_block_size_raises():
    model = tiny_model("block")
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size=16"):
        model(tokens(1, 17))


def test_residual_factory_is_called_with_d_model_and_num_layers():
    calls = []

    def factory(**kwargs):
        calls.append(kwargs)
        return FullAttentionResidual(**kwargs)

    model = Transformer(**{**TINY, "n_layer": 3}, residual=factory)
    assert calls == [{"d_model": 16, "num_layers": 6}]
    assert model.residual.pseudo_query.shape == (7, 16)
    assert isinstance(Transformer(**TINY).residual, StandardResidual)


def test_import_is_light():
    root = Path(attnres.__file__).resolve().parents[1]
    heavy = ["pytorch_lightning", "lightning", "hydra", "omegaconf", "tensorboard"]
    code = (
        "import sys, attnres, attnres.functional, attnres.residual, attnres.model\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import attnres pulled in {result.stdout.strip()}"


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_non_embedding_parameters_leave_out_embedding_and_head(tie):
    model = Transformer(vocab_size=50, n_layer=2, n_embd=16, n_head=2, block_size=8, tie_embeddings=tie)
    D, V = 16, 50
    per_layer = 4 * D * D + 8 * D * D + 2 * D  # qkv + proj, the 4x GELU MLP, two pre-norms
    assert model.num_parameters(exclude_embedding=True) == 2 * per_layer + D  # + the final norm
    assert model.num_parameters() == model.num_parameters(exclude_embedding=True) + V * D * (1 if tie else 2)


# -- KV-cached decoding ---------------------------------------------------------------------------
GENERATE_STRATEGIES = {
    "standard": attnres.StandardResidual,
    "block": functools.partial(attnres.BlockAttentionResidual, num_blocks=2),
    "full": attnres.FullAttentionResidual,
    "denseformer": attnres.DenseFormerResidual,
    "hc": attnres.HyperConnectionResidual,
    "mhc": attnres.ManifoldHyperConnectionResidual,
}


def decoding_model(strategy: str, block_size: int = 24, mlp: str = "gelu") -> Transformer:
    torch.manual_seed(0)
    m = Transformer(vocab_size=37, n_layer=2, n_head=2, n_embd=16, block_size=block_size, mlp=mlp,
                    residual=GENERATE_STRATEGIES[strategy]).double().eval()
    with torch.no_grad():
        for p in m.residual.parameters():  # off their initial values (zero queries read a uniform mean)
            p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("strategy", GENERATE_STRATEGIES)
def test_cached_logits_equal_the_full_forward(strategy):
    m = decoding_model(strategy)
    idx = torch.randint(0, 37, (3, 20), generator=torch.Generator().manual_seed(1))
    full = m(idx)["logits"]  # (B, T, V)
    cache = KVCache(m.block_size)
    prefill = m(idx[:, :7], kv_cache=cache)["logits"]  # a prompt of 7, then 3 at once, then one by one
    chunk = m(idx[:, 7:10], kv_cache=cache)["logits"]
    steps = [m(idx[:, t : t + 1], kv_cache=cache)["logits"] for t in range(10, 20)]
    cached = torch.cat([prefill, chunk, *steps], dim=1)
    assert cache.pos == 20
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", GENERATE_STRATEGIES)
def test_cached_greedy_generation_equals_full_forward_greedy(strategy):
    m = decoding_model(strategy, block_size=16)
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(2))
    # 20 new tokens: past block_size=16, so the window slides and the cache is rebuilt
    cached = m.generate(prompt, 20, temperature=0, use_cache=True)
    reference = prompt
    for _ in range(20):  # greedy decoding by full forwards over the last block_size tokens
        logits = m(reference[:, -m.block_size :])["logits"][:, -1]
        reference = torch.cat((reference, logits.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(cached, reference)


def test_sampling_is_reproducible_and_top_k_bounds_it():
    m = decoding_model("block")
    prompt = torch.zeros(4, 1, dtype=torch.long)
    a = m.generate(prompt, 12, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    b = m.generate(prompt, 12, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (4, 13)
    one = m.generate(prompt, 6, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one, m.generate(prompt, 6, temperature=0))  # top_k=1 is greedy


def test_generation_errors():
    m = decoding_model("standard")
    with pytest.raises(ValueError, match="temperature"):
        m.generate(torch.zeros(1, 1, dtype=torch.long), 2, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        m.generate(torch.zeros(1, 1, dtype=torch.long), 2, top_k=0)
    cache = KVCache(4)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        m(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
