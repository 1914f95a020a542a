"""What a run tells the user (attnres/training/report.py): the end block (the numbers of
metrics.json and where things are), a quiet terminal, a run log that holds the start, the
validations and any error, and a best.ckpt for a run shorter than one validation interval.
(--help and a refused command's missing folder: tests/test_cli.py.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import RUN_STEPS, cli_env, faultinject_env, metrics, run_cli, tiny


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["standard", "full", "block"])
def test_end_block_says_what_metrics_json_holds(strategy_runs, residual):
    ran = strategy_runs[residual]  # run in its parent folder with hydra.run.dir=<residual>
    summary = metrics(ran.dir)
    out = ran.stdout
    assert "finished in " in out
    for key in ("val/loss", "val/accuracy"):
        assert f"{key} {summary['metrics'][key]:.4f}" in out, (key, out[-1500:])
    assert f"steps {summary['steps']}," in out
    assert re.search(r"tokens seen [\d.]+k", out) and "tokens/s" in out and "peak memory" in out
    here = ran.dir.resolve()  # absolute: the commands are pasted in other folders too
    for where in (f"run folder   {here}\n", f"checkpoints  {here}/checkpoints/ (best.ckpt, last.ckpt)",
                  f"metrics      {here}/metrics.json"):
        assert where in out, (where, out[-1500:])
    # a run shorter than val_check_interval (250) still validates at its end and has best.ckpt
    assert (ran.dir / "checkpoints/best.ckpt").is_file()
    # a quiet terminal: none of Lightning's start and stop lines
    for chatter in ("GPU available", "TPU available", "Trainer.fit` stopped", "💡"):
        assert chatter not in out + ran.stderr, chatter
    log = (ran.dir / "attnres.log").read_text()
    assert "run folder:" in log and f"validation at step {RUN_STEPS}/{RUN_STEPS}" in log and "finished in" in log
    assert "\r" not in log and "\x1b[" not in log, "escape codes or carriage returns in the log file"


@pytest.mark.slow
def test_run_log_holds_the_error_of_a_failed_run(tmp_path):
    result = run_cli(*tiny(), "trainer.max_steps=5", "hydra.run.dir=run", "+callbacks.fault._target_=faultinject.NaNAt",
                 "+callbacks.fault.step=2", cwd=tmp_path, env=faultinject_env())
    assert result.returncode == 1, result.stderr[-3000:]
    log = (tmp_path / "run/attnres.log").read_text()
    assert "run folder:" in log and "non-finite loss at step 2" in log




def test_a_non_finite_loss_before_the_first_checkpoint_says_there_is_none(tmp_path):
    """It said "the last good checkpoint is no checkpoint yet" (issue "Trust, round three", item 11)."""
    from types import SimpleNamespace

    from attnres.training.faults import NonFiniteLoss
    from attnres.training.report import end_nonfinite

    trainer = SimpleNamespace(is_global_zero=False)  # rank 0 writes metrics.json: not what is tested here
    ended = end_nonfinite(NonFiniteLoss(2), trainer, None, tmp_path,
                          tmp_path / "checkpoints" / "last.ckpt", {}, 0.0)
    assert "there is no good checkpoint yet (it stopped before the first one)" in str(ended)
    assert "is no checkpoint yet" not in str(ended) and ended.exit_code == 1


@pytest.mark.slow
def test_the_start_line_shows_the_threads_and_threads_sets_them(tmp_path):
    """Issue "The first hour", item 5: nothing showed how many threads a run used."""
    ran = run_cli(*tiny(steps=1, progress_bar=False), "threads=1", "hydra.run.dir=R", cwd=tmp_path,
                  env={"OMP_NUM_THREADS": "2"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    start = [line for line in (ran.stdout + ran.stderr).splitlines() if ", seed 0, " in line]
    assert len(start) == 1 and start[0].endswith(", seed 0, 1 thread"), start


@pytest.mark.slow
def test_an_interrupted_run_prints_its_end_block_and_a_plain_log_speaks_after_the_first_step(tmp_path):
    """Issue "The first hour", item 4: Ctrl-C skipped the end block; a plain log (stdout not a
    terminal) said nothing for its first 100 steps."""
    ran = run_cli(*tiny(steps=30, val_every=10, progress_bar=True), "hydra.run.dir=R",
                  "+callbacks.fault._target_=faultinject.KillAt", "+callbacks.fault.step=15",
                  "+callbacks.fault.sig=INT", cwd=tmp_path, env=faultinject_env())
    assert ran.returncode == 130, ran.stderr[-3000:]
    out = ran.stdout
    assert re.search(r"step 1/30  ", out), out[-3000:]  # the first step's plain line (plain_every is 100)
    block = out[out.index("interrupted in "):]
    assert re.match(r"interrupted in [\d.]+ s: val/accuracy [\d.]+, val/loss [\d.]+ \(its last validation, at "
                    r"step 10\)\n", block), block
    here = (tmp_path / "R").resolve()
    for line in ("  steps 15, tokens seen", f"  run folder   {here}\n", f"  checkpoints  {here}/checkpoints/",
                 f"  metrics      {here}/metrics.json"):
        assert line in block, block
    assert "continue with the same command and resume=true" in ran.stderr
    assert metrics(tmp_path / "R")["validation_step"] == 10


@pytest.mark.slow
def test_the_end_blocks_commands_work_from_another_folder(tmp_path):
    """Issue "The first hour, round two", item 3: the end block printed relative paths; pasted in
    another folder, attnres-plot said "no TensorBoard event files" for a folder that did not exist.
    A run without the depth dashboard has nothing for attnres-plot: no `figures` line."""
    ran = run_cli(*tiny(steps=4, progress_bar=False, logger=True), "hydra.run.dir=R", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    block = ran.stdout[ran.stdout.index("finished in "):]
    plot = next(line for line in block.splitlines() if line.startswith("  figures      "))
    board = next(line for line in block.splitlines() if line.startswith("  TensorBoard  "))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pasted = subprocess.run(plot.split(None, 1)[1], shell=True, cwd=elsewhere, capture_output=True, text=True,
                            env=cli_env())
    assert pasted.returncode == 0 and (tmp_path / "R/plots/magnitude.png").is_file(), pasted.stderr[-2000:]
    logdir = Path(shlex.split(board.split("--logdir", 1)[1])[0])
    assert logdir.is_absolute() and any(logdir.glob("events.out.tfevents.*"))
    missing = subprocess.run([sys.executable, "-m", "attnres.results.plot_run", "R"], cwd=elsewhere,
                             capture_output=True, text=True, env=cli_env())
    assert missing.returncode == 2 and f"no such folder: {elsewhere / 'R'}" in missing.stderr, missing.stderr

    plain = run_cli(*tiny(steps=4, progress_bar=False, logger=True), "~callbacks.depth_dashboard",
                    "hydra.run.dir=P", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "  TensorBoard  " in plain.stdout and "  figures  " not in plain.stdout, plain.stdout[-1500:]
