"""What a sweep shows besides its jobs' results (attnres/sweep/launcher.py, plan.py): no raw
`Joblib.Parallel(...)` call in its log, and each job named in TensorBoard's HParams table by what
differs between the jobs (`trial_names.json`, written when the sweep is planned, read by the job's
`HParamsSummary`)."""

from __future__ import annotations

import logging

import pytest

from attnres.results.summary import find_job_dirs, job_labels, job_overrides
from attnres.training.tensorboard import hparams_summaries
from tests import helpers

JOBLIB_LINE = "Joblib.Parallel(n_jobs=2,backend=loky,prefer=processes) is launching 4 jobs"


def test_the_joblib_call_is_not_logged(caplog):
    import attnres.sweep.launcher  # noqa: F401  (it quiets the joblib launcher's logger)

    joblib_log = logging.getLogger("hydra_plugins.hydra_joblib_launcher._core")
    with caplog.at_level(logging.INFO):
        joblib_log.info(JOBLIB_LINE)
        joblib_log.info("Launching jobs, sweep output dir : multirun/quick")
    assert "Joblib.Parallel(" not in caplog.text and "Launching jobs" in caplog.text


def test_a_trial_name_is_the_session_group_tensorboard_shows():
    from tensorboard.plugins.hparams import plugin_data_pb2

    _, start, _ = hparams_summaries({"seed": 0}, ["Val/loss"], trial="residual=block,seed=0 (quick)")
    data = plugin_data_pb2.HParamsPluginData.FromString(start.value[0].metadata.plugin_data.content)
    assert data.session_start_info.group_name == "residual=block,seed=0 (quick)"
    _, alone, _ = hparams_summaries({"seed": 0}, ["Val/loss"])  # a run alone: TensorBoard names it by folder
    assert plugin_data_pb2.HParamsPluginData.FromString(
        alone.value[0].metadata.plugin_data.content).session_start_info.group_name == ""


@pytest.mark.slow
def test_a_real_sweep_names_its_trials_and_logs_no_joblib_call(tmp_path):
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    args = ["-m", *helpers.tiny(steps=2, logger=True, progress_bar=False), "residual=standard,block", "num_blocks=2",
            "seed=0,1", "hydra.sweep.dir=multirun/quick", "hydra.launcher.cpu_jobs=1",
            f"hydra.launcher.lock_dir={tmp_path}/locks"]
    done = helpers.run_cli(*args, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Joblib.Parallel(" not in done.stdout + done.stderr and "Launching jobs" in done.stdout
    runs = {path.name: path for path in find_job_dirs(tmp_path / "multirun" / "quick")}
    labels = job_labels({name: job_overrides(path) for name, path in runs.items()})
    assert sorted(labels.values()) == [f"residual={r},seed={s}" for r in ("block", "standard") for s in (0, 1)]
    for name, path in runs.items():
        content = helpers.event_accumulator(path).SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content
        group = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.group_name
        short = labels[name].replace("residual=", "").replace(",", " ")  # the strategy bare, then each key
        assert group == f"{short} (quick)", (name, group)
