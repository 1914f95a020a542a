"""The runner: every config option composes and instantiates, the real CLI trains each
strategy, resume equals an uninterrupted run, bad input gets one line, and a built wheel
finds its configs from anywhere."""

from __future__ import annotations

import os
import site as site_module
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# a model and data small enough that a CLI run costs seconds on 2 cores
TINY = [
    "data=synthetic", "data.batch_size=8", "data.val_batches=1", "model.n_layer=2", "model.n_embd=32",
    "model.n_head=2", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "logger=none",
]


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`attnres-run ARGS` in a subprocess (via `python -m attnres`, the same entry point)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "attnres", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600
    )


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# -- every option of every group composes and instantiates -----------------------------------
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
        from attnres.training.data.tokens import write_shard

        for split in ("train", "val"):
            write_shard(tmp_path / f"{split}.bin", np.arange(1000, dtype=np.uint16) % 300)
        (tmp_path / "meta.json").write_text('{"vocab_size": 300}')
        cfg.data.path = str(tmp_path)
    data = instantiate(cfg.data)
    assert data.vocab_size > 0 and data.metric in ("bpb", "accuracy", "loss")
    model = instantiate(cfg.model, vocab_size=data.vocab_size, residual=instantiate(cfg.residual))
    assert model.residual.num_layers == 2 * cfg.model.n_layer
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


# -- the real CLI ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_fast_dev_run_through_cli(tmp_path, residual):
    result = run_cli(*TINY, f"residual={residual}", "num_blocks=2", "debug=fast_dev_run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = next((tmp_path / "outputs").rglob("metrics.json"))
    assert f"residual={residual}" in str(summary.parent)
    assert '"status": "finished"' in summary.read_text()


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
    common = [*TINY, "residual=block", "num_blocks=2", "trainer.val_check_interval=4", "optim.total_steps=8",
              "optim.schedule.warmup_steps=2"]
    whole = run_cli(*common, "trainer.max_steps=8", "hydra.run.dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli(*common, "trainer.max_steps=3", "hydra.run.dir=split", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    halfway = _weights(tmp_path / "split/checkpoints/last.ckpt")
    second = run_cli(*common, "trainer.max_steps=8", "hydra.run.dir=split", "resume=true", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = _weights(tmp_path / "whole/checkpoints/last.ckpt"), _weights(tmp_path / "split/checkpoints/last.ckpt")
    assert a.keys() == b.keys()
    assert not all(torch.equal(halfway[k], b[k]) for k in b), "the resumed run did not train"
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between resumed and uninterrupted runs"
    assert '"steps": 8' in (tmp_path / "split/metrics.json").read_text()


# -- bad input: one line, exit status 2, no traceback ----------------------------------------
def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["residual=blok"], ["unknown residual 'blok'", "did you mean block",  # every option, from conf/residual/
                             ", ".join(sorted(f.stem for f in (CONF / "residual").glob("*.yaml")))]),
        (["model=huge"], ["unknown model 'huge'", "gpt-small, tiny"]),
        (["residual=block", "num_blocks=3"], ["num_blocks=3", "valid values: 1, 2, 4"]),
        (["data=text"], ["data.path is not set"]),
        (["data=text", "data.path=/no/such/corpus"], ["/no/such/corpus", "matches no file"]),
    ],
    ids=["unknown-residual", "unknown-model", "num-blocks", "no-data-path", "missing-data-path"],
)
def test_bad_input_one_line(tmp_path, args, expected):
    line = _one_line_error(run_cli(*TINY[1:], *args, cwd=tmp_path))
    for fragment in expected:
        assert fragment in line, line


@pytest.mark.slow
def test_bad_checkpoints(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    line = _one_line_error(run_cli(*TINY, f"ckpt_path={garbage}", cwd=tmp_path))
    assert str(garbage) in line and "corrupt" in line
    trained = run_cli(*TINY, "trainer.max_steps=1", "hydra.run.dir=small", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = tmp_path / "small/checkpoints/last.ckpt"
    line = _one_line_error(run_cli(*TINY, "model.n_embd=64", f"ckpt_path={ckpt}", cwd=tmp_path))
    assert str(ckpt) in line and "does not match this model" in line
    again = run_cli(*TINY, "trainer.max_steps=1", "hydra.run.dir=small", cwd=tmp_path)
    assert "already holds a run" in _one_line_error(again)


# -- packaging ------------------------------------------------------------------------------
@pytest.mark.slow
def test_wheel_finds_configs_from_anywhere(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("attnres-*.whl"))
    env_dir = tmp_path / "venv"
    # The dependencies come from the environment running the tests, which may itself be a venv:
    # `system_site_packages=True` would give the *base* interpreter's packages, so this venv gets
    # a .pth file listing this environment's site folders instead (after its own site-packages,
    # so the wheel installed there wins over the editable checkout).
    venv.create(env_dir, system_site_packages=False, with_pip=True)
    py = env_dir / "bin" / "python"
    site = next(env_dir.glob("lib/python*/site-packages"))
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site_module.getsitepackages()}
    (site / "zz_outer_env.pth").write_text("\n".join(sorted(outer)) + "\n")
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--ignore-installed", str(wheel)], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [str(env_dir / "bin" / "attnres-run"), "--cfg", "job", "residual=block", "num_blocks=8"],
        cwd=elsewhere, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "_target_: attnres.BlockAttentionResidual" in result.stdout and "num_blocks: 8" in result.stdout
    where = subprocess.run([str(py), "-c", "import attnres, sys; print(attnres.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True)
    assert str(env_dir) in where.stdout, where.stdout  # the wheel, not the source checkout
    assert (site / "attnres" / "conf" / "config.yaml").is_file() and (site / "attnres" / "cli.py").is_file()
    assert (site / "attnres" / "ops" / "csrc" / "depth_attention_cpu.cpp").is_file()  # the CPU kernel builds from it
    assert not (site / "cli.py").exists() and not (site / "conf").exists(), "generic top-level names installed"
