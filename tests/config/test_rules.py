"""The value rules (`attnres.config.rules.validate_config`) on one composed config: each wrong
value is refused in one line naming the fix, every right one passes, and no Hydra node is needed."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from attnres.config.errors import ConfigError
from attnres.config.rules import validate_config
from tests.helpers import CONF
from tests.helpers import TINY_CHECKED as TINY


@pytest.fixture(scope="module")
def job_cfg():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "residual=block", "num_blocks=2"])
    GlobalHydra.instance().clear()
    return cfg


def _with(cfg, **values):
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


@pytest.mark.parametrize(("values", "fragment"), [
    ({"overwrite": "no"}, "overwrite=no is not a boolean"),
    ({"seed": "foo"}, "seed=foo is not an integer"),
    ({"seed": 2**32}, "seed=4294967296"),
    ({"num_blocks": 3}, "num_blocks=3 must divide the 4 sublayers (2 per transformer layer), or give unequal "
                        "blocks with residual.block_sizes=[...]; valid values: 1, 2, 4"),
    ({"num_blocks": 2, "residual__block_sizes": [3, 2]}, "residual.block_sizes=[3,2] must be positive integers "
                                                           "summing to the 4 sublayers"),
    ({"num_blocks": 3, "residual__block_sizes": [3, 1]}, "num_blocks=3 disagrees with residual.block_sizes"),
    ({"model__n_embd": 30}, "model.n_embd=30 must split into model.n_head=2"),
    ({"model__n_head": 32}, "model.n_embd=32 must split into model.n_head=32"),
    ({"model__dropout": 1.0}, "model.dropout=1.0"),
    ({"model__mlp": "relu"}, "gelu, swiglu"),
    ({"residual__kernel": "trit"}, "auto, triton, cpu, torch, naive"),
    ({"trainer__max_steps": -1}, "optim.total_steps"),
    ({"trainer__max_steps": 1e3}, "trainer.max_steps=1000.0 is not an integer"),
    ({"trainer__val_check_interval": 0.5}, "trainer.val_check_interval=0.5 is not an integer"),
    ({"trainer__precision": "bf17"}, "trainer.precision=bf17 is not a precision"),
    ({"trainer__devices": 0}, "trainer.devices=0 is invalid"),
    ({"trainer__devices": -1}, "trainer.devices=-1 is invalid"),
    ({"trainer__accelerator": "abacus"}, "trainer.accelerator=abacus is not an accelerator"),
    ({"trainer__strategy": "dpp"}, "did you mean ddp?"),
    ({"trainer__deterministic": "maybe"}, "trainer.deterministic=true or trainer.deterministic=false or"),
    ({"optim__optimizer__betas": [0.9]}, "optim.optimizer.betas=[0.9]"),
    ({"optim__query_lr_scale": -0.1}, "optim.query_lr_scale=-0.1"),
    ({"data__num_workers": -1}, "data.num_workers=-1"),
    ({"callbacks__checkpoint__save_last": "always"}, "or callbacks.checkpoint.save_last=link"),
    ({"name": ""}, "name='' is not a folder name"),
    ({"name": "/abs"}, "name=/abs is not a folder name"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_validate_config_rejects(job_cfg, values, fragment):
    with pytest.raises(ConfigError) as err:
        validate_config(_with(job_cfg, **values))
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("values", [
    {}, {"trainer__deterministic": "warn"}, {"trainer__devices": "auto"}, {"trainer__devices": "2"},
    {"callbacks__checkpoint__save_last": "link"}, {"trainer__fast_dev_run": True}, {"trainer__fast_dev_run": 3},
    {"trainer__max_steps": -1, "optim__total_steps": 10}, {"trainer__gradient_clip_val": None},
    {"name": "study/part-1"}, {"model___target_": "my.Model", "model__n_embd": "wide"},
    {"optim__optimizer___target_": "my.Optimizer", "optim__optimizer__lr": "cyclic"},
], ids=lambda v: repr(v))
def test_validate_config_accepts(job_cfg, values):
    validate_config(_with(job_cfg, **values))


def test_validate_config_needs_no_hydra_node():
    validate_config(OmegaConf.create({"seed": 1, "model": {"_target_": "attnres.Transformer", "n_layer": 2}}))
    with pytest.raises(ConfigError, match="compile=yes is not a boolean"):
        validate_config(OmegaConf.create({"compile": "yes"}))


def test_keep_freed_memory_is_a_boolean():
    with pytest.raises(ConfigError, match="keep_freed_memory=no is not a boolean"):
        validate_config(OmegaConf.create({"keep_freed_memory": "no"}))


@pytest.mark.parametrize(("per_job", "fix"), [(False, "set trainer.devices=1 or fewer (or trainer.devices=auto)"),
                                              (True, "set gpus_per_job=1 or fewer")])
def test_more_gpus_than_the_machine_has_names_the_key_that_sets_them(monkeypatch, per_job, fix):
    import torch

    from attnres.config.rules import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as err:
        check_devices(8, gpu=True, per_job=per_job)  # experiment=paper_* sets trainer.devices from gpus_per_job
    assert str(err.value) == f"trainer.devices=8 but this machine has 1 GPU(s); {fix}"


def test_the_kernel_names_are_the_dispatchers():
    """rules.py writes them out so that checking a command imports no torch."""
    from attnres.config.rules import KERNELS
    from attnres.ops.dispatch import KERNELS as DISPATCHED

    assert KERNELS == DISPATCHED
