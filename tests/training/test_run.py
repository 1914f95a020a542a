"""One run (attnres/training/run.py, `train`): in-process, what a run folder holds when it ends,
its mode=eval and mode=sample (attnres/training/evaluate.py) on the checkpoint it wrote; through
the CLI, DDP over two CPU processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict, read_write

from tests.helpers import CONF, metrics, run_cli, tiny


def _job(overrides: list[str], run_dir: Path):
    """The composed config of a run into `run_dir` as Hydra hands it to `train`, saved where Hydra
    saves it (.hydra/config.yaml, which mode=eval and mode=sample read the model from)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    with open_dict(cfg), read_write(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    (run_dir / ".hydra").mkdir(parents=True)
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.save(job, run_dir / ".hydra" / "config.yaml")
    return cfg


@pytest.fixture
def in_process(monkeypatch):
    """The run's loggers as they were afterwards: `train` sends Lightning's messages to its log file."""
    lightning = logging.getLogger("pytorch_lightning")
    monkeypatch.setattr(lightning, "handlers", list(lightning.handlers))
    yield


@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*val_check_interval", "ignore:.*Checkpoint directory")
def test_train_in_process_writes_the_run_folder_then_evaluates_and_samples_it(tmp_path, in_process):
    from attnres.training.run import train

    run_dir = tmp_path / "run"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    text = [f"data.path={corpus}", "data.block_size=32", "keep_freed_memory=false"]
    overrides = tiny(*text, "residual=block", "num_blocks=2", "callbacks.depth_dashboard.every_n_steps=1",
                     data="text", steps=2, progress_bar=False, logger=True)
    summary = train(_job(overrides, run_dir), run_dir, {"residual": "block"})
    assert summary["status"] == "finished" and summary["steps"] == 2 and summary["residual"] == "block"
    assert metrics(run_dir) == json.loads(json.dumps(summary))  # what it returned is what it wrote
    assert {p.name for p in (run_dir / "checkpoints").glob("*.ckpt")} == {"best.ckpt", "last.ckpt"}
    assert list(run_dir.glob("events.out.tfevents.*")), "no TensorBoard events"
    assert not list(run_dir.rglob("*.tmp"))

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ev_dir = tmp_path / "eval"
    scored = train(_job(tiny("mode=eval", f"ckpt_path={ckpt}", *text, data="text"), ev_dir), ev_dir, {})
    assert scored["metrics"]["val/bpb"] == pytest.approx(summary["metrics"]["val/bpb"], rel=1e-5)
    assert json.loads((ev_dir / "eval.json").read_text())["metrics"] == scored["metrics"]
    sa_dir = tmp_path / "sample"
    train(_job(tiny("mode=sample", f"ckpt_path={ckpt}", *text, "sample.max_new_tokens=4", "sample.num_samples=2",
                    data="text"), sa_dir), sa_dir, {})
    assert len(json.loads((sa_dir / "samples.json").read_text())["samples"]) == 2


@pytest.mark.slow
def test_ddp_two_processes_on_cpu(tmp_path):
    result = run_cli(*tiny(steps=3, val_every=3), "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                     "trainer.enable_progress_bar=false", "hydra.run.dir=ddp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = metrics(tmp_path / "ddp")
    assert summary["status"] == "finished" and summary["steps"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 8 * 40  # steps x processes x batch x block_size
