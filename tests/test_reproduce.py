"""The CPU study (experiments/reproduce/): its shapes and budgets as STUDY_PLAN.md states them
(parameters counted on the meta device), the verdict rule of REPORT.md, a report built from no
runs, and run.py's refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from tests.helpers import REPO, cli_env

HERE = REPO / "experiments" / "reproduce"
sys.path.insert(0, str(HERE))
report = pytest.importorskip("report")  # experiments/reproduce/report.py
run = pytest.importorskip("run")  # experiments/reproduce/run.py
VOCAB = 1024
TOKENS_PER_STEP = 16 * 128


@pytest.fixture(scope="module")
def study():
    """shape -> (non-embedding parameters, all parameters, tokens) of experiment=repro_study."""
    GlobalHydra.instance().clear()
    found = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for shape in ("deep", "shallow", "w16", "w24", "w32"):
            cfg = compose("config", overrides=[f"hydra.searchpath=[file://{HERE / 'conf'}]", "experiment=repro_study",
                                               f"shape={shape}", "residual=block", "num_blocks=2"])
            assert (cfg.data.block_size, cfg.data.batch_size) == (128, 16)
            with torch.device("meta"):
                model = instantiate(cfg.model, vocab_size=VOCAB, residual=instantiate(cfg.residual))
            found[shape] = (model.num_parameters(exclude_embedding=True), model.num_parameters(),
                            cfg.trainer.max_steps * TOKENS_PER_STEP, cfg)
    GlobalHydra.instance().clear()
    return found


def test_the_study_trains_every_shape_on_at_least_20_tokens_per_parameter(study):
    for shape, (_, total, tokens, cfg) in study.items():
        assert tokens / total >= 20, (shape, tokens / total)
        assert cfg.optim.schedule.warmup_steps == round(0.05 * cfg.trainer.max_steps)  # 5% warm-up
        assert cfg.trainer.max_steps // cfg.trainer.val_check_interval == 10  # ten points on each curve


def test_deep_and_shallow_have_equal_non_embedding_parameters_and_the_ladder_one_ratio(study):
    deep, shallow = study["deep"], study["shallow"]
    assert (deep[3].model.n_layer, deep[3].model.n_embd, shallow[3].model.n_layer, shallow[3].model.n_embd) == \
        (8, 40, 2, 80)
    assert abs(deep[0] - shallow[0]) / deep[0] < 0.01  # Block's pseudo-queries differ, the matrices do not
    ratios = [tokens / total for _, total, tokens, _ in (study[s] for s in ("w16", "w24", "w32", "deep"))]
    assert max(ratios) / min(ratios) < 1.03, ratios  # the compute ladder: one tokens-per-parameter ratio
    assert [study[s][3].model.n_layer for s in ("w16", "w24", "w32")] == [8, 8, 8]


@pytest.mark.parametrize(("seeds", "paper", "word"), [
    ([-1.0, -1.2, -0.9, -1.1, -1.3], [-1.1, -1.5], "reproduced"),     # below zero, the paper's side
    ([-0.3, -0.25, -0.35, -0.3, -0.28], [-1.1, -1.5], "reproduced"),  # the side, not the size
    ([0.1, -0.1, 0.05, -0.05, 0.0], [-1.1, -1.5], "contradicted"),   # holds zero, excludes the paper's effect
    ([0.5, 0.6, 0.55, 0.45, 0.5], [-1.1, -1.5], "contradicted"),     # the other side
    ([0.5, -2.0, 0.3, -1.5, 0.2], [-1.1, -1.5], "not resolved"),     # holds both
    ([-0.5], [-1.1], "not resolved"),                                # one seed: no interval
])
def test_the_verdict_rule(seeds, paper, word):
    effect = report.Effect(dict(enumerate(seeds)))
    assert report.verdict(effect, paper) == word
    flipped = report.Effect({k: -v for k, v in effect.per_seed.items()})
    assert report.verdict(flipped, [-p for p in paper], lower=False) == word  # a claim that something grows


def test_a_report_from_no_runs_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "HERE", tmp_path)  # REPORT.md and figures/ go here, not into the repository
    written = report.write_report(tmp_path / "runs")
    text = written.read_text()
    assert written == tmp_path / "REPORT.md"
    assert "No runs yet: `python experiments/reproduce/run.py --parts ordering`." in text
    assert "No runs yet: `python experiments/reproduce/run.py --parts ladder`." in text
    assert "| ordering | standard, Block N=4, Full at the deep shape x 5 seeds | not run |" in text
    assert "Not run yet: `python experiments/reproduce/run.py --parts tasks`." in text


def test_run_py_refuses_an_unknown_part_in_one_line():
    ran = subprocess.run([sys.executable, str(HERE / "run.py"), "--parts", "shapes"], env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2
    assert ran.stderr.strip() == ("run.py: unknown part shapes; choose from prepare, ordering, blocksize, depth, "
                                  "tuned, tuned_seeds, ladder, tasks, depth_tuned")


def _fake_tasks_runs(out, values):
    """runs/tasks as the part writes it: seed -> (arm -> (attnres_pointer/acc, val/loss))."""
    import json

    targets = {"standard": "attnres.residuals.standard.StandardResidual",
               "block": "attnres.residuals.block.BlockAttentionResidual"}
    for seed, arms in values.items():
        for arm, (acc, loss) in arms.items():
            job = out / "tasks" / f"experiment=synthetic_depth,residual={arm},seed={seed}"
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nresidual:\n  _target_: {targets[arm]}\n")
            (job / "metrics.json").write_text(json.dumps({
                "status": "finished", "wall_time_s": 600.0,
                "metrics": {"attnres_pointer/acc": acc, "val/loss": loss, "val/accuracy": 0.5},
                "tasks": {"lm_eval_version": "0.4.13", "seconds": 4.0}}))


def _claim_counts(report_text: str) -> dict[str, int]:
    """The verdict words of a report's claims, its downstream-task claim (which a splice replaces) left out."""
    claims = [line for line in report_text.split("## Verdicts (")[1].split("\n## ")[0].splitlines()
              if line.startswith("- **") and "on a downstream task" not in line]
    words = [line.split("**")[1] for line in claims]
    return {w: words.count(w) for w in set(words)}


