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


@pytest.mark.slow
def test_refused_command_leaves_no_folder(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    result = run(*TINY, f"ckpt_path={garbage}", cwd=tmp_path)
    assert result.returncode == 2 and "corrupt" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))


def test_help_lists_every_group_without_importing_lightning(tmp_path):
    result = run("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    groups = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "hydra")
    for group in [*groups, "hydra/launcher"]:
        options = sorted(f.stem for f in (REPO / "conf" / group).glob("*.yaml"))
        line = next((line for line in result.stdout.splitlines() if line.strip().startswith(group + " ")), None)
        assert line is not None, f"--help does not list {group}"
        assert all(o in result.stdout for o in options), (group, options)
    for key in ("seed", "num_blocks", "keep_freed_memory", "resume", "overwrite", "nonfinite"):
        assert re.search(rf"^  {key} ", result.stdout, re.M), key
    keys = result.stdout.split("top-level keys (key=value):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    columns = {len(line) - len(line[2:].split(" ", 1)[1].lstrip()) for line in keys if " " in line[2:]}
    assert len(columns) == 1, keys  # the descriptions start in one column, however long a key
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['attnres-run', '--help'];"
                            "from attnres._entry import main; main();"
                            "print('LIGHTNING' if 'pytorch_lightning' in sys.modules else 'light')"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.strip().endswith("light"), probe.stdout[-500:]
