"""Fault injection into the real runner (DESIGN.md section 8): kills at chosen moments resume
bit-identically with dropout on, SIGTERM/SIGINT checkpoint and exit non-zero, `overwrite`
never lets a resume read the old run, a non-finite loss stops (or is skipped, or rolled back)
and never reaches JSON, a full disk keeps the previous checkpoint, a second process in the same
folder is refused, and the files a run writes follow the umask.

The faults are callbacks from tests/faultinject.py named on the command line."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import CLI, cli_env, faultinject_env, metrics, run_cli, shared_once, small_disk, tiny, weights

# tiny model and data, dropout on, validation (and so a checkpoint) every 2 steps, 6 steps in all
BASE = tiny("model.dropout=0.1", "residual=block", "num_blocks=2", "optim.schedule.warmup_steps=2",
            steps=6, val_every=2, progress_bar=False)


def run(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`attnres-run BASE ARGS`, able to name tests/faultinject.py's callbacks."""
    return run_cli(*BASE, *args, cwd=cwd, timeout=timeout, env=faultinject_env())


def fault(target: str, **kwargs) -> list[str]:
    keys = (f"+callbacks.fault.{k}={v}" for k, v in kwargs.items())
    return [f"+callbacks.fault._target_=faultinject.{target}", *keys]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[0]}"


