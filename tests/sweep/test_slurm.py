"""The SLURM launcher (attnres/sweep/slurm.py): how it reads partitions and fits requests (no
cluster needed), and, marked `slurm`, tiny sweeps through a real single-node SLURM cluster
(`experiments/slurm/cluster.sh up`; skipped, with the reason, where none answers): a normal job,
one cancelled while running and one while pending, one requeued mid-run and one warned of its
time limit (SIGUSR2), both continued to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnres.config.errors import ConfigError
from attnres.results.summary import collect_rows

slurm = pytest.importorskip("attnres.sweep.slurm", reason="needs the slurm extra (hydra-submitit-launcher)")
from attnres.sweep import slurm_resources  # noqa: E402  (after the skip: the same extra)
from tests.helpers import CLI, REPO, cli_env, run_cli, tiny  # noqa: E402

CLUSTER = REPO / "experiments" / "slurm" / "cluster.sh"


# -- no cluster needed -----------------------------------------------------------------------------
def test_time_limits_and_gres_as_sinfo_prints_them():
    assert slurm_resources.parse_time_limit("infinite") == math.inf
    assert slurm_resources.parse_time_limit("30") == 30
    assert slurm_resources.parse_time_limit("1:30") == 1.5
    assert slurm_resources.parse_time_limit("2:00:00") == 120
    assert slurm_resources.parse_time_limit("1-00:30:00") == 24 * 60 + 30
    assert slurm_resources.parse_gpus("(null)") == 0
    assert slurm_resources.parse_gpus("gpu:4") == 4
    assert slurm_resources.parse_gpus("gpu:a100:8(S:0-1)") == 8
    assert slurm_resources.parse_gpus("gpu:a100:2,gpu:v100:2,shard:8") == 4


def launcher_params(**kw):
    params = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "hydra" / "launcher" / "slurm.yaml"))
    params.pop("_target_")
    return {**params, "submitit_folder": "x", "name": "attnres", **kw}


def run_config(accelerator="cpu", devices=1, workers=0):
    return OmegaConf.create({"trainer": {"accelerator": accelerator, "devices": devices},
                             "data": {"num_workers": workers}})


SMALL = slurm_resources.Partition("debug", cpus=2, mem_mb=8000, gpus=0, max_time_min=60)
GPUS = slurm_resources.Partition("gpu", cpus=64, mem_mb=512_000, gpus=8, max_time_min=math.inf)


def test_derived_resources_fit_the_runs_and_the_partition(caplog):
    cpu = slurm_resources.fit_resources(launcher_params(timeout_min=15), [run_config("cpu", 1, 2)], SMALL)
    assert cpu["gpus_per_node"] is None  # a CPU job never asks sbatch for GPUs
    assert cpu["cpus_per_task"] == 2 and cpu["mem_gb"] == 4  # 1 + 2 workers, capped to the node's 2
    assert "asking for 2" in caplog.text
    auto = slurm_resources.fit_resources(launcher_params(), [run_config("auto", 1), run_config("auto", 2)], GPUS)
    assert auto["gpus_per_node"] == 2 and auto["cpus_per_task"] == 2 and auto["mem_gb"] == 8
    auto_small = slurm_resources.fit_resources(launcher_params(timeout_min=15), [run_config("auto")], SMALL)
    assert auto_small["gpus_per_node"] is None
    every = slurm_resources.fit_resources(launcher_params(), [run_config("gpu", "auto")], GPUS)
    assert every["gpus_per_node"] == 8


@pytest.mark.parametrize(("override", "words"), [
    ({"cpus_per_task": 8}, "hydra.launcher.cpus_per_task=8 is more than the 2 CPUs"),
    ({"mem_gb": 64}, "hydra.launcher.mem_gb=64 is more than the 7 GB of memory"),
    ({"gpus_per_node": 1}, "hydra.launcher.gpus_per_node=1 is more than the 0 GPUs"),
    ({"timeout_min": 240}, "timeout_min=240 is more than partition debug's time limit of 60 min"),
    ({"timeout_min": 15, "signal_delay_s": 900}, "signal_delay_s=900 must be"),
    ({"timeout_min": 15, "cpus_per_task": "two"}, "cpus_per_task='two' must be a number"),
])
def test_requests_no_node_can_meet_are_refused_in_one_line(override, words):
    with pytest.raises(ConfigError, match=words) as err:
        slurm_resources.fit_resources(launcher_params(**{"timeout_min": 15, **override}), [run_config()], SMALL)
    assert "\n" not in str(err.value)


def test_a_gpu_run_on_a_partition_without_gpus_is_refused():
    with pytest.raises(ConfigError, match="trainer.accelerator=cpu to train on the CPU"):
        slurm_resources.fit_resources(launcher_params(timeout_min=15), [run_config("gpu")], SMALL)


class FakeJob:
    """What `slurm.job_outcome` reads of a submitit job: its id and where its result file would be."""

    def __init__(self, folder: Path, outcome=None) -> None:
        self.job_id = "7_1"
        self.paths = type("Paths", (), {"result_pickle": folder / "7_1_result.pkl"})()
        if outcome is not None:
            import cloudpickle

            self.paths.result_pickle.write_bytes(cloudpickle.dumps(outcome))


class SleeplessClock:
    """attnres.sweep.slurm's clock here: a sleep moves it on at once, so the wait for a result file that
    never comes (2 s for a job that ended as cancelled, timed out, preempted, out of memory or lost)
    runs its loop without waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def job_config(tmp_path: Path) -> OmegaConf:
    return OmegaConf.create({
        "seed": 0, "trainer": {"accelerator": "cpu"},
        "hydra": {"sweep": {"dir": str(tmp_path), "subdir": "seed=0"}, "overrides": {"task": ["seed=0"]},
                  "launcher": {"timeout_min": 5, "max_num_timeout": 3, "mem_gb": 4},
                  "runtime": {"choices": {"residual": "standard"}},
                  "job": {"config": {"override_dirname": {"exclude_keys": ["name"]}}}}})