def _count_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[w]} {w}" for w in ("reproduced", "contradicted", "not resolved") if counts.get(w))


def test_the_tasks_section_pairs_the_arms_by_seed_and_splices_in_once(tmp_path, monkeypatch):
    import shutil
    import statistics

    from scipy import stats

    values = {0: {"standard": (0.40, 1.00), "block": (0.46, 0.98)},
              1: {"standard": (0.50, 1.10), "block": (0.55, 1.05)},
              2: {"standard": (0.30, 0.90), "block": (0.37, 0.90)}}
    _fake_tasks_runs(tmp_path / "runs", values)
    shutil.copy(HERE / "REPORT.md", tmp_path / "REPORT.md")
    monkeypatch.setattr(report, "HERE", tmp_path)
    for _ in range(2):  # the second splice replaces the first, section, claim and row alike
        text = report.splice_tasks(tmp_path / "runs").read_text()
    diffs = [100 * (v["block"][0] - v["standard"][0]) for v in values.values()]  # points of accuracy
    mean = statistics.fmean(diffs)
    half = stats.t.ppf(0.975, 2) * statistics.stdev(diffs) / 3 ** 0.5
    expected = f"{mean:+.2f} pt [{mean - half:+.2f}, {mean + half:+.2f}]"
    assert mean - half > 0  # so the claim is reproduced
    assert text.count(f"## {report.TASKS_TITLE}") == 1 and text.count("on a downstream task") == 1
    assert f"**{expected}** of `attnres_pointer/acc` (3 seeds" in text
    assert "- **reproduced**: Block AttnRes (N = 4) scores higher than the standard residual on a downstream " \
           "task" in text and f"through lm-eval: {expected} of accuracy" in text
    assert text.count("| tasks |") == 1
    assert text.index("## 7. Each arm") < text.index(f"## {report.TASKS_TITLE}") < text.index("## Not run at")
    original = (HERE / "REPORT.md").read_text()
    counts = _claim_counts(original)
    counts["reproduced"] = counts.get("reproduced", 0) + 1
    assert text.split("## Verdicts (")[1].split(")")[0] == _count_line(counts)
    assert (tmp_path / "figures" / "tasks_pointer.png").stat().st_size > 5000
    # the sections before it are as they were
    kept = original.split("## Training length")[1].split("## 7.")[0]
    assert kept == text.split("## Training length")[1].split("## 7.")[0]


