"""Trackers (attnres/training/trackers.py, conf/logger/): real stores read back with the libraries' own
readers. A 2-job sweep logging to MLflow and W&B gives one MLflow run per job in a SQLite store (read
with MlflowClient: names, params, metrics, final numbers, the sweep's verdict as the experiment's
note) and one offline W&B run per job, grouped by the sweep and finished (the offline .wandb file
decoded into wandb's own protobuf records), plus a run with the sweep's verdict. A resumed CSV run
keeps its rows; a logger whose library is missing is one line naming the extra. Nothing touches
the network: W&B is offline, both libraries' telemetry is off."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import CONF, run_cli, tiny

#: the tiny run, with the logger left to each test
TINY = tiny(progress_bar=False, logger=True)

#: no network, no telemetry, no W&B console chatter (every run of these tests gets them)
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
           "WANDB_DISABLE_GIT": "true", "WANDB_BASE_URL": "http://127.0.0.1:9", "MLFLOW_DISABLE_TELEMETRY": "true",
           "DO_NOT_TRACK": "true"}
STORE = "sqlite:///outputs/mlflow.db"  # conf/logger/mlflow.yaml's default, relative to where the sweep starts


# -- reading an offline W&B run -----------------------------------------------------------------
def wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file, decoded with wandb's own protobuf classes. The
    file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks
    of chunks (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) that never span a block."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding up to the block's end
            pos += (block - pos % block) % block
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(folder: Path) -> dict:
    """What an offline run folder holds: its run record, config, summary, exit code, metric keys."""
    files = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"{folder}: {files}"
    out: dict = {"config": {}, "summary": {}, "history_keys": set(), "exit_code": None}
    import json

    def key(item) -> str:  # newer wandb writes a metric's name as nested_key
        return item.key or "/".join(item.nested_key)

    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
        elif kind == "config":
            out["config"].update({key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "summary":
            out["summary"].update({key(u): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "history":
            out["history_keys"].update(key(item) for item in record.history.item)
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


# -- a 2-job sweep into MLflow and W&B ----------------------------------------------------------
@pytest.fixture(scope="module")
def tracked_sweep(tmp_path_factory):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("tracked")
    loggers = ["logger=many", "~logger.tensorboard", "~logger.csv"]  # MLflow and W&B
    result = run_cli("-m", *TINY, "trainer.max_steps=3", "trainer.val_check_interval=3", "residual=standard,block",
                     "num_blocks=2", *loggers, "name=tracked", cwd=root, env=OFFLINE, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result


@pytest.mark.slow
def test_mlflow_store_holds_one_run_per_job_with_params_metrics_and_the_verdict(tracked_sweep):
    from mlflow.tracking import MlflowClient

    root, result = tracked_sweep
    client = MlflowClient(STORE.replace("sqlite:///", f"sqlite:///{root}/"))
    experiment = client.get_experiment_by_name("multirun/tracked")  # the sweep's folder names its experiment
    assert experiment is not None, [e.name for e in client.search_experiments()]
    runs = {Path(r.data.tags["attnres_run_dir"]).name: r for r in client.search_runs([experiment.experiment_id])}
    jobs = sorted(p.name for p in (root / "multirun/tracked").iterdir() if (p / "metrics.json").is_file())
    assert sorted(runs) == jobs and len(jobs) == 2
    for name, run in runs.items():
        assert run.info.status == "FINISHED"
        # named after its folder while it runs, then after the summary's short label (what differs)
        assert run.info.run_name == ("residual=block" if "residual=block" in name else "residual=standard")
        params = run.data.params
        block = "residual=block" in name
        assert params["residual"] == ("block" if block else "standard")
        assert params["num_blocks"] == ("2" if block else "0") and params["seed"] == "0"
        assert params["optimizer"] == "AdamW" and all(len(v) <= 250 for v in params.values())
        history = client.get_metric_history(run.info.run_id, "val/loss")
        assert [m.step for m in history][-1] == 3
        metrics = run.data.metrics
        assert metrics["run/steps"] == 3 and metrics["run/tokens_per_sec"] > 0 and "train/loss" in metrics
        assert run.data.tags["attnres_sweep"] == "multirun/tracked" and run.data.tags["attnres_status"] == "finished"
        assert run.data.tags["attnres_run_dir"] == str(root / "multirun/tracked" / name)
    verdicts = [line.removeprefix("verdict: ") for line in result.stdout.splitlines() if line.startswith("verdict: ")]
    assert verdicts and verdicts[0].startswith("block vs standard")
    tags = client.get_experiment(experiment.experiment_id).tags
    assert tags["attnres_verdict_0"] == verdicts[0]
    note = tags["mlflow.note.content"]  # the experiment's description: the verdicts first, then summary.md
    assert note.startswith(f"verdict: {verdicts[0]}") and "## Jobs" in note


@pytest.mark.slow
def test_wandb_offline_runs_one_per_job_grouped_by_the_sweep_and_finished(tracked_sweep):
    root, result = tracked_sweep
    sweep = root / "multirun/tracked"
    jobs = sorted(p for p in sweep.iterdir() if (p / "metrics.json").is_file())
    ids = set()
    for job in jobs:
        run = wandb_run(job)
        ids.add(run["run"].run_id)
        assert run["run"].display_name == job.name and run["run"].run_group == "multirun/tracked"
        assert run["run"].project == "attnres" and run["run"].job_type == "train"
        assert run["config"]["residual"] == ("block" if "residual=block" in job.name else "standard")
        assert run["config"]["seed"] == 0 and list(run["config"])[:3] == ["residual", "num_blocks", "seed"]
        assert run["exit_code"] == 0, "the job did not finish its own W&B run"
        assert {"val/loss", "train/loss"} <= run["history_keys"]
        assert run["summary"]["run/steps"] == 3 and run["summary"]["run/status"] == "finished"
    assert len(ids) == 2, "the jobs were merged into one W&B run"
    summary = wandb_run(sweep)  # the sweep's own run, in the same group
    assert summary["run"].job_type == "summary" and summary["run"].run_group == "multirun/tracked"
    verdicts = [line.removeprefix("verdict: ") for line in result.stdout.splitlines() if line.startswith("verdict: ")]
    assert summary["run"].notes == "\n".join(verdicts) and summary["summary"]["verdict/0"] == verdicts[0]
    assert "wandb sync" in (jobs[0] / "train.log").read_text()  # the job's end block says how to upload


@pytest.mark.slow
def test_two_runs_in_one_process_are_two_wandb_runs(tmp_path, monkeypatch):
    """Each run finishes its own W&B run, so a second run in the same process (the basic launcher's
    way, or a notebook's) starts a new one instead of logging into the first."""
    wandb = pytest.importorskip("wandb")
    from attnres.training.trackers import WandbLogger, finish_trackers

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    for name in ("a", "b"):
        logger = WandbLogger(save_dir=str(tmp_path / name), run_dir=str(tmp_path / name), sweep="multirun/x",
                             hparams={"residual": name, "seed": 0})
        (tmp_path / name).mkdir()
        logger.log_hyperparams({})
        logger.log_metrics({"train/loss": 1.0}, step=1)
        logger.finalize("success")  # Lightning's call at the end of fit: the run waits for its final numbers
        assert wandb.run is not None
        finish_trackers([logger], {"status": "finished", "steps": 1, "metrics": {"val/loss": 0.5}})
        assert wandb.run is None, "the run was not finished"
    wandb.teardown()  # the service writes the run files out
    runs = [wandb_run(tmp_path / name) for name in ("a", "b")]
    assert runs[0]["run"].run_id != runs[1]["run"].run_id and [r["exit_code"] for r in runs] == [0, 0]
    assert [r["config"]["residual"] for r in runs] == ["a", "b"] and runs[1]["summary"]["val/loss"] == 0.5


@pytest.mark.slow
def test_an_mlflow_run_killed_is_marked_and_tied_to_the_run_that_continues_it(tmp_path):
    """Issue "Trust, round three", item 11: a SIGKILLed run stayed RUNNING for ever, and its
    resume=true opened a second MLflow run that nothing linked to the first."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from tests.helpers import faultinject_env

    common = [*TINY, "logger=mlflow", "trainer.val_check_interval=2", "trainer.max_steps=6", "hydra.run.dir=R"]
    killed = run_cli(*common, "+callbacks.fault._target_=faultinject.KillAt", "+callbacks.fault.step=3",
                     cwd=tmp_path, env={**OFFLINE, **faultinject_env()})
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_cli(*common, "resume=true", cwd=tmp_path, env=OFFLINE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the end block names the page that opens the experiment on its runs (MLflow 3's UI starts on GenAI)
    assert "then open http://127.0.0.1:5000/#/experiments/1?workflowType=machine_learning  (run R)" in resumed.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/outputs/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "default"]
    first, second = sorted(client.search_runs([experiment.experiment_id]), key=lambda r: r.info.start_time)
    assert first.info.status == "KILLED" and first.data.tags["attnres_status"] == "killed"
    assert second.info.status == "FINISHED" and second.data.tags["attnres_status"] == "finished"
    assert second.data.tags["attnres_continues"] == first.info.run_id
    assert first.data.tags["attnres_continued_in"] == second.info.run_id
    assert first.data.tags["attnres_run_dir"] == second.data.tags["attnres_run_dir"] == str(tmp_path / "R")
    # MLflow 3's UI opens an experiment of this kind on its runs, not on an empty GenAI traces page
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


# -- CSV -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_csv_run_writes_metrics_and_hparams_and_a_resume_appends(tmp_path):
    common = [*TINY, "logger=csv", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "hydra.run.dir=R"]
    first = run_cli(*common, "trainer.max_steps=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (tmp_path / "R/metrics.csv").read_text().splitlines()
    assert {"step", "train/loss", "val/loss", "lr/no_decay"} <= set(before[0].split(",")) and len(before) > 1
    second = run_cli(*common, "trainer.max_steps=4", "resume=true", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    after = (tmp_path / "R/metrics.csv").read_text().splitlines()
    column = after[0].split(",").index("step")
    assert after[1:len(before)] == before[1:], "the resumed run lost the rows of the first"
    first, resumed = ([int(row.split(",")[column]) for row in rows] for rows in (before[1:], after[len(before):]))
    assert resumed and min(resumed) >= max(first) and max(resumed) > max(first), (first, resumed)
    hparams = OmegaConf.load(tmp_path / "R/hparams.yaml")
    assert list(hparams)[:3] == ["residual", "num_blocks", "seed"] and hparams.max_steps == 4


# -- choices and values ----------------------------------------------------------------------------
@pytest.mark.parametrize(("choice", "library"), [("mlflow", "mlflow"), ("wandb", "wandb"), ("many", "wandb")])
def test_a_logger_whose_library_is_missing_is_one_line_naming_the_extra(choice, library, monkeypatch, capsys):
    from attnres.config.command import check_command_line
    from attnres.config.errors import user_errors

    if choice == "many":  # the other tracker's library must be there, or the line names it first
        pytest.importorskip("mlflow", reason="logger=many without wandb, with mlflow: needs the mlflow extra")
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed: find_spec fails, import fails
    with pytest.raises(SystemExit) as stop, user_errors():
        check_command_line([f"logger={choice}"], CONF)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("attnres-run: error: logger.") and \
        f"pip install 'attnres[{library}]'" in err


def test_hparams_are_the_hparams_tab_s_with_the_varied_columns_first_and_cut_to_250():
    from attnres.training.trackers import tracked_hparams

    cfg = OmegaConf.create({
        "seed": 3, "optim": {"optimizer": {"_target_": "attnres.training.optimizers.MuonWithAdamW", "lr": 1e-3,
                                           "muon": {"lr": 0.02}}},
        "callbacks": {"hparams": {"hparams": {"model": "tiny", "data": "x" * 400, "seed": "${seed}",
                                              "num_blocks": 4, "residual": "block"},
                                  "varying": ["residual", "num_blocks", "seed"]}}})
    values = tracked_hparams(cfg)
    assert list(values)[:3] == ["residual", "num_blocks", "seed"] and values["seed"] == 3
    assert values["data"] == "x" * 250 and values["optimizer"] == "MuonWithAdamW" and values["muon_lr"] == 0.02
    bare = tracked_hparams(OmegaConf.create({"seed": 1, "residual": {"num_blocks": 2}}), {"residual": "block"})
    assert list(bare)[:3] == ["residual", "num_blocks", "seed"] and bare["num_blocks"] == 2


def test_the_logger_files_compose_and_many_is_every_logger():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        many = compose("config", overrides=["logger=many"])
        pair = compose("config", overrides=["logger=many", "~logger.csv", "~logger.wandb"])  # as the YAML says
    assert list(many.logger) == ["tensorboard", "csv", "mlflow", "wandb"]
    assert list(pair.logger) == ["tensorboard", "mlflow"]
    assert many.logger.mlflow.tracking_uri == STORE and many.logger.wandb.mode == "offline"
