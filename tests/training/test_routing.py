"""The routing probes in training (attnres/training/routing.py): the callback that probes at the end
of training and its options, and experiments/probe_routing.py on run folders (the shared runs)."""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from attnres import BlockAttentionResidual, Transformer
from tests.helpers import RUN_STEPS, copy_run, run_script


@pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*val_check_interval")
@pytest.mark.parametrize("enabled", [True, False])
def test_callback_probes_at_the_end_of_training(tmp_path, enabled):
    import pytorch_lightning as pl

    from attnres.data import SyntheticDataModule
    from attnres.training import LitLanguageModel
    from attnres.training.routing import RoutingProbes
    from attnres.training.tensorboard import TensorBoardLogger

    pl.seed_everything(0, verbose=False)
    data = SyntheticDataModule(block_size=16, batch_size=4, num_symbols=4, num_hops=1, val_batches=2)
    model = Transformer(vocab_size=data.vocab_size, n_layer=2, n_head=2, n_embd=16, block_size=16,
                        residual=partial(BlockAttentionResidual, num_blocks=2))
    module = LitLanguageModel(model, optimizer=partial(torch.optim.AdamW, lr=1e-3), metric=data.metric)
    probes = RoutingProbes(enabled=enabled, batches=2, dirpath=str(tmp_path))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="", version=""),
                         callbacks=[probes], enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=1, val_check_interval=2,
                         num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    written = tmp_path / "probes.json"
    if not enabled:
        assert not written.exists() and probes.result is None and probes.seconds == 0.0
        return
    result = json.loads(written.read_text())
    assert result["step"] == 2 and result["batches"] == 2 and len(result["layer_effect"]) == 4
    assert (tmp_path / "plots" / "routing.png").is_file() and (tmp_path / "plots" / "layer_knockout.png").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert {"probe/routing", "probe/layer_knockout"} <= set(acc.Tags()["images"])
    assert {"probe/routing_data", "probe/layer_knockout_data"} <= set(acc.Tags()["tensors"])
    assert module.model.residual._knockout is None


@pytest.mark.parametrize("bad", [{"enabled": "yes"}, {"batches": 0}, {"mode": "zero"}, {"layers": 1},
                                 {"max_stack": 0}])
def test_callback_options_are_checked(bad):
    from attnres.training.routing import RoutingProbes

    with pytest.raises(ValueError, match=r"callbacks\.routing_probes\."):
        RoutingProbes(**bad)


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_script("experiments/probe_routing.py", *args, cwd=cwd, timeout=300)


def test_script_refuses_what_it_cannot_probe(tmp_path):
    missing = _script(str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
    empty = _script(str(tmp_path), cwd=tmp_path)
    assert empty.returncode == 2 and "no run folders under" in empty.stderr
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("data: {_target_: nowhere.Nothing}\n")
    broken = _script(str(tmp_path / "run"), cwd=tmp_path)
    assert broken.returncode == 1 and "skipped: cannot rebuild the model" in broken.stderr
    bad = _script(str(tmp_path / "run"), "--batches", "0", cwd=tmp_path)
    assert bad.returncode == 2 and "--batches must be >= 1" in bad.stderr


@pytest.mark.slow
def test_script_on_a_sweep_of_real_runs(strategy_runs, tmp_path):
    runs = tmp_path / "runs"  # copies of the shared runs: the script writes into their folders
    for name in ("standard", "block"):
        copy_run(strategy_runs[name].dir, runs / name)
    for _ in range(2):  # the same command twice: the same files, one probe event file per run
        done = _script(str(runs), "--batches", "1", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert "mass-vs-effect rank correlation per sublayer" in done.stdout
    reused = _script(str(runs), "--batches", "1", "--reuse", cwd=tmp_path)
    assert reused.returncode == 0 and reused.stdout.count("from its probes.json") == 2, reused.stdout
    again = _script(str(runs), "--batches", "2", "--reuse", cwd=tmp_path)  # other settings: probed again
    assert again.returncode == 0 and "from its probes.json" not in again.stdout
    for name in ("standard", "block"):
        result = json.loads((runs / name / "probes.json").read_text())
        assert result["step"] == RUN_STEPS and len(result["layer_effect"]) == 4 and result["batches"] == 2
        assert (runs / name / "plots" / "layer_knockout.png").is_file()
        assert len(list((runs / name).glob("events.out.tfevents.*.probe_routing"))) == 1
    assert (runs / "block" / "plots" / "routing.png").is_file()
    assert not (runs / "standard" / "plots" / "routing.png").exists()
    assert (runs / "plots" / "compare_layer_knockout.png").is_file()
