"""Stopping a sweep (issue "Trust, round two", item 8): Ctrl-C to the terminal's process group, or
SIGTERM to the sweep's pid alone, lets every running job finish its step and save, leaves the jobs
not started unstarted, writes the summary and its count line, and exits 130 / 143 without a
traceback; a sweep run after another into the same folder lists its own jobs alone (item 11)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import CLI, cli_env, run_cli, tiny

LONG = tiny("callbacks.periodic_checkpoint.every_n_steps=2", steps=100_000, val_every=100_000, progress_bar=False)


def _wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "group", "code", "jobs"),
                         [(signal.SIGINT, True, 130, 2), (signal.SIGTERM, False, 143, 2),
                          (signal.SIGINT, True, 130, 1), (signal.SIGTERM, False, 143, 1)],
                         ids=["ctrl-c-to-the-group", "sigterm-to-the-pid",
                              "one-slot-ctrl-c-to-the-group", "one-slot-sigterm-to-the-pid"])
def test_a_stopped_sweep_saves_its_jobs_and_writes_its_summary(tmp_path, sig, group, code, jobs):
    """With one slot (one GPU, `cpu_jobs=1`, a sweep under `taskset -c 0`) joblib runs the jobs in the
    sweep process itself, which must still take the signals rather than ignore them as a worker does."""
    args = ["-m", *LONG, "seed=0,1,2", "hydra.sweep.dir=sweep", f"hydra.launcher.cpu_jobs={jobs}",
            f"hydra.launcher.lock_dir={tmp_path}/locks"]
    out = tmp_path / "sweep.out"
    proc = subprocess.Popen([*CLI, *args], cwd=tmp_path, env=cli_env(), stdout=open(out, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # as a terminal starts it
    try:
        saved = _wait(lambda: len(list(tmp_path.glob("sweep/*/checkpoints/last.ckpt"))) >= jobs
                      or proc.poll() is not None, 240)
        assert saved and proc.poll() is None, out.read_text()[-3000:]
        (os.killpg if group else os.kill)(proc.pid, sig)
        assert proc.wait(timeout=120) == code, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert "Traceback" not in text and "leaked" not in text, text[-3000:]
    assert f"sweep: 3 jobs, {jobs} interrupted, {3 - jobs} unfinished" in text, text[-2000:]
    assert (tmp_path / "sweep" / "summary.md").is_file()
    stopped = [json.loads(p.read_text()) for p in tmp_path.glob("sweep/*/metrics.json")]
    assert [m["status"] for m in stopped] == ["interrupted"] * jobs, stopped
    assert not list(tmp_path.glob("sweep/**/.*.tmp"))
    import torch

    for ckpt in tmp_path.glob("sweep/*/checkpoints/last.ckpt"):  # whole, and saved when the job stopped
        assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] >= 2


@pytest.mark.slow
def test_a_second_sweep_into_a_folder_lists_its_own_jobs(tmp_path):
    common = ["-m", *tiny(steps=2, val_every=2), "hydra.sweep.dir=sweep", f"hydra.launcher.lock_dir={tmp_path}/locks"]
    first = run_cli(*common, "seed=0,1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_cli(*common, "seed=2", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "sweep: 1 job, 1 finished" in second.stdout, second.stdout[-2000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "seed=0" not in summary and "2 run(s) of earlier sweeps" in summary, summary


def test_a_job_process_a_worker_starts_is_not_deaf_to_the_signals_it_forwards():
    """A worker survives SIGTERM and SIGINT (the sweep process takes them for it), yet the job
    process it starts gets the default handling until its own handlers are in place: a signal the
    worker forwards while the job still imports ends it (recorded `interrupted`), where an ignored
    signal, inherited through exec, let such a job train on to the end."""
    worker = (
        "import os, signal, subprocess, sys\n"
        "from attnres.sweep.stopping import ignore_signals\n"
        "ignore_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGINT)\n"
        "job = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "job.send_signal(signal.SIGTERM)\n"
        "print('worker alive, job', job.wait(timeout=30))\n"
    )
    out = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"worker alive, job {-signal.SIGTERM}"
