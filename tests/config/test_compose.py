"""Composing configs (`attnres.config.compose`, with the job checks of `attnres.config.job` it
runs): every option of every conf/ group composes and instantiates; a composed config that cannot
run is refused in one line naming the fix; the did-you-mean suggestions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from attnres.config.command import check_command_line
from attnres.config.compose import suggest
from attnres.config.errors import ConfigError
from tests.helpers import CONF
from tests.helpers import TINY_CHECKED as TINY

CUDA = torch.cuda.is_available()


# -- every option of every group composes and instantiates -----------------------------------
def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


GROUPS = ["residual", "model", "data", "trainer", "optim", "logger", "callbacks", "experiment", "debug"]


CASES = [(g, o) for g in GROUPS for o in options(g)]


@pytest.fixture
def composed(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        def _compose(overrides: list[str]):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            cfg.hydra.runtime.output_dir = str(tmp_path / "run")
            HydraConfig.instance().set_config(cfg)
            return cfg
        yield _compose
    GlobalHydra.instance().clear()


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_and_instantiates(composed, tmp_path, group, option):
    text = tmp_path / "corpus.txt"
    text.write_text("hello attention residuals\n" * 200)
    cfg = composed([f"{group}={option}"])
    if "cache_dir" in cfg.data:
        cfg.data.cache_dir = str(tmp_path / "cache")
    if "path" in cfg.data:
        cfg.data.path = str(text)
    if group == "data" and option == "tokens":  # a folder of token files
        from attnres.data.tokens import write_shard

        for split in ("train", "val"):
            write_shard(tmp_path / f"{split}.bin", np.arange(1000, dtype=np.uint16) % 300)
        (tmp_path / "meta.json").write_text('{"vocab_size": 300}')
        cfg.data.path = str(tmp_path)
    data = instantiate(cfg.data)
    assert data.vocab_size > 0 and data.metric in ("bpb", "accuracy", "loss")
    # on the meta device: the paper presets (up to 528M parameters) are built, initialised and
    # handed to the optimiser without allocating them (~150 s on a busy CPU otherwise)
    with torch.device("meta"):
        model = instantiate(cfg.model, vocab_size=data.vocab_size, residual=instantiate(cfg.residual))
        assert model.residual.num_layers == 2 * cfg.model.n_layer
        assert all(p.is_meta for p in model.parameters())
        instantiate(cfg.optim.optimizer)(model.parameters())
    instantiate(cfg.optim.schedule)(0, total_steps=10)
    [instantiate(c) for c in cfg.logger.values()]
    [instantiate(c) for c in cfg.callbacks.values()]
    if (cfg.trainer.accelerator == "gpu" or cfg.trainer.get("strategy") == "fsdp") and not torch.cuda.is_available():
        pytest.skip(f"trainer={cfg.hydra.runtime.choices.trainer} needs a GPU to instantiate; it composed")
    instantiate(cfg.trainer, precision="32-true" if cfg.trainer.precision == "auto" else cfg.trainer.precision)


@pytest.mark.parametrize("launcher", ["parallel", "slurm"])
def test_launchers_compose_and_instantiate(composed, launcher):
    cfg = composed([f"hydra/launcher={launcher}"])
    target = cfg.hydra.launcher._target_
    assert target.startswith("hydra_plugins."), target  # where Hydra requires launchers to live
    module, _, name = target.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls.__module__ == module  # Hydra registers plugins by the module that defines them


def test_top_level_num_blocks_feeds_block_strategy(composed):
    cfg = composed(["residual=block", "num_blocks=8"])
    assert cfg.residual.num_blocks == 8
    model = instantiate(cfg.model, vocab_size=256, residual=instantiate(cfg.residual))
    assert model.residual.num_blocks == 8 and model.residual.block_size == 2


# -- composed configs that cannot run ---------------------------------------------------------
COMPOSED_MISTAKES = [
    ("hydra-key", ["hydra.nope=1"], "unknown key hydra.nope"),
    ("add-existing", ["+seed=3"], "drop the + to change it"),
    ("add-unread", ["+foo=bar"], "+foo=bar: nothing reads foo"),
    ("add-unread-typo", ["+sample.tempreature=0"],
     "nothing reads sample.tempreature (did you mean sample.temperature?)"),
    ("add-unread-in-sweep", ["-m", "seed=0,1", "+nonfinite.polcy=skip"], "nothing reads nonfinite.polcy"),
    ("delete-missing", ["~nope"], "~nope deletes a key that does not exist"),
    ("launcher", ["hydra/launcher=nope"], "unknown hydra/launcher 'nope'"),
    ("leaf-elsewhere", ["block_size=64"], "did you mean data.block_size?"),
    ("config-as-value", ["optim.optimizer=5"], "optim.optimizer is a group of settings"),
    ("bool-untyped-key", ["callbacks.checkpoint.auto_insert_metric_name=no"], "true or"),
    ("int-untyped-key", ["callbacks.progress_bar.refresh_rate=abc"], "is not an integer"),
    ("broken-interpolation", ["model.n_layer=${nope}"], "model.n_layer"),
    ("fsdp-on-cpu", ["trainer=fsdp"], "trainer.strategy=fsdp needs GPUs"),
    ("text-without-path", ["data=text"], "data.path is not set"),
    ("name-escapes", ["name=../x"], "name=../x is not a folder name"),
    ("resume-and-overwrite", ["resume=true", "overwrite=true"], "contradict"),
    ("missing-ckpt", ["ckpt_path=/no/such.ckpt"], "ckpt_path=/no/such.ckpt is not a file"),
    ("schedule", ["optim.schedule.warmup_steps=-1"], "optim.schedule.warmup_steps=-1"),
    ("betas", ["optim.optimizer.betas=[0.9,2]"], "two numbers in [0, 1)"),
    ("mlp-hidden", ["model.mlp_hidden=0"], "set model.mlp_hidden to an integer >= 1 (or null)"),
    ("mlp-hidden-type", ["model.mlp_hidden=wide"], "model.mlp_hidden=wide is not an integer"),
    ("fast-dev-run", ["debug=fast_dev_run", "trainer.fast_dev_run=maybe"], "a number of batches"),
    ("cache-dir", ["data=stdlib", "data.cache_dir=/proc/attnres-cache"], "data.cache_dir="),
    ("sweep-last-job", ["-m", "model.n_embd=32,36", "model.n_head=2,4"], "model.n_embd=36 must split into"),
    ("sweep-glob-type", ["-m", "residual=glob(*)", "num_blocks=2", "seed=0,x"], "seed=x is not an integer"),
]


if not CUDA:
    COMPOSED_MISTAKES.append(("triton-sweep", ["-m", "residual=standard,full", "residual.kernel=triton"],
                              "unknown key residual.kernel"))


@pytest.mark.parametrize(("args", "fragment"), [m[1:] for m in COMPOSED_MISTAKES],
                         ids=[m[0] for m in COMPOSED_MISTAKES])
def test_composed_config(in_tmp, args, fragment):
    flags = [a for a in args if a.startswith("-")]
    with pytest.raises(ConfigError) as err:
        check_command_line([*flags, *TINY, *(a for a in args if not a.startswith("-"))], CONF)
    assert fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_suggest():
    keys = ["seed", "num_blocks", "model.n_layer", "trainer.max_steps", "optim.optimizer.lr", "data.batch_size",
            "model.block_size", "data.block_size"]
    assert suggest("model.n_layers", keys) == ["model.n_layer"]
    assert suggest("lr", keys) == ["optim.optimizer.lr"]
    assert suggest("block_size", keys) == ["model.block_size", "data.block_size"]
    assert suggest("trainer.max_stepz", keys) == ["trainer.max_steps"]
    assert suggest("completely_else", keys) == []


@pytest.mark.parametrize("added", [["+optim.optimizer.momentum=0.9", "optim.optimizer._target_=torch.optim.SGD",
                                    "~optim.optimizer.betas", "~optim.optimizer.eps"],
                                   ["+callbacks.extra._target_=pytorch_lightning.callbacks.Timer"],
                                   ["residual=block", "num_blocks=2", "+ablation={kernel:naive}",
                                    "++residual.kernel=${oc.select:ablation.kernel,auto}"]],
                         ids=["argument-of-a-target", "open-section", "read-by-interpolation"])
def test_added_keys_that_something_reads_pass(in_tmp, added):
    check_command_line([*TINY, *added], CONF)