def test_the_tasks_section_makes_no_claim_before_a_seed_has_both_arms(tmp_path, monkeypatch):
    import shutil

    _fake_tasks_runs(tmp_path / "runs", {0: {"standard": (0.40, 1.00)}, 1: {"block": (0.46, 0.98)}})
    shutil.copy(HERE / "REPORT.md", tmp_path / "REPORT.md")
    monkeypatch.setattr(report, "HERE", tmp_path)
    text = report.splice_tasks(tmp_path / "runs").read_text()
    assert "No seed has finished in both arms yet: no difference, and no claim line." in text
    assert "on a downstream task" not in text
    assert text.split("## Verdicts (")[1].split(")")[0] == _count_line(_claim_counts((HERE / "REPORT.md").read_text()))


CHILD = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
signal.signal(signal.SIGINT, lambda s, f: got.append(s))
open(sys.argv[1] + ".ready", "w").close()
end = time.monotonic() + 60
while time.monotonic() < end and not got:
    time.sleep(0.05)
time.sleep(1.0)  # a second signal, had one been sent, arrives here
open(sys.argv[1], "w").write(",".join(map(str, got)))
sys.exit(128 + got[0] if got else 0)
"""


@pytest.mark.parametrize(("sig", "group", "code"), [(signal.SIGTERM, False, 143), (signal.SIGINT, True, 130)],
                         ids=["kill-the-script", "ctrl-c-to-the-terminal-group"])
def test_run_py_passes_a_signal_on_to_its_sweep_exactly_once(tmp_path, sig, group, code):
    """`kill` of run.py (transfer/run.py shares it) stops the sweep it runs instead of leaving it
    running unseen, and a terminal's Ctrl-C reaches the sweep once, not twice (a second one would
    stop the jobs at once, without their step's save)."""
    record = tmp_path / "got"
    driver = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import run; from pathlib import Path; "
              f"sys.exit(run.call_forwarding([sys.executable, '-c', {CHILD!r}, {str(record)!r}], Path('.')))")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=tmp_path, start_new_session=True)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "got.ready").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "got.ready").exists()
        (os.killpg if group else os.kill)(proc.pid, sig)
        assert proc.wait(timeout=60) == code
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert record.read_text() == str(int(sig))


def test_running_one_part_where_the_others_runs_are_absent_keeps_their_sections(tmp_path, monkeypatch):
    """run.py --parts tasks on a machine that holds no other part's runs splices section 8 in and
    keeps sections 1 to 7 and their figures, instead of rebuilding REPORT.md from the runs there."""
    import shutil

    _fake_tasks_runs(tmp_path / "runs", {0: {"standard": (0.40, 1.00), "block": (0.46, 0.98)},
                                         1: {"standard": (0.50, 1.10), "block": (0.55, 1.05)}})
    shutil.copy(HERE / "REPORT.md", tmp_path / "REPORT.md")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "magnitude.png").write_bytes(b"kept")
    monkeypatch.setattr(report, "HERE", tmp_path)
    written, kept = report.update_report(tmp_path / "runs", ["tasks"])
    text = written.read_text()
    assert kept.startswith("REPORT.md kept as written: part(s) ordering, blocksize, depth, ladder, tuned, "
                           "tuned_seeds, depth_tuned have no runs in ")
    assert "section(s) of part(s) tasks updated" in kept
    original = (HERE / "REPORT.md").read_text()
    assert original.split("## Training length")[1].split("## 8.")[0].split("## Not run at")[0] == \
        text.split("## Training length")[1].split("## 8.")[0]  # sections 1 to 7 as they were
    assert "## 1. Loss ordering (Table 2)" in text and "No runs yet" not in text
    assert text.count(f"## {report.TASKS_TITLE}") == 1
    assert (tmp_path / "figures" / "magnitude.png").read_bytes() == b"kept"


def _study_copy(tmp_path, monkeypatch):
    """REPORT.md and its figures copied into tmp_path, where report.py writes (never the repository's)."""
    import shutil

    shutil.copy(HERE / "REPORT.md", tmp_path / "REPORT.md")
    shutil.copytree(HERE / "figures", tmp_path / "figures")
    monkeypatch.setattr(report, "HERE", tmp_path)
    return {p: p.read_bytes() for p in [tmp_path / "REPORT.md", *sorted((tmp_path / "figures").iterdir())]}


