"""The Transformer with each residual strategy: outputs, training, parameter counts, the
step-0 agreement of DESIGN.md section 2b, and a light `import attnres`."""

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

pytestmark = pytest.mark.usefixtures("torch_single_thread")

STRATEGIES = {
    "standard": StandardResidual,
    "full": FullAttentionResidual,
    "block": functools.partial(BlockAttentionResidual, num_blocks=2),
    "block-sizes": functools.partial(BlockAttentionResidual, block_sizes=[3, 1]),  # a shorter last block
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
    if residual != "standard":  # the pseudo-queries learned something
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