def _reference(root: Path) -> dict:
    result = run("hydra.run.dir=ref", cwd=root)
    return {"returncode": result.returncode, "stderr": result.stderr[-3000:]}


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every resumed one must equal, bit for bit (once per session: read only)."""
    root, result = shared_once(tmp_path_factory, "faults-reference", _reference)
    assert result["returncode"] == 0, result["stderr"]
    return root / "ref"


@pytest.mark.slow
def test_dropout_is_on_and_runs_differ_by_seed(reference, tmp_path):
    """Sanity of the setting: with dropout the random state matters (else the resume tests prove nothing)."""
    other = run("hydra.run.dir=other", "seed=1", cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-3000:]
    assert metrics(reference)["status"] == "finished"
    with pytest.raises(AssertionError):
        assert_same_weights(reference / "checkpoints/last.ckpt", tmp_path / "other/checkpoints/last.ckpt")


@pytest.mark.parametrize(("step", "moment"), [(3, "step"), (4, "validation"), (4, "checkpoint")],
                         ids=["mid-run", "in-validation", "inside-checkpoint-write"])
@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(reference, tmp_path, step, moment):
    killed = run("hydra.run.dir=run", *fault("KillAt", step=step, moment=moment), cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    ckpts = tmp_path / "run/checkpoints"
    if moment == "checkpoint":
        assert list(ckpts.glob(".*.tmp")), "the kill inside a write should leave its temporary file"
    resumed = run("hydra.run.dir=run", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metrics(tmp_path / "run")["steps"] == 6
    assert_same_weights(reference / "checkpoints/last.ckpt", ckpts / "last.ckpt")
    assert not list(ckpts.glob(".*.tmp")) and not list((tmp_path / "run").glob(".*.tmp")), "temporary files left"
    assert not list(ckpts.glob("*-v*.ckpt")), "a checkpoint name was versioned"


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [("TERM", 143), ("INT", 130)])
def test_signal_checkpoints_exits_nonzero_and_resumes(reference, tmp_path, sig, code):
    stopped = run("hydra.run.dir=run", *fault("KillAt", step=3, moment="step", sig=sig), cwd=tmp_path)
    assert stopped.returncode == code, (stopped.returncode, stopped.stderr[-2000:])
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("attnres-run:")]
    assert len(lines) == 1 and f"SIG{sig}" in lines[0] and "resume=true" in lines[0], stopped.stderr[-2000:]
    summary = metrics(tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["steps"] == 3, summary
    saved = torch.load(tmp_path / "run/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3, "the checkpoint is not of the step the signal interrupted"
    resumed = run("hydra.run.dir=run", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(reference / "checkpoints/last.ckpt", tmp_path / "run/checkpoints/last.ckpt")
    assert metrics(tmp_path / "run")["status"] == "finished"


@pytest.mark.slow
def test_sigterm_from_outside_stops_within_seconds(tmp_path):
    env = cli_env()
    proc = subprocess.Popen([*CLI, *BASE, "trainer.max_steps=100000",
                             "trainer.val_check_interval=50", "hydra.run.dir=run"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log_file = tmp_path / "run/attnres.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log_file.is_file() and "run folder" in log_file.read_text()):
        time.sleep(0.2)
    time.sleep(3)  # well inside training
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert time.monotonic() - sent < 20, "took too long to stop"
    summary = metrics(tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["steps"] > 0
    saved = torch.load(tmp_path / "run/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == summary["steps"]


@pytest.mark.slow
def test_overwrite_then_crash_then_resume_never_continues_the_old_run(tmp_path):
    old = run("hydra.run.dir=run", "seed=0", cwd=tmp_path)
    assert old.returncode == 0, old.stderr[-3000:]
    # the new run (another seed) is killed before its first checkpoint, then resumed
    new = run("hydra.run.dir=run", "seed=1", "overwrite=true", *fault("KillAt", step=1), cwd=tmp_path)
    assert new.returncode == -signal.SIGKILL, new.stderr[-2000:]
    ckpts = tmp_path / "run/checkpoints"
    assert not ckpts.exists() or not list(ckpts.glob("*.ckpt")), "the old run's checkpoints survived overwrite"
    resumed = run("hydra.run.dir=run", "seed=1", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "starting this run from scratch" in resumed.stdout + resumed.stderr
    fresh = run("hydra.run.dir=fresh", "seed=1", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    for name in ("last.ckpt", "best.ckpt"):
        assert_same_weights(tmp_path / "fresh/checkpoints" / name, ckpts / name)
    # the new run's two checkpoints and their SHA-256 records (training/checkpoints.py), nothing else
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.ckpt", "best.ckpt.sha256", "last.ckpt", "last.ckpt.sha256"]


@pytest.mark.slow
def test_completed_overwrite_leaves_nothing_of_the_old_run(tmp_path):
    assert run("hydra.run.dir=run", "seed=0", cwd=tmp_path).returncode == 0
    again = run("hydra.run.dir=run", "seed=1", "overwrite=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert run("hydra.run.dir=fresh", "seed=1", cwd=tmp_path).returncode == 0
    for name in ("last.ckpt", "best.ckpt"):
        assert_same_weights(tmp_path / "fresh/checkpoints" / name, tmp_path / "run/checkpoints" / name)


@pytest.mark.slow
def test_nonfinite_loss_stops_naming_the_step(tmp_path):
    result = run("hydra.run.dir=run", *fault("NaNAt", step=3), cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run:")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "non-finite loss at step 3" in lines[0] and "last.ckpt (step 2)" in lines[0], lines[0]
    summary = metrics(tmp_path / "run")  # strict JSON: NaN would raise
    assert summary["status"] == "failed" and "non-finite loss at step 3" in summary["error"]
    for name in ("best.ckpt", "last.ckpt"):
        assert all(torch.isfinite(w).all() for w in weights(tmp_path / "run/checkpoints" / name).values())
    assert "non-finite loss at step 3" in (tmp_path / "run/attnres.log").read_text()


@pytest.mark.slow
def test_nonfinite_loss_skip_policy_drops_the_step(tmp_path):
    result = run("hydra.run.dir=run", "nonfinite.policy=skip", *fault("NaNAt", step=3), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(tmp_path / "run")
    assert summary["status"] == "finished" and summary["skipped_steps"] == 1 and summary["steps"] == 6
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "run/checkpoints/last.ckpt").values())


@pytest.mark.slow
def test_nonfinite_weights_rollback_policy_reloads_and_lowers_the_lr(tmp_path):
    result = run("hydra.run.dir=run", "nonfinite.policy=rollback", "nonfinite.lr_factor=0.25",
                 *fault("NaNAt", step=5, what="weights"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(tmp_path / "run")
    assert summary["status"] == "finished" and summary["rollbacks"] == 1, summary
    ckpt = torch.load(tmp_path / "run/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert all(torch.isfinite(w).all() for w in ckpt["state_dict"].values())
    base_lrs = ckpt["lr_schedulers"][0]["base_lrs"]
    assert base_lrs[0] == pytest.approx(0.25 * 3e-3), base_lrs  # conf/optim/adamw.yaml: lr 3e-3


@pytest.mark.slow
def test_nonfinite_weights_skip_policy_gives_up_after_max_in_a_row(tmp_path):
    result = run("hydra.run.dir=run", "nonfinite.policy=skip", "nonfinite.max_in_a_row=2",
                 *fault("NaNAt", step=3, what="weights"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "non-finite loss at step 5 (3 steps in a row)" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    # a checkpoint of the tiny model is ~330 KB: room for best + last, not for a third copy being written
    with small_disk(disk, "900k", required=False) as mounted:
        extra = [] if mounted else fault("DiskFullAt", step=4)
        result = run(f"hydra.run.dir={disk}/run", "trainer.max_steps=40", *extra, cwd=tmp_path)
        assert result.returncode == 2, (mounted, result.returncode, result.stderr[-3000:])
        lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run:")]
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert "disk full writing" in lines[0] and str(disk / "run") in lines[0] and "kept:" in lines[0], lines[0]
        ckpts = disk / "run/checkpoints"
        assert not list(ckpts.glob(".*.tmp")), "a failed write left its temporary file"
        kept = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)
        assert kept["global_step"] >= 2 and f"step {kept['global_step']}" in lines[0]


@pytest.mark.slow
def test_second_run_in_the_same_folder_is_refused(tmp_path):
    env = cli_env()
    first = subprocess.Popen([*CLI, *BASE, "trainer.max_steps=100000",
                              "hydra.run.dir=run"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        log_file = tmp_path / "run/attnres.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (log_file.is_file() and "run folder" in log_file.read_text()):
            time.sleep(0.2)
        second = run("hydra.run.dir=run", "trainer.max_steps=100000", cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"another attnres-run (pid {first.pid}) is running" in second.stderr
        assert first.poll() is None, "the refusal disturbed the running run"
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    assert metrics(tmp_path / "run")["status"] == "interrupted"


@pytest.mark.slow
def test_resume_after_kill_before_first_checkpoint_starts_from_scratch(reference, tmp_path):
    killed = run("hydra.run.dir=run", *fault("KillAt", step=1), cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL
    resumed = run("hydra.run.dir=run", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "no checkpoint yet" in resumed.stdout + resumed.stderr
    assert_same_weights(reference / "checkpoints/last.ckpt", tmp_path / "run/checkpoints/last.ckpt")


@pytest.mark.slow
def test_written_files_follow_the_umask(reference):
    expected = 0o666 & ~_umask()
    for path in (reference / "metrics.json", reference / "checkpoints/last.ckpt", reference / "checkpoints/best.ckpt"):
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))
    text = (reference / "attnres.log").read_text()
    assert "run folder" in text, text  # the run's own log is not empty


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- unit tests (fast) ---------------------------------------------------------------------------


def test_clear_previous_run_removes_every_output_of_the_old_run(tmp_path):
    from attnres.training.faults import clear_previous_run

    for name in ("checkpoints/last.ckpt", "checkpoints/best.ckpt", "tb/events.out.tfevents.1", "plots/heatmap.png",
                 "events.out.tfevents.123.host.1", "metrics.json", ".hydra/config.yaml", "attnres.log",
                 "metrics.csv", "hparams.yaml", "wandb/offline-run-1/run.wandb"):  # logger=csv, wandb
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("old")
    clear_previous_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "attnres.log"]  # the new run's, from Hydra


@pytest.mark.slow
def test_unbounded_run_trains_on_and_stops_on_sigterm(tmp_path):
    """`trainer.max_steps=-1` (no step limit; the schedule's length from optim.total_steps) is
    not "at its last step" from the start: it trains until the signal, then stops as usual."""
    result = run("hydra.run.dir=run", "trainer.max_steps=-1", "optim.total_steps=50",
                 *fault("KillAt", step=3, moment="step", sig="TERM"), cwd=tmp_path)
    assert result.returncode == 143, (result.returncode, result.stderr[-2000:])
    summary = metrics(tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["steps"] == 3, summary
