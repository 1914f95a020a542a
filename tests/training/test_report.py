"""What a run tells the user: the end block (the numbers of metrics.json and where things are),
a quiet terminal, a run log that holds the start, the validations and any error, a best.ckpt for
a run shorter than one validation interval, no folder left by a refused command, and a --help
that lists every config group."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["data=synthetic", "data.batch_size=8", "data.val_batches=1", "model.n_layer=2", "model.n_embd=32",
        "model.n_head=2", "trainer.accelerator=cpu", "logger=none"]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "attnres", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_end_block_says_what_metrics_json_holds(tmp_path):
    result = run(*TINY, "trainer.max_steps=5", "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run/metrics.json").read_text())
    out = result.stdout
    assert "finished in " in out
    for key in ("val/loss", "val/accuracy"):
        assert f"{key} {summary['metrics'][key]:.4f}" in out, (key, out[-1500:])
    assert f"steps {summary['steps']}," in out
    assert re.search(r"tokens seen [\d.]+k", out) and "tokens/s" in out and "peak memory" in out
    for where in ("run folder   run", "checkpoints  run/checkpoints/ (best.ckpt, last.ckpt)",
                  "metrics      run/metrics.json"):
        assert where in out, (where, out[-1500:])
    # a run shorter than val_check_interval (250) still validates at its end and has best.ckpt
    assert (tmp_path / "run/checkpoints/best.ckpt").is_file()
    # a quiet terminal: none of Lightning's start and stop lines
    for chatter in ("GPU available", "TPU available", "Trainer.fit` stopped", "💡"):
        assert chatter not in out + result.stderr, chatter
    log = (tmp_path / "run/attnres.log").read_text()
    assert "run folder:" in log and "validation at step 5/5" in log and "finished in" in log
    assert "\r" not in log and "\x1b[" not in log, "escape codes or carriage returns in the log file"


@pytest.mark.slow
def test_run_log_holds_the_error_of_a_failed_run(tmp_path):
    result = run(*TINY, "trainer.max_steps=5", "hydra.run.dir=run", "+callbacks.fault._target_=faultinject.NaNAt",
                 "+callbacks.fault.step=2", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    log = (tmp_path / "run/attnres.log").read_text()
    assert "run folder:" in log and "non-finite loss at step 2" in log