@pytest.mark.parametrize(("state", "started", "outcome", "status", "words"), [
    ("CANCELLED", False, None, "cancelled", "before it started"),
    (None, False, None, "cancelled", "before it started"),  # cancelled while pending: no accounting record
    ("CANCELLED", True, None, "cancelled", "while running"),
    ("TIMEOUT", True, None, "timed out", "time limit (5 min"),
    ("PREEMPTED", True, None, "preempted", "not requeued"),
    ("OUT_OF_MEMORY", True, None, "failed", "raise hydra.launcher.mem_gb"),
    ("NODE_FAIL", True, None, "lost", "state NODE_FAIL"),
    (None, True, None, "lost", "state not recorded"),
    ("FAILED", True, ("error", "Traceback\nUncompletedJobError: Job not requeued because: timed-out too many times."),
     "timed out", "timed out 3 time(s)"),
    ("FAILED", True, ("error", "Traceback\nRuntimeError: boom"), "failed", "RuntimeError: boom"),
])
def test_a_job_that_ended_without_saying_how_gets_a_status(tmp_path, monkeypatch, state, started, outcome, status,
                                                          words):
    monkeypatch.setattr(slurm, "RESULT_WAIT_S", 0)
    monkeypatch.setattr(slurm, "time", SleeplessClock())
    run = tmp_path / "seed=0"
    if started:  # an interrupted run: its metrics stay, its status is replaced
        run.mkdir()
        (run / "slurm.json").write_text('{"job_id": "7_1"}')
        (run / "metrics.json").write_text('{"status": "interrupted", "steps": 52}')
    assert slurm.job_outcome(FakeJob(tmp_path, outcome), job_config(tmp_path), tmp_path, state) is None
    written = json.loads((run / "metrics.json").read_text())
    assert written["status"] == status and words in written["error"], written
    assert written["slurm"] == {"job_id": "7_1", "state": state}
    if started:
        assert written["steps"] == 52
    rows = collect_rows(tmp_path)  # the summary has its row, even for a job that never started
    assert [r["status"] for r in rows] == [status]


