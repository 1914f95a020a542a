"""A residual strategy defined outside the package plugs into the Transformer through a
Hydra `_target_`, with no change to the package (DESIGN.md sections 1 and 3)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from hydra.utils import instantiate

import attnres

pytestmark = pytest.mark.usefixtures("torch_single_thread")

USER_MODULE = textwrap.dedent(
    '''
    """A user's own strategy: h_{l+1} = h_l + scale * f_l(h_l)."""
    import attnres


    class HalfResidual(attnres.ResidualStrategy):
        def __init__(self, d_model, num_layers, scale=0.5, eps=1e-6):
            super().__init__(d_model, num_layers, eps)
            self.scale = scale
            self.runs = 0

        def run(self, embedding, sublayers, sublayer_kwargs):
            self.runs += 1
            h = embedding
            for index, sublayer in enumerate(sublayers):
                h = h + self.scale * self.call_sublayer(index, sublayer, h, sublayer_kwargs)
            return h
    '''
)

MODEL_CONFIG = {
    "_target_": "attnres.Transformer",
    "vocab_size": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 16,
    "block_size": 8,
    "dropout": 0.0,
    "mlp": "swiglu",
}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_residual.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_residual", raising=False)
    yield
    sys.modules.pop("my_residual", None)


def by_hand(model, idx, scale):
    """The user's strategy, computed without it: embedding, scaled residual adds, norm, head."""
    T = idx.shape[1]
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    h = model.embed(idx)
    for sublayer in model.sublayers:
        h = h + scale * sublayer(h, rope=rope)
    return model.head(model.norm(h))


@pytest.mark.parametrize("scale", [None, 0.25], ids=["default-scale", "scale-0.25"])
def test_user_strategy_plugs_in_through_hydra(user_module, scale, rel_err):
    residual = {"_target_": "my_residual.HalfResidual", "_partial_": True}
    if scale is not None:
        residual["scale"] = scale
    torch.manual_seed(0)
    model = instantiate({**MODEL_CONFIG, "residual": residual})

    import my_residual

    assert isinstance(model, attnres.Transformer)
    assert type(model.residual) is my_residual.HalfResidual
    assert model.residual.num_layers == 4 and model.residual.d_model == 16
    expected_scale = 0.5 if scale is None else scale
    assert model.residual.scale == expected_scale

    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    model.residual.record_next()
    out = model(idx, targets=idx)
    assert model.residual.runs == 1
    assert len(model.residual.recorded.input_rms) == 4  # call_sublayer's recording works for it too
    assert rel_err(out["logits"], by_hand(model, idx, expected_scale)) < 1e-6

    out["loss"].backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)

    # the strategy changed the function: the standard residual on the same weights differs
    torch.manual_seed(0)
    standard = instantiate(MODEL_CONFIG)
    assert type(standard.residual) is attnres.StandardResidual
    assert rel_err(standard(idx)["logits"], out["logits"]) > 1e-4
