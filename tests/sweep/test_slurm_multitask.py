"""Sweep jobs of several SLURM tasks (attnres/sweep/slurm*.py, job.py): the job shape the launcher
derives and checks (no cluster needed), and, marked `slurm`, 2-task jobs (CPU, gloo) on the local
cluster (`experiments/slurm/cluster.sh up`): the same weights as one task with the same global
batch, a killed rank failing its job in one line while the sweep goes on, and 2-task jobs requeued
(`scontrol requeue`) or warned of their time limit (SIGUSR2) continuing bit for bit."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnres.config.errors import ConfigError

slurm = pytest.importorskip("attnres.sweep.slurm", reason="needs the slurm extra (hydra-submitit-launcher)")
from attnres.sweep import slurm_resources  # noqa: E402
from tests.helpers import CLI, cli_env  # noqa: E402
from tests.sweep.test_slurm import (  # noqa: E402
    GPUS,
    SMALL,
    cluster_reason,
    job_id,
    launcher_params,
    queue,
    weights,
)


# -- no cluster needed -----------------------------------------------------------------------------
def config(devices=1, nodes=1, accelerator="cpu", workers=0):
    return OmegaConf.create({"trainer": {"accelerator": accelerator, "devices": devices, "num_nodes": nodes},
                             "data": {"num_workers": workers}})


def test_a_global_batch_that_does_not_divide_over_the_ranks_is_refused_before_submitting():
    run = OmegaConf.merge(config(accelerator="gpu"), {"data": {"tokens_per_step": 4096, "batch_size": 4,
                                                               "block_size": 128}})
    assert slurm_resources.fit_resources(launcher_params(tasks_per_node=8), [run], GPUS)["tasks_per_node"] == 8
    with pytest.raises(ConfigError, match=r"data.tokens_per_step=4096 does not divide over the job's 16 rank\(s\) x "
                                          r"data.batch_size=4 x data.block_size=128: pass a multiple of 8192"):
        slurm_resources.fit_resources(launcher_params(tasks_per_node=8, nodes=2), [run], GPUS)


def test_the_job_shape_comes_from_the_runs_or_the_launcher():
    eight = slurm_resources.fit_resources(launcher_params(), [config(8, 2, "gpu", workers=3)], GPUS)
    assert (eight["tasks_per_node"], eight["nodes"], eight["gpus_per_node"]) == (8, 2, 8)
    assert eight["cpus_per_task"] == 4 and eight["mem_gb"] == 32  # per task: 1 + 3 workers; per node: 8 x 4 GB
    asked = slurm_resources.fit_resources(launcher_params(tasks_per_node=8), [config(1, 1, "gpu")], GPUS)
    assert (asked["tasks_per_node"], asked["nodes"], asked["gpus_per_node"]) == (8, 1, 8)
    two = slurm_resources.fit_resources(launcher_params(timeout_min=15, tasks_per_node=2), [config()], SMALL)
    assert two["cpus_per_task"] == 1 and two["gpus_per_node"] is None  # 2 tasks share the node's 2 CPUs
    mixed = slurm_resources.fit_resources(launcher_params(), [config(1, accelerator="gpu"),
                                                              config(2, accelerator="gpu")], GPUS)
    assert mixed["tasks_per_node"] == 1 and mixed["gpus_per_node"] == 2  # Lightning starts the second process


@pytest.mark.parametrize(("runs", "params", "words"), [
    ([config(4, accelerator="gpu")], {"tasks_per_node": 8}, "trainer.devices=4 but hydra.launcher.tasks_per_node=8"),
    ([config(8, 2, "gpu")], {"nodes": 4}, "trainer.num_nodes=2 but hydra.launcher.nodes=4"),
    ([config(accelerator="gpu")], {"tasks_per_node": 8, "gpus_per_node": 4}, "gpus_per_node=4 but tasks_per_node=8"),
    ([config()], {"tasks_per_node": 0}, "tasks_per_node=0 must be a whole number"),
    ([config()], {"tasks_per_node": 4, "timeout_min": 15}, "tasks_per_node=4 is more than the 2 CPUs"),
    ([config()], {"tasks_per_node": 2, "cpus_per_task": 2, "timeout_min": 15},
     "cpus_per_task=2 is more than the 1 CPUs of a node in partition debug (2 CPUs shared by 2 tasks)"),
])
def test_a_job_shape_that_cannot_run_is_refused_in_one_line(runs, params, words):
    partition = SMALL if params.get("timeout_min") else GPUS
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        slurm_resources.fit_resources(launcher_params(**params), runs, partition)
    assert "\n" not in str(err.value)


# -- the local cluster: 2-task jobs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    reason = cluster_reason()
    if reason:
        pytest.skip(reason)


# stdlib bytes (the synthetic data has no tokens_per_step): global batch 256 tokens = 2 x 4 x 32
RUN = ["data=stdlib", "data.max_files=40", "data.block_size=32", "data.batch_size=4", "data.val_batches=1",
       "data.tokens_per_step=256", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "trainer.accelerator=cpu",
       "trainer.enable_progress_bar=false", "trainer.val_check_interval=1000", "callbacks.periodic_checkpoint."
       "every_n_steps=25", "callbacks.depth_dashboard.every_n_steps=1000"]
LONG = 200  # steps of the jobs killed or requeued mid-run


class Sweep:
    """`attnres-run -m hydra/launcher=slurm ... hydra.launcher.tasks_per_node=2` in the background."""

    def __init__(self, *args: str, cwd: Path, name: str) -> None:
        self.log = cwd / f"{name}.out"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                ["nice", "-n", "10", *CLI, "-m", "hydra/launcher=slurm", "hydra.launcher.poll_s=1",
                 "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10", *RUN, *args,
                 f"hydra.sweep.dir={name}"], cwd=cwd, env=cli_env({"HYDRA_FULL_ERROR": "0"}), stdout=out,
                stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.log.read_text()


def run_of(sweep_dir: Path, seed: int) -> Path:
    for overrides in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")) if sweep_dir.is_dir() else []:
        if f"seed={seed}\n" in overrides.read_text():
            return overrides.parent.parent
    return sweep_dir / "not-started"


def training_process(task: str, rank: int) -> int | None:
    """The pid of the training process of rank k > 0 of this SLURM task (its spec file names both)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode().split("\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if "attnres.sweep.job" in cmdline and any(c.endswith(f"/{task}_rank{rank}_job.json") for c in cmdline):
            return int(proc.name)
    return None


def cancel_all(*sweep_dirs: Path) -> None:
    for folder in sweep_dirs:
        if (folder / ".submitit").is_dir():
            arrays = {p.name.split("_")[0] for p in (folder / ".submitit").iterdir()}
            for task in queue():
                if task.split("_")[0] in arrays:
                    subprocess.run(["scancel", task.split("_")[0]], check=False)


@pytest.mark.slurm
@pytest.mark.slow
def test_two_tasks_train_to_the_weights_of_one_with_the_same_global_batch(cluster, tmp_path):
    import torch

    two = Sweep("seed=0", "trainer.max_steps=40", cwd=tmp_path, name="two")
    one = subprocess.run(["nice", "-n", "10", *CLI, *RUN, "seed=0", "trainer.max_steps=40", "hydra.run.dir=one"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    out = two.wait(timeout=600)
    cancel_all(tmp_path / "two")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.proc.returncode == 0 and "sweep: 1 job, 1 finished" in out, out[-3000:]
    run = run_of(tmp_path / "two", 0)
    log = (run / "train.log").read_text()
    assert "1 micro-batch(es) of 4 x 32 per device and step, 2 device(s)" in log  # 2 ranks, no accumulation
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log
    assert "2 micro-batch(es) of 4 x 32 per device and step, 1 device(s)" in one.stdout + one.stderr
    # rank 0 alone wrote the run folder: no second Hydra folder, one marker, rank 1's log in submitit's folder
    assert json.loads((run / "slurm.json").read_text())["job_id"] == job_id(run)
    assert (run / "attnres.log").read_text().count(" - job 0 on ") == 1  # Hydra's log: rank 0's lines only
    ranked = list((tmp_path / "two" / ".submitit").glob("*/*_1_log.out"))
    assert ranked and "Job completed successfully" in ranked[0].read_text() + ranked[0].with_suffix(".err").read_text()
    # the same weights: float32, an all-reduce of 2 gradients against the sum of 2 accumulated ones
    # (a different order of additions), 40 AdamW steps; measured max |diff| 1.2e-7
    got, want = weights(run), weights(tmp_path / "one")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_killed_rank_fails_its_job_and_requeued_or_warned_jobs_continue_bit_for_bit(cluster, tmp_path):
    # killed: seed=0's rank 1 is killed mid-run, seed=1 runs to the end (the reference of the others);
    # requeued: `scontrol requeue` mid-run; warned: SIGUSR2, what SLURM sends before the time limit
    killed = Sweep("seed=0,1", f"trainer.max_steps={LONG}", cwd=tmp_path, name="killed")
    requeued = Sweep("seed=1", f"trainer.max_steps={LONG}", cwd=tmp_path, name="requeued")
    warned = Sweep("seed=1", f"trainer.max_steps={LONG}", cwd=tmp_path, name="warned")
    done: dict[str, str] = {}

    def training(folder: Path) -> str | None:  # the SLURM task of a run that has a checkpoint and no end
        if (folder / "checkpoints" / "last.ckpt").is_file() and not (folder / "metrics.json").is_file():
            return job_id(folder)
        return None

    try:
        deadline = time.monotonic() + 1200
        while any(s.proc.poll() is None for s in (killed, requeued, warned)) and time.monotonic() < deadline:
            task = training(run_of(tmp_path / "killed", 0))
            if "killed" not in done and task and training_process(task, 1):
                subprocess.run(["kill", "-KILL", str(training_process(task, 1))], check=True)
                done["killed"] = task
            task = training(run_of(tmp_path / "requeued", 1))
            if "requeued" not in done and task:
                subprocess.run(["scontrol", "requeue", task], check=True)
                done["requeued"] = task
            task = training(run_of(tmp_path / "warned", 1))
            if "warned" not in done and task:
                subprocess.run(["scancel", "--signal=USR2", task], check=True)
                done["warned"] = task
            time.sleep(0.3)
        killed_out, requeued_out, warned_out = (s.wait(timeout=60) for s in (killed, requeued, warned))
    finally:
        cancel_all(tmp_path / "killed", tmp_path / "requeued", tmp_path / "warned")
    assert done.keys() == {"killed", "requeued", "warned"}, (done, killed_out[-3000:], requeued_out[-3000:])

    # the killed rank: its job failed in one line naming the rank; the sweep went on to its other job
    assert killed.proc.returncode == 1, killed_out[-3000:]
    assert "sweep: 2 jobs, 1 finished, 1 failed" in killed_out, killed_out[-3000:]
    failed = json.loads((run_of(tmp_path / "killed", 0) / "metrics.json").read_text())
    assert failed["status"] == "failed", failed
    assert failed["error"].startswith("rank 1 of 2 (node ") and "died: killed by signal SIGKILL" in failed["error"]
    assert "\n" not in failed["error"]
    assert "rank 1 of 2" in (tmp_path / "killed" / "summary.md").read_text()

    # the requeued 2-task job: continued from its checkpoint to the uninterrupted job's weights, bit for bit
    # and the warned one (a checkpoint at the end of the step on every rank, then submitit's requeue)
    assert requeued.proc.returncode == 0, requeued_out[-3000:]
    assert warned.proc.returncode == 0, warned_out[-3000:]
    reference = run_of(tmp_path / "killed", 1)
    for run in (run_of(tmp_path / "requeued", 1), run_of(tmp_path / "warned", 1)):
        assert json.loads((run / "slurm.json").read_text())["restarts"] >= 1
        assert "continuing its own run" in (run / "train.log").read_text() + (run / "attnres.log").read_text()
        got, want = weights(run), weights(reference)
        assert got.keys() == want.keys()
        for key in want:
            assert torch_equal(got[key], want[key]), f"{run.parent.name}: {key} differs from the uninterrupted job"
        mine, theirs = (json.loads((d / "metrics.json").read_text()) for d in (run, reference))
        assert mine["status"] == theirs["status"] == "finished" and mine["steps"] == theirs["steps"] == LONG
    assert "SIGUSR2" in (run_of(tmp_path / "warned", 1) / "train.log").read_text()


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_sweep_of_two_job_shapes_runs_as_two_arrays(cluster, tmp_path):
    """Runs that ask for 1 and 2 processes (trainer.devices): one array of 1-task jobs and one of
    2-task jobs, as experiment=paper_scaling sends its 8- and 16-GPU sizes."""
    ran = subprocess.run(["nice", "-n", "10", *CLI, "-m", "hydra/launcher=slurm", "hydra.launcher.poll_s=1",
                          "hydra.launcher.timeout_min=10", *RUN, "seed=0", "trainer.max_steps=10",
                          "trainer.devices=1,2", "hydra.sweep.dir=mixed"], cwd=tmp_path,
                         env=cli_env({"HYDRA_FULL_ERROR": "0"}), capture_output=True, text=True, timeout=600)
    cancel_all(tmp_path / "mixed")
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0 and "sweep: 2 jobs, 2 finished" in out, out[-3000:]
    assert "SLURM: 1 job(s) to partition" in out and "each 1 node(s) x 1 task(s)" in out
    assert "each 1 node(s) x 2 task(s)" in out
    arrays = {p.name.split("_")[0] for p in (tmp_path / "mixed" / ".submitit").iterdir() if p.name[0].isdigit()}
    assert len(arrays) == 2, arrays
    logs = [log.read_text() for log in (tmp_path / "mixed").glob("*/train.log")]
    assert sum("2 device(s)" in log for log in logs) == 1 and sum("1 device(s)" in log for log in logs) == 1
