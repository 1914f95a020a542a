"""Seeds on demand through `attnres-run` (marked slow: they train tiny runs): a plain sweep's looks on
the parallel launcher, a bad setting and seeds on demand without -m refused in one line before anything
runs, and (marked slurm, skipped where no cluster answers) the looks through a real SLURM cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import one_line_error, run_cli

TINY_SWEEP = ["model.n_layer=2", "model.n_embd=32", "data.batch_size=4", "data.val_batches=4",
              "trainer.val_check_interval=10", "trainer.max_steps=30", "trainer.enable_progress_bar=false",
              "~callbacks.depth_dashboard", "logger=none"]
#: 3 seeds, then 1 more if the first look does not resolve: the maximum of 4 at the second look
DESIGN = ["seeds.on_demand=true", "seeds.start=3", "seeds.batch=1", "seeds.max=4"]


def check_looks(out: str, sweep_dir: Path) -> int:
    """The looks the record holds are the design's (3 seeds, then one a look up to 4), the sweep's last
    lines say where it stopped as the record does, and every arm ran every recorded seed; the seeds."""
    record = json.loads((sweep_dir / "seeds.json").read_text())
    looks = record["looks"]
    assert looks in ([[0, 1, 2]], [[0, 1, 2], [3]]), looks
    seeds, look = sum(len(x) for x in looks), len(looks)
    summary = next(line for line in out.splitlines() if line.startswith("seeds on demand: "))
    if record["final"]:  # the second look is the maximum: resolved there or not
        assert summary.startswith(("seeds on demand: stopped at 4 seeds (look 2): every comparison resolved",
                                   "seeds on demand: reached the maximum of 4 seeds (look 2): block N=")), summary
    else:  # resolved at the first look
        assert summary.startswith("seeds on demand: stopped at 3 seeds (look 1): every comparison resolved"), summary
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: block"))
    assert f"repeated 95% interval of the sequential design at look {look}" in verdict, verdict
    assert summary.removeprefix("seeds on demand: ") in (sweep_dir / "summary.md").read_text()
    runs = sorted(p.name for p in sweep_dir.iterdir() if (p / "metrics.json").is_file())
    assert len(runs) == 2 * seeds, runs  # 2 arms x the recorded seeds
    return seeds


@pytest.mark.slow
def test_a_plain_sweep_adds_seeds_until_its_maximum(tmp_path):
    result = run_cli("-m", "residual=standard,block", "num_blocks=2", *TINY_SWEEP, *DESIGN,
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    seeds = check_looks(result.stdout, tmp_path / "sweep")
    again = run_cli("-m", "residual=standard,block", "num_blocks=2", *TINY_SWEEP, *DESIGN, "resume=true",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{2 * seeds} skipped" in again.stderr + again.stdout  # every recorded seed finished: nothing runs again
    changed = run_cli("-m", "residual=standard,block", "num_blocks=2", *TINY_SWEEP, *DESIGN, "seeds.max=6",
                      "resume=true", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=600)
    assert "the design of seeds on demand changed since this sweep started" in one_line_error(changed)


@pytest.mark.slow
def test_a_bad_setting_is_refused_before_anything_runs(tmp_path):
    result = run_cli("-m", "residual=standard,block", "seeds.on_demand=true", "seeds.start=2",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=300)
    assert one_line_error(result) == ("attnres-run: error: seeds.start=2 must be an integer of at least 3 (two seeds "
                                      "barely estimate a spread); e.g. seeds.start=3")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_seeds_on_demand_without_m_is_refused_before_anything_runs(tmp_path):
    """Without -m the design was ignored: Hydra trained one run on seed 0 and read no verdict."""
    result = run_cli("residual=block", "num_blocks=2", *TINY_SWEEP, *DESIGN, "hydra.run.dir=R", cwd=tmp_path,
                     timeout=300)
    assert one_line_error(result) == (
        "attnres-run: error: seeds.on_demand=true needs a sweep: add -m and the arms to compare (attnres-run -m "
        "residual=standard,block seeds.on_demand=true); without -m it would train one run on seed 0 and read no "
        "verdict, so leave seeds.on_demand=true out of a run alone")
    assert not list(tmp_path.iterdir())  # nothing written: no run folder, no outputs/


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slurm_sweep_adds_seeds_until_its_maximum(tmp_path):
    from tests.sweep.test_slurm import cluster_reason

    reason = cluster_reason()
    if reason:
        pytest.skip(reason)
    result = run_cli("-m", "hydra/launcher=slurm", "hydra.launcher.poll_s=1", "residual=standard,block",
                     "num_blocks=2", *TINY_SWEEP, *DESIGN, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path,
                     timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    check_looks(result.stdout, tmp_path / "sweep")
