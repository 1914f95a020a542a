"""experiments/transfer/run.py: its sweeps, its refusals, and the report it writes from tuned
sweeps' records (the study itself runs by hand: docs/strategies.md#parametrizations)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

from attnres.results import tuning
from tests.helpers import REPO, cli_env

SCRIPT = REPO / "experiments" / "transfer" / "run.py"


def _load():
    spec = importlib.util.spec_from_file_location("transfer_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_study_is_four_tuned_sweeps_with_the_smallest_size_as_the_mup_base():
    run = _load()
    folders = dict(run.sweeps(["width", "depth"]))
    assert list(folders) == ["width_standard", "width_mup", "depth_standard", "depth_mup"]
    assert "model.n_embd=32,64,128,256" in folders["width_mup"] and "model.base_width=32" in folders["width_mup"]
    assert "model.parametrization=mup" not in folders["width_standard"]
    assert "model.n_layer=4,8,16" in folders["depth_mup"] and "model.base_depth=4" in folders["depth_mup"]
    assert all("tune=lr" in o and "residual=standard,block" in o for o in folders.values())


def test_run_py_refuses_an_unknown_axis_in_one_line():
    ran = subprocess.run([sys.executable, str(SCRIPT), "--axes", "height"], env=cli_env(), capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 2
    assert ran.stderr.strip() == "run.py: unknown axis height; choose from width, depth"


def _sweep_state(best_by_size: dict[int, int], key: str) -> dict:
    """A finished grid search per (size, strategy) whose mean loss is lowest at exponent best_by_size[size]."""
    groups = []
    for size, best in best_by_size.items():
        for strategy in ("standard", "block"):
            trials = [{"point": k, "seed": seed, "status": "finished",
                       "value": (k - best) ** 2 + 1.0 + 0.01 * (seed - 1000)}
                      for k in range(-2, 3) for seed in (1000, 1001)]
            groups.append({"label": f"{size} {strategy}", "overrides": [f"{key}={size}", f"residual={strategy}"],
                           "centre": {"optim.optimizer.lr": 3e-3}, "trials": trials, "chosen": best})
    return {"signature": {"grid": {"factor": 2.0}}, "tuning_seeds": [1000, 1001], "groups": groups, "arms": []}


def test_the_report_names_each_sizes_optimum_and_how_far_it_moved(tmp_path):
    run = _load()
    out = tmp_path / "runs"
    tuning.write_state(out / "width_standard", _sweep_state({32: 0, 64: 1, 128: 2, 256: 2}, "model.n_embd"))
    tuning.write_state(out / "width_mup", _sweep_state({32: 0, 64: 0, 128: 1, 256: 0}, "model.n_embd"))
    target = run.report(out, tmp_path / "TRANSFER.md")
    text = target.read_text()
    assert ("- standard, parametrization=standard: 0.003 at 32, 0.006 at 64, 0.012 at 128 (edge), 0.012 at 256 "
            "(edge): moves by 2 grid steps (a factor of 4); an optimum at the grid's edge is a bound") in text
    assert "- block, parametrization=mup: 0.003 at 32, 0.003 at 64, 0.006 at 128, 0.003 at 256: stays within one " \
           "grid step" in text
    assert "Not run yet: `python experiments/transfer/run.py --axes depth`." in text
    assert (tmp_path / "figures" / "transfer_width.png").stat().st_size > 10_000
    curves = run.curves(tuning.read_state(out / "width_mup"), "model.n_embd")
    assert math.isclose(curves[("block", 128)]["best"], 6e-3) and len(curves[("block", 128)]["points"]) == 10


def test_the_answers_say_plainly_which_setting_transfers(tmp_path):
    run = _load()
    out = tmp_path / "runs"
    tuning.write_state(out / "depth_standard", _sweep_state({4: -1, 8: 0, 16: 1}, "model.n_layer"))
    tuning.write_state(out / "depth_mup", _sweep_state({4: 0, 8: 0, 16: 1}, "model.n_layer"))
    text = run.report(out, tmp_path / "TRANSFER.md").read_text()
    answers = text.split("## Answers")[1]
    assert ("- Across depth, the standard residual: the optimum moves 2 grid steps under the standard "
            "parametrization and 1 grid step under mup: mup transfers it, the standard parametrization does not."
            ) in answers
    assert ("- Does Block AttnRes transfer across depth unaided (the standard parametrization), where the standard "
            "residual does not? no: both optima move (2 grid steps against 2 grid steps).") in answers
    found = {"depth": {"standard": run.curves(tuning.read_state(out / "depth_mup"), "model.n_layer"),
                       "mup": run.curves(tuning.read_state(out / "depth_standard"), "model.n_layer")}}
    swapped = "\n".join(run.answers(found))  # mup moving more than standard is said, not hidden
    assert "mup moves it more than the standard parametrization does: mup does not transfer it here" in swapped
    assert "no: Block's optimum moves where the standard residual's does not" not in swapped
    assert "neither moves by more than one step at these depths" in swapped
    assert "Across width" not in answers  # an axis not run has no answer


def test_an_axis_started_but_without_a_finished_search_says_so_and_draws_nothing(tmp_path):
    run = _load()
    out = tmp_path / "runs"
    state = _sweep_state({32: 0, 64: 0}, "model.n_embd")
    for group in state["groups"][:2]:
        group["trials"] = []  # the search's first batch still running
        del group["chosen"]
    for group in state["groups"][2:]:  # stopped (SIGTERM) after some trials: no optimum yet either
        del group["chosen"]
    tuning.write_state(out / "width_standard", state)
    text = run.report(out, tmp_path / "TRANSFER.md").read_text()
    assert "Started, no search finished yet: `python experiments/transfer/run.py --axes width` continues it." in text
    assert not (tmp_path / "figures" / "transfer_width.png").exists() and "## Answers" not in text


def test_a_report_from_a_clone_without_runs_keeps_what_was_measured(tmp_path):
    """The runs are not in the repository: `--report-only` on a fresh clone must keep each measured
    axis, its answers and base_search.py's block, not write "Not run yet" over them."""
    run = _load()
    out = tmp_path / "runs"
    tuning.write_state(out / "width_standard", _sweep_state({32: -1, 64: 0, 128: 1, 256: 2}, "model.n_embd"))
    tuning.write_state(out / "width_mup", _sweep_state({32: 0, 64: 0, 128: 1, 256: 0}, "model.n_embd"))
    target = run.report(out, tmp_path / "TRANSFER.md")
    block = "<!-- base_search.py: start -->\n## What mup carries\n\n- a line\n<!-- base_search.py: end -->"
    target.write_text(target.read_text() + "\n" + block + "\n")
    measured = target.read_text()
    for _ in range(2):  # twice: keeping is stable
        text = run.report(tmp_path / "empty", target).read_text()
        width = text.split("## Across width")[1].split("## Across depth")[0]
        assert "moves by 3 grid steps" in width and "stays within one grid step" in width
        assert width.count("(Kept from the last report: the output folder holds no runs of this axis.)") == 1
        assert "Not run yet: `python experiments/transfer/run.py --axes depth`." in text
        answers = text.split("## Answers")[1]
        assert "- Across width, the standard residual: the optimum moves 3 grid steps" in answers
        assert text.count(block) == 1 and text.index(block) > text.index("Where this does not hold")
    assert measured.split("## Answers")[1].split("Where")[0] in text  # the answers word for word
    fresh = run.report(out, target).read_text()  # runs again: rebuilt from them, the mark gone
    assert "(Kept from" not in fresh and fresh.count(block) == 1