def test_a_job_that_returned_keeps_its_own_status(tmp_path):
    run = tmp_path / "seed=0"
    run.mkdir()
    (run / "metrics.json").write_text('{"status": "finished"}')
    assert slurm.job_outcome(FakeJob(tmp_path, ("success", "its JobReturn")), job_config(tmp_path), tmp_path,
                             "COMPLETED") == "its JobReturn"
    assert json.loads((run / "metrics.json").read_text()) == {"status": "finished"}


def test_a_requeued_slurm_job_continues_its_own_run(tmp_path, monkeypatch):
    """attnres/sweep/slurm_job.py, no cluster: the task id as sacct names it, its CPUs, and a job
    that finds its own unfinished run continues it (resume=true), its finished run does nothing,
    another job's run is left to the usual refusal."""
    from attnres.sweep import slurm_job

    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID", "SUBMITIT_EXECUTOR",
                 "SLURM_CPUS_PER_TASK", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert slurm_job.current_job_id() is None and not slurm_job.in_slurm_job() and slurm_job.job_threads() is None
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert slurm_job.current_job_id() == "41" and not slurm_job.in_slurm_job()  # not submitit's
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert slurm_job.current_job_id() == "7_1" and slurm_job.in_slurm_job() and slurm_job.job_threads() == 3

    run = tmp_path / "run"
    run.mkdir()
    cfg = OmegaConf.create({"resume": False, "overwrite": False})
    assert slurm_job.continue_own_run(cfg, run) and cfg.resume is False  # a fresh folder: a fresh run
    assert json.loads((run / "slurm.json").read_text())["job_id"] == "7_1"
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: its own run, unfinished
    assert slurm_job.continue_own_run(cfg, run) and cfg.resume is True
    assert json.loads((run / "slurm.json").read_text())["restarts"] == 1
    (run / "metrics.json").write_text('{"status": "finished"}')
    assert not slurm_job.continue_own_run(OmegaConf.create({"resume": False, "overwrite": False}), run)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")  # another task: not its run
    other = OmegaConf.create({"resume": False, "overwrite": False})
    assert slurm_job.continue_own_run(other, run) and other.resume is False


# -- a real cluster ----------------------------------------------------------------------------------
TINY = tiny("callbacks.periodic_checkpoint.every_n_steps=50", "callbacks.depth_dashboard.every_n_steps=1000",
            val_every=400)
LONG = 400  # steps of the runs that get cancelled, requeued or timed out (tens of seconds on 2 cores)


def cluster_reason() -> str | None:
    """Why the slurm tests cannot run here, or None when a cluster answers."""
    if shutil.which("sinfo") is None:
        return "no SLURM here (sinfo missing); `experiments/slurm/cluster.sh up` starts a local one"
    status = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    if status.returncode != 0:
        return f"no SLURM cluster answers: {status.stderr.strip()}; `experiments/slurm/cluster.sh up` starts one"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = cluster_reason()
    if reason:
        pytest.skip(reason)


