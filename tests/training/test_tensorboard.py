"""The TensorBoard side of a run (attnres/training/tensorboard.py), on the shared CLI runs: the
HParams table with the final metrics and every column filled, runs named by their folders, and the
scalars that open on the losses."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import RUN_N_LAYER as N_LAYER
from tests.helpers import RUN_NUM_BLOCKS as N
from tests.helpers import RUN_STEPS as STEPS


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "block"])
def test_hparams_with_final_metrics(strategy_events, strategy_runs, residual):
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = strategy_events[residual]
    content = acc.PluginTagToContent("hparams")
    assert set(content) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hp = start.hparams
    assert hp["residual"].string_value == residual
    assert hp["n_layer"].string_value == str(N_LAYER) and hp["seed"].string_value == "0"  # integers as integers
    assert hp["lr"].number_value == 3e-3 and hp["stage"].string_value == "run"
    assert hp["model"].string_value == "tiny" and int(hp["parameters"].string_value) > 0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {"residual", "num_blocks", "n_layer", "n_embd", "seed", "lr", "query_lr_scale"} <= {
        h.name for h in experiment.hparam_infos}
    assert {"Val/loss", "Val/accuracy"} <= {m.name.tag for m in experiment.metric_infos}
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == 1  # STATUS_SUCCESS
    # TensorBoard fills the metric columns with each tag's last value: the final validation
    final = json.loads((strategy_runs[residual].dir / "metrics.json").read_text())["metrics"]
    assert acc.Scalars("Val/loss")[-1].value == pytest.approx(final["val/loss"])
    assert acc.Scalars("Val/loss")[-1].step == STEPS  # the validation after the last step, at the steps taken


def _hparams(acc):
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    return experiment, start.hparams


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_hparams_declare_only_metrics_the_run_logs(strategy_events, residual):
    acc = strategy_events[residual]
    experiment, _ = _hparams(acc)
    declared = [m.name.tag for m in experiment.metric_infos]
    assert set(declared) <= set(acc.Tags()["scalars"])  # every metric column has values
    assert declared == ["Val/loss", "Val/accuracy", "Train/loss"]  # synthetic data: accuracy, no bpb


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_hparams_columns_are_filled_and_the_swept_ones_shown(strategy_events, residual):
    experiment, hp = _hparams(strategy_events[residual])
    declared = {h.name for h in experiment.hparam_infos}
    assert declared == set(hp)  # no run leaves a column empty (TensorBoard drops it from the parallel coordinates)
    assert all(v.WhichOneof("kind") is not None for v in hp.values())
    assert hp["num_blocks"].string_value == (str(N) if residual == "block" else "0")  # not 0.0000
    assert {h.name for h in experiment.hparam_infos if h.differs} == {"residual", "num_blocks", "seed"}


@pytest.mark.slow
def test_tensorboard_names_runs_by_their_folders(strategy_runs):
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    sweep = strategy_runs["standard"].dir.parent  # the runs' common folder
    for name in strategy_runs:
        assert list((sweep / name).glob("events.out.tfevents.*")) and not (sweep / name / "tb").exists()
        assert not (sweep / name / "hparams.yaml").exists()
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(sweep))
    mux.Reload()
    assert set(mux.Runs()) == set(strategy_runs)  # run names are the run folders: no trailing /tb
    assert set(mux.PluginRunToTagToContent("hparams")) == {"standard", "full", "block"}  # HParams finds them


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block", "no_callbacks"])
def test_scalars_open_on_the_losses(strategy_events, residual):
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = strategy_events[residual]
    scalars = acc.Tags()["scalars"]
    assert "epoch" not in scalars and not any(t.startswith(("train/", "val/")) for t in scalars)
    groups = list(dict.fromkeys(t.split("/", 1)[0] for t in sorted(scalars)))  # TensorBoard's order of groups
    assert groups[:2] == ["Train", "Val"] and len(groups) > 2
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    first = layout.category[0]
    regexes = [c.multiline.tag[0] for c in first.chart]
    assert regexes == ["^Train/loss$", "^Val/loss$", "^Val/accuracy$"]
    assert [c.title for c in first.chart] == ["Train/loss", "Val/loss", "Val/accuracy"]
    for regex in regexes:
        assert [t for t in scalars if re.match(regex, t)]  # every chart has a line


@pytest.mark.slow
def test_one_step_count_everywhere(tmp_path):
    """Issue "The first hour, round two", item 5: in a 20-step run whose log said step 20, the
    losses, Val/bpb (so summary.png) and grad_norm.png were at step 19, heatmap.png at 20. Every
    step is now the number of optimiser steps taken."""
    from tests.helpers import event_accumulator, metrics, run_cli, run_script, tiny

    ran = run_cli(*tiny("residual=block", "num_blocks=2", "callbacks.depth_dashboard.every_n_steps=10",
                        "trainer.log_every_n_steps=5", data="stdlib", steps=20, val_every=10, progress_bar=False,
                        logger=True), "hydra.run.dir=R", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "  steps 20, " in ran.stdout and metrics(tmp_path / "R")["steps"] == 20
    acc = event_accumulator(tmp_path / "R")
    assert [e.step for e in acc.Scalars("Train/loss")] == [5, 10, 15, 20]
    for tag in ("Val/loss", "Val/bpb"):
        assert [e.step for e in acc.Scalars(tag)] == [10, 20], tag
    assert [e.step for e in acc.Scalars("grad_norm/layer_00")] == [1, 10, 20]  # the first step's, then every 10
    for tag in ("depth/heatmap_data", "magnitude/plot_data"):
        assert [e.step for e in acc.Tensors(tag)] == [0, 10, 20], tag  # the weights after 0, 10 and 20 steps
    assert "step" not in metrics(tmp_path / "R")["metrics"]
    plotted = run_script("experiments/plot_run.py", str(tmp_path / "R"), cwd=tmp_path, timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    for name in ("heatmap.png", "magnitude.png", "grad_norm.png"):
        assert f"{name} (step 20)" in plotted.stdout, plotted.stdout


def _tuned_sweep(root):
    """A tuned sweep's folder as its sweeper leaves it: trials under tuning/, the verdict's runs and
    the shared-lr runs beside them, the trial names its planning wrote."""
    from attnres.atomic import write_json

    sweep = root / "quick"
    trial = "tuning/optim.optimizer.lr=0.0015,residual=block,seed=1000"
    verdict, shared = "optim.optimizer.lr=0.012,residual=block,seed=0", "residual=block,seed=0"
    for name in (trial, verdict, shared):
        (sweep / name).mkdir(parents=True)
    write_json(sweep / "tuning" / "tuning.json", {"arms": [{"untuned_jobs": {"0": shared}, "jobs": {"0": verdict}}]})
    write_json(sweep / "trial_names.json", {
        trial: "optim.optimizer.lr=0.0015,residual=block,seed=1000 (quick)",
        verdict: "optim.optimizer.lr=0.012,residual=block,seed=0 (quick)", shared: "residual=block,seed=0 (quick)"})
    return sweep, trial, verdict, shared


def test_a_tuned_sweeps_hparams_tick_the_searched_key_name_trials_readably_and_say_the_stage(tmp_path, monkeypatch):
    """Issue "The first hour, round two", item 6: the HParams tab of a tuned sweep left lr unticked while
    constant keys were ticked, cut every trial's name to `optim.optimizer....`, mixed trials and verdict
    runs without a stage column; num_blocks read 0.0000 for the standard residual, seeds as floats."""
    from attnres.config.naming import SWEPT_ENV
    from attnres.training.tensorboard import column_value, run_stage, short_trial_name, sweep_varying

    monkeypatch.delenv(SWEPT_ENV, raising=False)
    sweep, trial, verdict, shared = _tuned_sweep(tmp_path)
    assert [run_stage(sweep / n) for n in (trial, verdict, shared)] == ["search", "verdict", "shared lr"]
    assert run_stage(tmp_path / "alone") == "run"
    configured = ["residual", "num_blocks", "seed"]
    values = {"residual": "block", "num_blocks": "2", "model": "tiny", "seed": "0", "lr": 0.012, "batch_size": "4",
              "stage": "verdict"}
    for name in (trial, verdict, shared):  # every run of the sweep declares the same columns as differing
        assert sweep_varying(sweep / name, values, configured) == [*configured, "lr", "stage"]
    assert sweep_varying(tmp_path / "alone", {**values, "stage": "run"}, configured) == configured
    assert short_trial_name(sweep / trial) == "block lr=0.0015 seed=1000 (quick)"
    assert short_trial_name(sweep / shared) == "block seed=0 (quick)"
    assert short_trial_name(tmp_path / "alone") is None
    assert [column_value(v) for v in (0, 1000, None, 3e-3, True, "block")] == ["0", "1000", "-", 3e-3, True, "block"]
