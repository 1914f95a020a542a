"""experiments/gpu_check.sh (docs/gpu.md), the one script a lent GPU runs: its dry run on the CPU
goes through every stage and writes each stage's file with sane figures; a stage the time budget
leaves no room for still gets its file, saying so; bad arguments are one line and exit 2; the
wheels it carries follow pyproject.toml; its collection compares the runner with the bare step
only where both ran the same thing; and docs/gpu.md shows only options the script has."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest

from attnres.ops.dispatch import triton_available
from tests.helpers import REPO, cli_env

SCRIPT = REPO / "experiments" / "gpu_check.sh"
FILES = {"stages.json", "summary.md", "log.txt", "a_tests.json", "b_bench.json", "c_runner.json", "d_summary.md",
         "e_kernels.json"}
STRATEGIES = ("standard", "block", "full")


def script(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = cli_env({"PYTHON": sys.executable, **(env or {})})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def experiment(name: str, monkeypatch):
    """experiments/<name>.py as a module (the folder is not a package; its scripts import each other)."""
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# == the dry run ===================================================================================
def check_a(a: dict) -> None:
    assert a["totals"]["passed"] > 0 and a["totals"]["failed"] == 0 and a["totals"]["errors"] == 0, a["totals"]
    assert set(a["invocations"]) == {"gpu", "kernels"}
    kernels = a["invocations"]["kernels"]
    assert kernels["passed"] > 20 and "triton" in kernels["command"], kernels  # the interpreted Triton cases ran


def check_b(b: dict) -> None:
    assert b["info"]["kernel_resolved"] == "triton"  # the GPU's path, in Triton's interpreter
    eager = b["modes"]["eager"]
    assert set(eager) == {*STRATEGIES, "block-prenorm", "full-prenorm"}  # eager also times the pre-norm fused
    for name, row in eager.items():
        assert positive(row["train_step_s"]) and positive(row["prefill_s"]) and positive(row["tokens_per_s"]), name
        assert positive(row["vs_standard"]["train_step_s"]), name
    assert eager["standard"]["vs_standard"]["train_step_s"] == 1.0
    assert {"naive", "torch"} <= set(b["op"]["kernels"])
    assert b["invocations"]["eager"]["status"] == "ok"
    assert b["invocations"]["decode"]["status"] == "ok"  # bench_decode.py, its figures under "decode"
    routes = b["decode"]["shapes"]["tiny"]["routes"]
    assert set(routes) == {"attnres", "hf", "steps"}
    for route, rows in routes.items():
        assert set(rows) == set(STRATEGIES), route
        for name, row in rows.items():
            assert positive(row["token_s"]) and positive(row["prefill_s"]), (route, name)
            assert positive(row["vs_standard"]["token_s"][0]), (route, name)
        assert rows["standard"]["vs_standard"]["token_s"][0] == 1.0


def check_c(c: dict) -> None:
    assert c["setup"]["shape"]["vocab"] == 64 and c["bench_shape_matches"]
    runs = [*(("eager", n) for n in STRATEGIES), ("compiled", "block")]  # --dry compiles Block only
    for mode, name in runs:
        r = c["runs"][mode][name]
        assert r["status"] == "finished" and r["steps"] == 10, (mode, name, r)
        for key in ("tokens_per_sec_steady", "tokens_per_sec_metrics_json", "mfu_steady", "peak_memory_bytes"):
            assert positive(r[key]), (mode, name, key, r[key])
        assert 3.0 < r["val_loss"] < 6.0, r["val_loss"]  # random tokens of a vocabulary of 64: ln 64 = 4.16
    standard = c["runs"]["eager"]["standard"]
    assert positive(standard["over_bare_step"]["steady"]) and standard["vs_standard"]["tokens_per_sec"] == 1.0
    # (b) interpreted Triton where the runner took the C++ kernel: no ratio for the AttnRes strategies
    assert not c["bench_kernel_matches"] and c["runs"]["eager"]["block"]["over_bare_step"]["steady"] is None


def check_e(e: dict) -> None:
    variants = e["compiled_for_target"]["variants"]
    assert variants and all(v["regs"] > 0 and v["warps_per_sm"] > 0 for v in variants)
    assert e["compiled_for_target"]["header"].startswith("triton ") and "sm_90" in e["compiled_for_target"]["header"]
    assert e["on_device"]["gpu"] is None  # no GPU here: nothing loaded, and the file says why


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="the dry run interprets the Triton kernels: needs triton")
def test_dry_run_writes_every_stage_file(tmp_path):
    """One test, so that the dry run (minutes) runs once even when the suite is spread over processes."""
    out = tmp_path / "out"
    result = script("--dry", "--out", str(out), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == FILES  # at most 8 files come back from a lent machine
    state = json.loads((out / "stages.json").read_text())
    assert state["env"]["dry"] is True
    assert {s: v["status"] for s, v in state["stages"].items()} == dict.fromkeys("abcde", "ok")
    check_a(json.loads((out / "a_tests.json").read_text()))
    check_b(json.loads((out / "b_bench.json").read_text()))
    check_c(json.loads((out / "c_runner.json").read_text()))
    assert "4 jobs: 4 finished" in (out / "d_summary.md").read_text()
    assert state["stages"]["d"]["sweep"]["slots"] == ["gpu0.0", "gpu0.1"]  # jobs_per_gpu=2 on one (simulated) GPU
    check_e(json.loads((out / "e_kernels.json").read_text()))
    summary = (out / "summary.md").read_text()
    assert all(re.search(rf"^\| {s} \|.*\| ok \|", summary, re.M) for s in "abcde"), summary


@pytest.mark.slow
def test_a_stage_without_time_left_still_gets_its_file(tmp_path):
    out = tmp_path / "out"
    result = script("--dry", "--stages", "e", "--out", str(out), env={"GPU_CHECK_BUDGET": "5"}, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    e = json.loads((out / "e_kernels.json").read_text())
    assert e["stage"]["status"] == "not run" and "| e |" in (out / "summary.md").read_text()


# == arguments, wheels, docs =======================================================================
@pytest.mark.parametrize("args,says", [(["--stages", "a,x"], "--stages takes letters"),
                                       (["--frobnicate"], "unknown argument --frobnicate"),
                                       (["--out"], "--out needs a folder")])
def test_bad_arguments_are_one_line_and_exit_2(args, says):
    result = script(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr


def test_the_wheels_follow_pyproject(monkeypatch):
    """--fetch-wheels downloads what the device lacks with pyproject.toml's own specifiers, and the
    editable install's build backend meets the build-system requirement."""
    env = experiment("gpu_check_env", monkeypatch)
    deps = env.pyproject()["project"]["dependencies"]
    wheels = env.wheels()
    for name in env.DEVICE_LACKS:
        assert env.spec_of(name, deps) in wheels, name
    build = env.pyproject()["build-system"]["requires"]
    assert all(req in wheels for req in build), (build, wheels)