class Sweep:
    """`attnres-run -m hydra/launcher=slurm ...` in the background, its output in a file."""

    def __init__(self, *args: str, cwd: Path, name: str) -> None:
        env = cli_env({"HYDRA_FULL_ERROR": "0"})
        self.log = cwd / f"{name}.out"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([*CLI, "-m", "hydra/launcher=slurm",
                                          "hydra.launcher.poll_s=1", *TINY, *args], cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def communicate(self, timeout: float) -> tuple[str, None]:
        self.proc.wait(timeout=timeout)
        return self.log.read_text(), None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


def sweep(*args: str, cwd: Path) -> Sweep:
    name = next(a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir="))
    return Sweep(*args, cwd=cwd, name=f"{name}-{time.monotonic_ns()}")


def wait_until(what: str, check, timeout: float = 240, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def run_dir(sweep_dir: Path, seed: int, steps: int) -> Path:
    """The run folder of the job with this seed and max_steps (by its .hydra/overrides.yaml, written
    when the job starts; folder names of long override lists are shortened with a hash)."""
    for folder in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")) if sweep_dir.is_dir() else []:
        overrides = folder.read_text()
        if f"seed={seed}\n" in overrides and f"trainer.max_steps={steps}\n" in overrides:
            return folder.parent.parent
    return sweep_dir / "not-started"


def job_id(folder: Path) -> str | None:
    marker = folder / "slurm.json"
    return json.loads(marker.read_text())["job_id"] if marker.is_file() else None


def queue() -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True).stdout
    return dict(line.split("|") for line in out.splitlines() if "|" in line)


def weights(folder: Path) -> dict:
    import torch

    return torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


def assert_same_run(folder: Path, reference: Path) -> None:
    import torch

    got, want = weights(folder), weights(reference)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{folder.name}: {key} differs from the uninterrupted run"
    mine, theirs = (json.loads((d / "metrics.json").read_text()) for d in (folder, reference))
    assert mine["status"] == "finished" and mine["steps"] == theirs["steps"] == LONG
    assert mine["metrics"]["val/loss"] == theirs["metrics"]["val/loss"]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_sweep_survives_cancel_requeue_and_time_limit(cluster, tmp_path):
    # the uninterrupted run every continued one must equal, on this machine, beside the sweeps
    env = cli_env()
    reference = subprocess.Popen([*CLI, *TINY, "seed=1", f"trainer.max_steps={LONG}",
                                  "hydra.run.dir=reference"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    # the time limit: SLURM warns a job signal_delay_s before it with SIGUSR2 (sbatch --signal), checked
    # only every minute or so by slurmctld, so the test sends that warning itself, mid-training
    limited = sweep("seed=1", f"trainer.max_steps={LONG}", "hydra.sweep.dir=limited", "hydra.launcher.timeout_min=10",
                    cwd=tmp_path)
    # tasks: 0 normal (30 steps), 1 cancelled while running, 2 cancelled while pending, 3 requeued mid-run;
    # num_blocks=2,4 doubles every job, and residual=standard ignores it: four duplicates, never submitted
    main = sweep("seed=0,1", f"trainer.max_steps=30,{LONG}", "num_blocks=2,4", "hydra.sweep.dir=main",
                 "hydra.launcher.timeout_min=10", "hydra.launcher.array_parallelism=2", cwd=tmp_path)
    main_dir, limited_dir = tmp_path / "main", tmp_path / "limited"
    done: dict[str, str] = {}  # what the test did to which SLURM job

    def submitted(folder: Path, task: str) -> bool:
        return (folder / ".submitit").is_dir() and any(p.name == task.split("_")[0] or p.name.startswith(
            task.split("_")[0] + "_") for p in (folder / ".submitit").iterdir())

    def checkpointed(folder: Path) -> str | None:  # the job id of a run that is training (it has a checkpoint)
        if (folder / "checkpoints" / "last.ckpt").is_file() and not (folder / "metrics.json").is_file():
            return job_id(folder)
        return None

    try:
        deadline = time.monotonic() + 600
        while (main.poll() is None or limited.poll() is None) and time.monotonic() < deadline:
            if "pending" not in done:  # task 2 waits for a free slot of the array (array_parallelism=2)
                found = [t for t, state in queue().items() if t.endswith("_2") and state == "PENDING"
                         and submitted(main_dir, t)]
                if found:
                    subprocess.run(["scancel", found[0]], check=True)
                    done["pending"] = found[0]
            if "running" not in done and checkpointed(run_dir(main_dir, 0, LONG)):
                done["running"] = job_id(run_dir(main_dir, 0, LONG))
                subprocess.run(["scancel", done["running"]], check=True)
            if "requeue" not in done and checkpointed(run_dir(main_dir, 1, LONG)):
                done["requeue"] = job_id(run_dir(main_dir, 1, LONG))
                subprocess.run(["scontrol", "requeue", done["requeue"]], check=True)
            if "time limit" not in done and checkpointed(run_dir(limited_dir, 1, LONG)):
                done["time limit"] = job_id(run_dir(limited_dir, 1, LONG))  # what SLURM sends before the limit
                subprocess.run(["scancel", "--signal=USR2", done["time limit"]], check=True)
            time.sleep(0.3)
        main_out, _ = main.communicate(timeout=60)
        limited_out, _ = limited.communicate(timeout=60)
        _, reference_err = reference.communicate(timeout=600)
    finally:
        for proc in (main, limited, reference):
            if proc.poll() is None:
                proc.kill()
        for folder in (main_dir, limited_dir):  # nothing of the test stays queued
            for task, _ in queue().items():
                if (folder / ".submitit").is_dir() and any(task.split("_")[0] == p.name.split("_")[0]
                                                           for p in (folder / ".submitit").iterdir()):
                    subprocess.run(["scancel", task.split("_")[0]], check=False)
    assert reference.returncode == 0, reference_err[-3000:]
    assert done.keys() == {"pending", "running", "requeue", "time limit"}, (done, main_out[-3000:])
    running, requeued = run_dir(main_dir, 0, LONG), run_dir(main_dir, 1, LONG)
    limited_run = run_dir(limited_dir, 1, LONG)

    # the sweep ended with a summary, a row and a status for every job; exit 1: jobs did not finish
    assert main.returncode == 1, main_out[-5000:]
    assert "sweep: 8 jobs, 2 finished, 2 cancelled, 4 duplicate" in main_out, main_out[-5000:]
    status = {d: json.loads((d / "metrics.json").read_text()) for d in (run_dir(main_dir, s, n)
              for s in (0, 1) for n in (30, LONG))}
    assert status[run_dir(main_dir, 0, 30)]["status"] == "finished"
    assert status[running]["status"] == "cancelled" and "while running" in status[running]["error"]
    never = run_dir(main_dir, 1, 30)
    assert status[never]["status"] == "cancelled" and "before it started" in status[never]["error"]
    summary = (main_dir / "summary.md").read_text()
    assert summary.count("| cancelled |") == 2 and "before it started" in summary

    # requeued mid-run: continued (restart 1) to the uninterrupted run's weights, bit for bit
    assert json.loads((requeued / "slurm.json").read_text())["restarts"] >= 1
    assert "continuing its own run" in (requeued / "train.log").read_text() + (requeued / "attnres.log").read_text()
    assert_same_run(requeued, tmp_path / "reference")

    # the time-limit warning: SIGUSR2, a checkpoint, a requeue by submitit, and the run continued
    assert limited.returncode == 0, limited_out[-5000:]
    assert json.loads((limited_run / "slurm.json").read_text())["restarts"] >= 1
    assert "SIGUSR2" in (limited_run / "train.log").read_text()
    assert_same_run(limited_run, tmp_path / "reference")

    # resume=true: the finished job is skipped without an allocation, and its metrics.json stays as it is
    before = (limited_run / "metrics.json").read_bytes()
    again = sweep("seed=1", f"trainer.max_steps={LONG}", "hydra.sweep.dir=limited", "hydra.launcher.timeout_min=10",
                  "resume=true", cwd=tmp_path)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    assert "0 to run" in out and "sweep: 1 job, 1 finished" in out, out[-3000:]
    assert (limited_run / "metrics.json").read_bytes() == before


@pytest.mark.slow
@pytest.mark.slurm
def test_a_request_the_partition_cannot_meet_is_refused_before_submitting(cluster, tmp_path):
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True)
    cpus = int(sinfo.stdout.split()[0].rstrip("+"))
    result = run_cli("-m", "hydra/launcher=slurm", *TINY, "seed=0,1", f"hydra.launcher.cpus_per_task={cpus * 4}",
                     "hydra.launcher.timeout_min=5", "hydra.sweep.dir=refused", cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("attnres-run: error: hydra.launcher.cpus_per_task=") and f"the {cpus} CPUs" in line
    assert not (tmp_path / "refused" / ".submitit").exists()  # nothing was submitted, nothing recorded
    assert not (tmp_path / "refused" / "jobs.json").exists()
