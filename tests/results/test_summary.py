"""Sweep summaries (attnres/results/summary.py, attnres/results/summary_figure.py, and the sweep's
end-of-sweep callback attnres/sweep/callback.py): statuses counted whole, unfinished jobs counted,
nested folders found, experiments/summarize.py."""

from __future__ import annotations

import json
from pathlib import Path

from attnres.results.summary import format_counts, status_counts
from tests.helpers import REPO, run_script


def test_statuses_with_spaces_are_counted_whole():
    counts = status_counts(["finished", "timed out", "timed out", "not finished", "duplicate of seed=0"])
    assert counts == {"finished": 1, "timed out": 2, "not finished": 1, "duplicate": 1}
    assert format_counts(counts) == "5 jobs, 1 finished, 2 timed out, 1 duplicate, 1 not finished"


def _fake_job(folder: Path, overrides: list[str], metrics: dict | None) -> None:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\nresidual: {}\n")
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))


def test_summarize_counts_unfinished_jobs_and_finds_nested_folders(tmp_path):
    sweep = tmp_path / "sweep"
    _fake_job(sweep / "seed=0", ["seed=0"], {"status": "finished", "metrics": {"val/loss": 1.0}})
    _fake_job(sweep / "seed=1", ["seed=1"], None)  # never got to write metrics.json
    _fake_job(sweep / "data.path=" / "tmp" / "x", ["seed=2", "data.path=/tmp/x"], {"status": "failed"})  # old naming
    result = run_script("experiments/summarize.py", str(sweep), cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 jobs, 1 finished, 1 failed, 1 unfinished" in result.stdout.splitlines()[0], result.stdout
    header = next(line for line in (sweep / "summary.md").read_text().splitlines() if line.startswith("3 jobs"))
    assert header.startswith("3 jobs: 1 finished, 1 failed, 1 unfinished."), header
    assert "not" not in header.split(".")[0]


def _md_header(sweep: Path) -> list[str]:
    table = [line for line in (sweep / "summary.md").read_text().splitlines() if line.startswith("| ")]
    return [cell.strip() for cell in table[0].strip("|").split("|")]


def test_summary_md_shows_only_the_columns_some_job_fills(tmp_path):
    from attnres.results.summary import COLUMNS, write_sweep_summary

    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        _fake_job(sweep / f"seed={seed}", [f"seed={seed}"],
                  {"status": "finished", "metrics": {"val/loss": 1.0, "val/bpb": 1.4 + seed}, "tokens_per_sec": 9.0})
    write_sweep_summary(sweep)
    header = _md_header(sweep)
    assert "val/accuracy" not in header and "error" not in header and "slot" not in header, header
    assert header[:2] == ["job", "config"] and {"status", "val/loss", "val/bpb", "tokens_per_sec"} <= set(header)
    with open(sweep / "summary.csv") as f:
        assert f.readline().strip().split(",") == COLUMNS  # the CSV keeps its columns, for the programs reading it
    _fake_job(sweep / "seed=2", ["seed=2"], {"status": "failed", "error": "RuntimeError: boom"})
    write_sweep_summary(sweep)
    assert "error" in _md_header(sweep)  # now a job fills it
    assert "RuntimeError: boom" in (sweep / "summary.md").read_text()


def test_trial_names_are_what_differs_between_the_jobs_and_stay_unique_in_the_folder(tmp_path):
    from attnres.results.summary import TRIAL_NAMES, trial_name, write_trial_names

    sweep = tmp_path / "quick"
    long = "model.n_layer=2,num_blocks=2,residual={r},seed={s},trainer.max_steps=20"
    jobs = {long.format(r=r, s=s): {"model.n_layer": "2", "num_blocks": "2", "residual": r, "seed": str(s),
                                    "trainer.max_steps": "20"} for r in ("standard", "block") for s in (0, 1)}
    for name, overrides in jobs.items():
        _fake_job(sweep / name, [f"{k}={v}" for k, v in overrides.items()], None)
    names = write_trial_names(sweep, jobs)
    assert names[long.format(r="block", s=1)] == "residual=block,seed=1 (quick)"
    assert len(set(names.values())) == 4
    assert trial_name(sweep / long.format(r="standard", s=0)) == "residual=standard,seed=0 (quick)"
    assert trial_name(tmp_path / "alone") is None and trial_name(sweep / "not-a-job") is None
    # a later sweep into the same folder: the earlier runs' overrides count, so no name repeats one of theirs
    _fake_job(sweep / "seed=0", ["residual=block", "seed=0", "model.n_layer=4"], None)
    later = write_trial_names(sweep, {"seed=0": {"residual": "block", "seed": "0", "model.n_layer": "4"}})
    assert later["seed=0"] == "model.n_layer=4,residual=block,seed=0 (quick)"
    assert len(set(later.values())) == 5 and (sweep / TRIAL_NAMES).is_file()