def write_run(folder, tokens_per_sec: list[float], peak: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    folder.mkdir(parents=True)
    with SummaryWriter(str(folder)) as writer:
        for step, value in enumerate(tokens_per_sec):
            writer.add_scalar("perf/tokens_per_sec", value, step)
    seen = 100 * len(tokens_per_sec)
    (folder / "metrics.json").write_text(json.dumps({
        "status": "finished", "steps": len(tokens_per_sec), "tokens_seen": seen, "peak_memory_bytes": peak,
        "tokens_per_sec": seen / sum(100 / v for v in tokens_per_sec), "metrics": {"val/loss": 4.0}}))


def test_the_runner_is_held_against_the_bare_step_of_the_same_shape_and_kernel(tmp_path, monkeypatch):
    collect = experiment("gpu_check_collect", monkeypatch)
    c = tmp_path / "c"
    shape = {"batch": 2, "seq_len": 50, "vocab": 64, "n_layer": 2, "n_embd": 32, "n_head": 2}
    (c / "runs").mkdir(parents=True)
    (c / "setup.json").write_text(json.dumps({"shape": shape, "skip_steps": 3, "kernel_resolved": "triton"}))
    write_run(c / "runs" / "standard-eager", [10.0, 20.0, 30.0, 1000.0, 1000.0, 1100.0], peak=1000)  # 3 slow steps
    write_run(c / "runs" / "block-eager", [10.0, 20.0, 30.0, 500.0, 500.0, 550.0], peak=1500)
    bench = {"info": {"shape": shape, "kernel_resolved": "triton"},
             "modes": {"eager": {"standard": {"tokens_per_s": 2000.0}, "block": {"tokens_per_s": 1000.0}}}}
    out = collect.collect_c(c, bench)
    std, block = out["runs"]["eager"]["standard"], out["runs"]["eager"]["block"]
    # the median of the steps after the first 3
    assert std["tokens_per_sec_steady"] == 1000.0 and block["tokens_per_sec_steady"] == 500.0
    assert std["over_bare_step"]["steady"] == 0.5 and block["over_bare_step"]["steady"] == 0.5
    assert block["vs_standard"] == {"tokens_per_sec": 0.5, "peak_memory": 1.5}
    assert std["tokens_per_sec_metrics_json"] < 100 and std["train_s_beyond_steady"] > 9  # the compiling step
    bench["info"]["kernel_resolved"] = "cpu"  # another implementation of the op: only standard compares
    out = collect.collect_c(c, bench)
    assert out["runs"]["eager"]["block"]["over_bare_step"]["steady"] is None
    assert out["runs"]["eager"]["standard"]["over_bare_step"]["steady"] == 0.5
    bench["info"]["shape"] = {**shape, "seq_len": 1024}  # another shape: nothing compares
    assert collect.collect_c(c, bench)["runs"]["eager"]["standard"]["over_bare_step"]["steady"] is None


def test_docs_show_only_the_scripts_options():
    """docs/gpu.md shows gpu_check.sh's commands in text blocks (tests/test_docs.py has no rule for
    the script); they are checked here: every option they use is one the script's usage names."""
    usage = re.search(r'USAGE="usage: ([^"]+)"', SCRIPT.read_text()).group(1)
    known = set(re.findall(r"--[\w-]+", usage))
    shown = [line for line in (REPO / "docs" / "gpu.md").read_text().splitlines()
             if line.lstrip().startswith(("experiments/gpu_check.sh", "GPU_CHECK"))]
    assert len(shown) >= 3
    for line in shown:
        used = set(re.findall(r"(?<![\w-])--[\w-]+", line.split("#")[0]))
        assert used <= known, f"docs/gpu.md: {line.strip()}: {sorted(used - known)} not in {usage}"