@pytest.mark.parametrize("parts", [[], ["--parts", "tuned"], ["--parts", "tasks"]], ids=["all", "tuned", "tasks"])
def test_report_only_from_a_folder_without_runs_is_refused_and_keeps_the_report_and_figures(
        tmp_path, monkeypatch, capsys, parts):
    """`run.py --report-only --out EMPTY` rewrote REPORT.md with no verdicts and deleted its figures."""
    import run

    before = _study_copy(tmp_path, monkeypatch)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "nothing"):
        assert run.main(["--report-only", "--out", str(out), *parts]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"run.py: {out} holds no runs of part(s) "), err
    assert not (tmp_path / "nothing").exists()  # refused before anything is written
    assert {p: p.read_bytes() for p in before} == before
    assert sorted((tmp_path / "figures").iterdir()) == sorted(p for p in before if p.suffix == ".png")


def test_report_only_from_one_parts_runs_splices_that_part_and_keeps_the_rest(tmp_path, monkeypatch, capsys):
    import run

    before = _study_copy(tmp_path, monkeypatch)
    _fake_tasks_runs(tmp_path / "runs", {0: {"standard": (0.40, 1.00), "block": (0.46, 0.98)},
                                         1: {"standard": (0.50, 1.10), "block": (0.55, 1.05)}})
    assert run.main(["--report-only", "--out", str(tmp_path / "runs")]) == 0
    assert "REPORT.md kept as written: part(s) ordering," in capsys.readouterr().out
    text = (tmp_path / "REPORT.md").read_text()
    assert "## 1. Loss ordering (Table 2)" in text and "No runs yet" not in text
    kept = [p for p in before if p.suffix == ".png" and p.name != "tasks_pointer.png"]
    assert {p: p.read_bytes() for p in kept} == {p: before[p] for p in kept}  # every other part's figure stays


@pytest.mark.slow
def test_run_py_stops_after_a_sigterm_before_its_next_sweep_whatever_the_sweep_exits_with(tmp_path):
    """The sweep a `kill` reaches may exit 1 (its jobs stopped): run.py stops all the same."""
    child = ("import signal, sys, time\nfrom pathlib import Path\nPath(sys.argv[1]).touch()\n"
             "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(1))\ntime.sleep(60)\n")
    driver = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(HERE)!r})
import report, run
report.HERE = Path({str(tmp_path)!r})  # the repository's report stays as it is
started = []
def fake_sweep(sweep, out, jobs, deadline=None):
    started.append(sweep.folder)
    return run.call_forwarding([sys.executable, "-c", {child!r}, {str(tmp_path)!r} + "/" + sweep.folder], Path("."))
run.run_sweep, run.prepare = fake_sweep, lambda: 0
code = run.main(["--parts", "ordering,blocksize", "--out", {str(tmp_path / 'out')!r}])
Path({str(tmp_path / 'started')!r}).write_text(",".join(started))
sys.exit(code)
"""
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=tmp_path, env=cli_env(), start_new_session=True)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "ordering").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "ordering").exists()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "started").read_text() == "ordering"


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    """A small token folder in place of part prepare's tokenized stdlib (its vocabulary, 1,024)."""
    from attnres.data.prepare import main as prepare

    folder = tmp_path_factory.mktemp("tokens")
    words = "the quick brown fox jumps over a lazy dog def return import class while".split()
    text = "\n".join(" ".join(words[(j + k) % len(words)] for k in range(10)) + f" {j}" for j in range(3000))
    (folder / "corpus.txt").write_text(text + "\n")
    prepare([str(folder / "corpus.txt"), str(folder / "stdlib-1k"), "--vocab-size", str(VOCAB), "--workers", "1"])
    return folder / "stdlib-1k"


@pytest.mark.parametrize("part", [p.name for p in run.PARTS if p.sweeps])
def test_every_parts_sweep_composes_and_passes_the_runners_checks(part, token_folder):
    """A part whose command line the runner would refuse (a typo in a key, a bad value) fails here,
    not after the parts before it have run for hours."""
    from attnres.config.command import check_command_line

    data = [f"data.path={token_folder}"] if part in run.NEEDS_DATA else []  # part prepare's folder is not here
    for sweep in next(p for p in run.PARTS if p.name == part).sweeps:
        check_command_line(["-m", f"hydra.searchpath=[file://{run.CONF}]", *sweep.overrides, *data], REPO / "conf")
        if sweep.carried:  # decided by the part's earlier sweep: not before it has run (tests/test_depth_study.py)
            with pytest.raises(ValueError, match="run the part again"):
                sweep.carried(token_folder.parent / "no runs here")
