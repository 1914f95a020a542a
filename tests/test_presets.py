"""The paper's five sizes as model presets (conf/model/paper-*.yaml; docs/configuration.md, "The
paper's experiments"): each has its Table 2 row's blocks and heads, its width within 2%, and
non-embedding parameters within 2% of the row's activated parameters, counted on the meta device;
and the MLP width knob that makes a dense model match (`mlp_hidden`), whose default leaves today's
models as they were."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from attnres import Transformer
from tests.helpers import CONF

#: Table 2 of the paper (transcribed, docs/configuration.md#the-papers-experiments):
#: size -> (L_b, heads, d_model, activated parameters)
TABLE_2 = {"194m": (12, 12, 896, 194e6), "241m": (13, 13, 960, 241e6), "296m": (14, 14, 1024, 296e6),
           "436m": (16, 16, 1168, 436e6), "528m": (17, 17, 1264, 528e6)}


@pytest.fixture(scope="module")
def presets():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield {size: compose("config", overrides=[f"model=paper-{size}"]).model for size in TABLE_2}
    GlobalHydra.instance().clear()


def test_every_paper_preset_is_tested():
    assert sorted(p.stem for p in CONF.glob("model/paper-*.yaml")) == sorted(f"paper-{s}" for s in TABLE_2)


@pytest.mark.parametrize("size", TABLE_2)
def test_a_preset_has_its_rows_shape_and_activated_parameters(presets, size):
    layers, heads, width, activated = TABLE_2[size]
    cfg = presets[size]
    assert (cfg.n_layer, cfg.n_head, cfg.mlp) == (layers, heads, "swiglu")
    assert abs(cfg.n_embd - width) / width <= 0.02
    with torch.device("meta"):  # no memory, no time: 0.5B parameters are shapes only
        model = instantiate(cfg, vocab_size=32768, block_size=8192)
    assert all(p.is_meta for p in model.parameters())
    n = model.num_parameters(exclude_embedding=True)
    assert abs(n - activated) / activated <= 0.02, (size, n)
    D, H, L = cfg.n_embd, cfg.mlp_hidden, cfg.n_layer  # the count by hand: attention, SwiGLU, two norms; final norm
    assert n == L * (4 * D * D + 3 * D * H + 2 * D) + D
    stated = re.search(r"This preset has ([\d.]+)M\s+(?:#\s+)?non-embedding parameters \(([+-][\d.]+)%\)",
                       (CONF / f"model/paper-{size}.yaml").read_text())
    assert stated, "the preset's comment states its parameter count"
    assert float(stated[1]) == pytest.approx(n / 1e6, abs=0.05)
    assert float(stated[2]) == pytest.approx(100 * (n - activated) / activated, abs=0.05)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_default_mlp_width_is_todays(mlp):
    """mlp_hidden=None builds what the model built before the knob: the same shapes, and from the
    same seed the same weights and outputs as the width written out."""
    D = 40
    width = 4 * D if mlp == "gelu" else 64 * math.ceil(8 * D / 3 / 64)
    models = []
    for hidden in (None, width):
        torch.manual_seed(0)
        models.append(Transformer(vocab_size=50, n_layer=2, n_head=2, n_embd=D, block_size=16, mlp=mlp,
                                  mlp_hidden=hidden))
    up = models[0].sublayers[1].up.weight
    assert up.shape == ((2 if mlp == "swiglu" else 1) * width, D)
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 50, (2, 16))
    assert torch.equal(models[0](x)["logits"], models[1](x)["logits"])


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_mlp_hidden_sets_the_width(mlp):
    model = Transformer(vocab_size=50, n_layer=3, n_head=2, n_embd=32, block_size=16, mlp=mlp, mlp_hidden=72)
    gates = 2 if mlp == "swiglu" else 1
    for sublayer in model.sublayers[1::2]:
        assert sublayer.up.weight.shape == (gates * 72, 32) and sublayer.down.weight.shape == (32, 72)
    assert model.num_parameters(exclude_embedding=True) == 3 * (4 * 32 * 32 + (gates + 1) * 32 * 72 + 2 * 32) + 32
    out = model(torch.randint(0, 50, (2, 16)), targets=torch.randint(0, 50, (2, 16)))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and model.sublayers[1].up.weight.grad is not None


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "64"])
def test_a_bad_mlp_hidden_is_refused(bad):
    with pytest.raises(ValueError, match="mlp_hidden must be a positive integer or None"):
        Transformer(vocab_size=50, n_layer=1, n_head=2, n_embd=32, mlp_hidden=bad)
