"""residual.fuse_prenorm, the YAML key of every strategy that fuses a sublayer's pre-norm into its
depth mix: composed through the real Hydra config it reaches the module, a non-bool is refused in
one line (exit 2, nothing written), and a resume may switch it (a fused norm agrees to rounding)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from attnres import BlockAttentionResidual, FullAttentionResidual
from attnres.config.computation import computation, differences
from attnres.config.errors import ConfigError
from attnres.config.rules import validate_config
from tests.helpers import CONF, TINY_CHECKED, one_line_error, run_cli

#: the strategies whose module is Block or Full AttnRes with the two-phase fast path
FUSING = ("block", "full", "kimi", "block_uniform")


def _composed(*overrides: str):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=[*TINY_CHECKED, "num_blocks=2", *overrides])
    finally:
        GlobalHydra.instance().clear()


def _model(cfg):
    """The model as attnres.training.run builds it from the job's config."""
    return instantiate(cfg.model, vocab_size=32, residual=instantiate(cfg.residual))


@pytest.mark.parametrize("name", FUSING)
def test_every_fusing_strategy_has_the_key_at_the_modules_default(name):
    spec = OmegaConf.load(CONF / "residual" / f"{name}.yaml")
    default = (FullAttentionResidual(8, 4) if name == "full" else BlockAttentionResidual(8, 4, 2)).fuse_prenorm
    assert "fuse_prenorm" in spec and spec.fuse_prenorm is default


@pytest.mark.parametrize("name", FUSING)
@pytest.mark.parametrize("value", [True, False])
def test_the_key_reaches_the_module_and_its_sublayers_take_the_fused_norm(name, value):
    model = _model(_composed(f"residual={name}", f"residual.fuse_prenorm={str(value).lower()}"))
    assert model.residual.fuse_prenorm is value
    assert all((model.residual.prenorm_of(s) is not None) is value for s in model.sublayers)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(idx, targets=idx)["loss"].backward()  # the fused path runs end to end from the composed config


@pytest.mark.parametrize("value", ["maybe", 1, 0.0, "yes"])
def test_a_non_bool_is_refused_in_one_line(value):
    cfg = _composed("residual=block")
    OmegaConf.update(cfg, "residual.fuse_prenorm", value)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert str(err.value) == (f"residual.fuse_prenorm={value} is not a boolean; "
                              "write residual.fuse_prenorm=true or residual.fuse_prenorm=false")


def test_the_command_line_refuses_a_non_bool_with_exit_2_writing_nothing(tmp_path):
    result = run_cli(*TINY_CHECKED, "residual=full", "residual.fuse_prenorm=maybe", cwd=tmp_path)
    line = one_line_error(result, 2)
    assert "residual.fuse_prenorm=maybe is not a boolean; write residual.fuse_prenorm=true" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cls", [BlockAttentionResidual, FullAttentionResidual])
def test_the_module_refuses_a_non_bool_in_one_line(cls):
    with pytest.raises(ValueError, match=r"^fuse_prenorm='yes' must be True or False [^\n]*$"):
        cls(8, 4, fuse_prenorm="yes", **({"num_blocks": 2} if cls is BlockAttentionResidual else {}))


def test_a_resume_may_switch_it():
    """A checkpoint trained unfused (or before the key existed) continues fused and back: the key
    says how a run is computed, not what, like residual.kernel."""
    plain, fused = (computation(_composed("residual=block", f"residual.fuse_prenorm={v}")) for v in ("false", "true"))
    before_the_key = {k: v for k, v in plain.items() if k != "residual.fuse_prenorm"}
    assert differences(plain, fused) == [] and differences(before_the_key, fused) == []
    assert differences(plain, computation(_composed("residual=block", "residual.eps=1e-5"))) == ["residual.eps"]


@pytest.mark.parametrize("cls", [BlockAttentionResidual, FullAttentionResidual])
def test_on_by_default_and_the_repr_says_when_it_is_off(cls):
    kw = {"num_blocks": 2} if cls is BlockAttentionResidual else {}
    on, off = cls(8, 4, **kw), cls(8, 4, fuse_prenorm=False, **kw)
    assert on.fuse_prenorm is True and off.fuse_prenorm is False
    assert "fuse_prenorm" not in repr(on) and repr(off).endswith("kernel='auto', fuse_prenorm=False)")
