"""Routing probes and the depth dashboard under trainer.precision=bf16-mixed: a tiny CPU run whose
probes and recordings must run as they do in float32 (the embedding is float32 there, the
sublayer outputs bfloat16, and the probe once refused to mix them)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO, metrics, run_cli, tiny


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_probes_and_dashboard_run_under_bf16_mixed(tmp_path):
    run = tmp_path / "run"
    args = tiny("residual=block", "num_blocks=2", "trainer.precision=bf16-mixed",
                "callbacks.routing_probes.enabled=true", "callbacks.routing_probes.batches=2",
                "callbacks.depth_dashboard.every_n_steps=2", f"hydra.run.dir={run}",
                batch_size=4, val_batches=2, steps=4, val_every=4, progress_bar=False, logger=True)
    result = run_cli(*args, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(run)["status"] == "finished"
    log = (run / "attnres.log").read_text()
    warned = [line for line in log.splitlines() if "WARNING" in line]
    assert not warned, warned  # "routing probes failed and were skipped: ... share dtype ..." before the fix
    assert "dtype" not in result.stderr, result.stderr[-3000:]

    probe = json.loads((run / "probes.json").read_text())
    assert probe["strategy"] and probe["batches"] == 2 and probe["tokens"] > 0
    assert len(probe["layer_effect"]) == 4 and all(v is not None for v in probe["layer_effect"])
    effects = [v for row in probe["source_effect"] for v in row if v is not None]
    assert effects, probe["source_effect"]  # the rows with two or more sources were knocked out
    assert (run / "plots" / "routing.png").is_file() and (run / "plots" / "layer_knockout.png").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    images = set(acc.Tags()["images"])
    assert {"probe/routing", "probe/layer_knockout"} <= images, images
    assert {"depth/heatmap", "magnitude/plot"} <= images, images  # the depth dashboard recorded too