def _base_search():
    spec = importlib.util.spec_from_file_location("transfer_base_search", SCRIPT.parent / "base_search.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs(bs, best: dict[str, tuple[float, float]], target: dict[tuple[str, str], list[float]]) -> list[dict]:
    runs = []
    for strategy, (lr0, init0) in best.items():
        for lr in bs.LRS:
            for init in bs.INIT_STDS:
                for seed in bs.TUNING_SEEDS:
                    loss = 2.0 + abs(math.log2(lr / lr0)) + abs(math.log2(init / init0)) + 0.001 * seed
                    runs.append({"strategy": strategy, "seed": seed, "width": bs.BASE_WIDTH, "parametrization": "mup",
                                 "lr": lr, "init_std": init, "loss": loss})
    arms = {"standard": ("standard", bs.STANDARD_BEST_AT_TARGET, 0.02), "mup": ("mup", bs.MUP_BEST_AT_BASE, 0.02)}
    for (strategy, arm), losses in target.items():
        parametrization, lr, init = arms.get(arm) or ("mup", *best[strategy])
        for seed, loss in zip(bs.SEEDS, losses, strict=False):
            runs.append({"strategy": strategy, "seed": seed, "width": bs.TARGET_WIDTH,
                         "parametrization": parametrization, "lr": lr, "init_std": init, "loss": loss})
    return runs


def test_the_base_search_picks_the_lowest_complete_pair_and_runs_it_at_the_target():
    bs = _base_search()
    runs = _runs(bs, {"standard": (0.012, 0.04), "block": (0.024, 0.04)}, {})
    assert bs.choose(runs) == {"standard": (0.012, 0.04), "block": (0.024, 0.04)}
    diverged = [dict(r, loss=math.nan) if (r["strategy"], r["lr"], r["init_std"], r["seed"]) ==
                ("standard", 0.012, 0.04, 1001) else r for r in runs]
    assert bs.choose(diverged)["standard"] != (0.012, 0.04)  # a diverged seed rules its pair out
    assert "block" not in bs.choose([r for r in runs if not (r["strategy"] == "block" and r["lr"] == 0.048)])
    sweeps = dict(bs.target_sweeps({"standard": (0.012, 0.04), "block": (0.012, 0.04)}))
    assert list(sweeps) == ["target_standard", "target_mup", "target_mup_lr0.012_init0.04"]  # one sweep per pair
    assert "residual=standard,block" in sweeps["target_mup_lr0.012_init0.04"]
    assert "model.parametrization=mup" not in sweeps["target_standard"]
    assert "optim.optimizer.lr=0.0015" in sweeps["target_standard"]
    assert len(bs.target_sweeps({"standard": (0.012, 0.04), "block": (0.024, 0.04)})) == 4


def test_the_base_search_section_pairs_each_arm_with_standard_by_seed():
    bs = _base_search()
    runs = _runs(bs, {"standard": (0.012, 0.04), "block": (0.024, 0.04)},
                 {("standard", "standard"): [1.80, 1.82, 1.81], ("standard", "mup"): [2.05, 2.09, 2.06],
                  ("standard", "tuned"): [1.85, 1.86, 1.88], ("block", "standard"): [1.79, 1.81]})
    text = bs.section(runs)
    assert text.startswith(bs.START) and text.endswith(bs.END)
    assert "Chosen at the base: lr 0.012, init_std 0.04." in text
    edge = bs.section(_runs(bs, {"standard": (0.048, bs.INIT_STDS[-1])}, {}))
    assert f"init_std {bs.INIT_STDS[-1]:g} (lr on its grid's edge and init_std on its grid's edge: a bound" in edge
    assert "- mup (init_std 0.02) minus standard: +0.257 nats [" in text
    assert "- mup (base-tuned) minus standard: +0.053 nats [" in text
    block = text.split("**Block N=4**")[1]
    assert "over 2 seed(s)" in block and "mup at the base's best lr (0.024), init_std 0.02: not run yet" in block
    assert "minus standard" not in block  # nothing to pair with yet
    assert bs.splice("a\n" + text + "\nb", "NEW") == "a\nNEW\nb" and bs.splice("a", "NEW") == "a\n\nNEW\n"


SWEEP_STOPPED_BY_SIGTERM = """
import signal, sys, time
from pathlib import Path
Path(sys.argv[1]).touch()
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(1))  # a sweep whose jobs stopped: 1, not 143
time.sleep(60)
"""


def test_a_sigterm_stops_the_study_before_its_next_sweep_whatever_the_sweep_exits_with(tmp_path):
    """A `kill` of run.py reaches the sweep running; a sweep that then exits 1 (its jobs stopped)
    must not be followed by the next one (it ran on for 9 minutes), as after Ctrl-C."""
    import os
    import signal
    import time

    driver = f"""
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("transfer_run", {str(SCRIPT)!r})
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
started = []
def fake_sweep(folder, overrides, out, jobs):
    started.append(folder)
    return run.call_forwarding([sys.executable, "-c", {SWEEP_STOPPED_BY_SIGTERM!r}, {str(tmp_path)!r} + "/" + folder],
                               Path("."))
run.run_sweep = fake_sweep
run.report = lambda out: Path(out) / "TRANSFER.md"  # the repository's report stays as it is
code = run.main(["--axes", "width", "--out", {str(tmp_path / 'out')!r}])
Path({str(tmp_path / 'started')!r}).write_text(",".join(started))
sys.exit(code)
"""
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=tmp_path, env=cli_env(), start_new_session=True)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "width_standard").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "width_standard").exists()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "started").read_text() == "width_standard"


def test_report_only_from_a_folder_without_runs_is_refused_in_one_line_and_writes_nothing(tmp_path):
    """(A copy of the study's scripts and report: the repository's TRANSFER.md is never at stake.)"""
    import shutil

    study = tmp_path / "experiments"
    shutil.copytree(SCRIPT.parent, study / "transfer", ignore=shutil.ignore_patterns("runs", "__pycache__"))
    (study / "reproduce").mkdir()
    shutil.copy(REPO / "experiments" / "reproduce" / "run.py", study / "reproduce" / "run.py")
    before = (study / "transfer" / "TRANSFER.md").read_bytes()
    ran = subprocess.run([sys.executable, str(study / "transfer" / "run.py"), "--report-only", "--out",
                          str(tmp_path / "none")], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2, ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1 and "holds no runs of the study's sweeps" in ran.stderr
    assert not (tmp_path / "none").exists()
    assert (study / "transfer" / "TRANSFER.md").read_bytes() == before
