"""The command line (cli.py, attnres/_entry.py, `python -m attnres`): --help, the real CLI training
each strategy, bad input and mistaken commands refused in one line with exit status 2 and nothing
written, and a built wheel that finds its configs from anywhere. (The checks behind the refusals
are tested in-process in tests/config/.)"""

from __future__ import annotations

import re
import site as site_module
import subprocess
import sys
import sysconfig
import venv

import pytest

from tests.config.test_command import THROUGH_CLI, _command, _rows
from tests.helpers import (
    CONF,
    REPO,
    RUN_STEPS,
    TINY,
    TINY_CHECKED,
    cli_env,
    metrics,
    one_line_error,
    run_cli,
    tiny,
)


def test_help_lists_every_group_without_importing_lightning(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    groups = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "hydra")
    for group in [*groups, "hydra/launcher", "experiment/paper_ablation"]:
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
                           capture_output=True, text=True, cwd=tmp_path, env=cli_env())
    assert probe.stdout.strip().endswith("light"), probe.stdout[-500:]


@pytest.mark.parametrize("args", [["model.n_layers=4"], ["residual=blok"], ["trainer.max_steps=-5"],
                                  ["-m", "residual=standard,blok"]])
def test_a_mistaken_command_is_answered_before_torch_is_imported(tmp_path, args):
    """Issue "The first hour", item 2: the one line came after torch and Lightning had been imported
    (10 s on a loaded machine); experiments/bench_first_answer.py measures it against --help."""
    probe = subprocess.run([sys.executable, "-c", "import atexit, sys; atexit.register(lambda: print('TORCH' if "
                            "'torch' in sys.modules else 'NO TORCH')); sys.argv = ['attnres-run', *sys.argv[1:]];"
                            "from attnres._entry import main; main()", *args],
                           capture_output=True, text=True, cwd=tmp_path, env=cli_env())
    assert probe.returncode == 2 and probe.stderr.startswith("attnres-run: error: "), probe.stderr[-2000:]
    assert probe.stdout.strip() == "NO TORCH"


@pytest.mark.parametrize("args", [["--cfg", "job"], ["--cfg", "job", "residual=block", "num_blocks=4"]])
def test_cfg_job_prints_the_config_without_torch(tmp_path, args):
    """Issue "The first hour, round two", item 4: `--cfg job`, which the typo answer sends users to,
    imported Lightning through the run's report (22-25 s under load against the typo answer's 2.3 s)."""
    probe = subprocess.run([sys.executable, "-c", "import atexit, sys; atexit.register(lambda: print('TORCH' if "
                            "'torch' in sys.modules else 'NO TORCH')); sys.argv = ['attnres-run', *sys.argv[1:]];"
                            "from attnres._entry import main; main()", *args],
                           capture_output=True, text=True, cwd=tmp_path, env=cli_env())
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert "max_steps:" in probe.stdout and probe.stdout.strip().endswith("NO TORCH"), probe.stdout[-500:]


def test_python_dash_m_attnres_is_attnres_run(monkeypatch, capsys):
    """`python -m attnres` (attnres/__main__.py) runs the entry point (attnres/_entry.py), in-process."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["attnres-run", "--help"])
    monkeypatch.delitem(sys.modules, "attnres.__main__", raising=False)
    try:
        runpy.run_module("attnres", run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # --help may end the process as argparse does
        assert stop.code in (0, None)
    out = capsys.readouterr().out
    assert "top-level keys (key=value):" in out and "residual" in out


# -- the real CLI ---------------------------------------------------------------------------
@pytest.mark.slow
def test_every_strategy_trains_through_the_cli(strategy_runs):
    """The real CLI trains each strategy to the end (the shared runs of tests/helpers.py)."""
    for residual in ("standard", "full", "block"):
        summary = metrics(strategy_runs[residual].dir)
        assert summary["status"] == "finished" and summary["steps"] == RUN_STEPS, (residual, summary)
        assert f"residual={residual}" in (strategy_runs[residual].dir / ".hydra/overrides.yaml").read_text()
        assert (strategy_runs[residual].dir / "checkpoints/last.ckpt").is_file()


@pytest.mark.slow
def test_fast_dev_run_through_cli(tmp_path):
    """debug=fast_dev_run, in the default output folder (named by the overrides). One strategy:
    the debug option sets trainer flags only, and every strategy's CLI run is the test above's."""
    result = run_cli(*TINY, "residual=block", "num_blocks=2", "debug=fast_dev_run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = next((tmp_path / "outputs").rglob("metrics.json"))
    assert "residual=block" in str(summary.parent)
    assert '"status": "finished"' in summary.read_text()


# -- bad input: one line, exit status 2, no traceback ----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["residual=blok"], ["unknown residual 'blok'", "did you mean block",  # every option, from conf/residual/
                             ", ".join(sorted(f.stem for f in (CONF / "residual").glob("*.yaml")))]),
        (["model=huge"], ["unknown model 'huge'", "gpt-small, paper-194m", "tiny"]),
        (["residual=block", "num_blocks=3"], ["num_blocks=3", "valid values: 1, 2, 4"]),
        (["data=text"], ["data.path is not set"]),
        (["data=text", "data.path=/no/such/corpus"], ["/no/such/corpus", "matches no file"]),
    ],
    ids=["unknown-residual", "unknown-model", "num-blocks", "no-data-path", "missing-data-path"],
)
def test_bad_input_one_line(tmp_path, args, expected):
    line = one_line_error(run_cli(*tiny(progress_bar=False, data=None), *args, cwd=tmp_path))
    for fragment in expected:
        assert fragment in line, line


@pytest.mark.slow
@pytest.mark.parametrize(("args", "expected"), _rows(THROUGH_CLI))
def test_mistake_through_cli(tmp_path, args, expected):
    args, read_only = _command(args, tmp_path)
    before = set(tmp_path.iterdir())
    line = one_line_error(run_cli(*args, cwd=tmp_path))
    for fragment in expected:
        assert fragment.replace("READ_ONLY", read_only) in line, line
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()
    assert set(tmp_path.iterdir()) == before, "the mistaken command wrote something"


@pytest.mark.slow
def test_full_error_keeps_the_trace(tmp_path):
    result = run_cli(*TINY_CHECKED, "overwrite=no", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr and "ConfigError" in result.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_refused_command_leaves_no_folder(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    result = run_cli(*tiny(), f"ckpt_path={garbage}", cwd=tmp_path)
    assert result.returncode == 2 and "corrupt" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))


# -- packaging ------------------------------------------------------------------------------
@pytest.mark.slow
def test_wheel_finds_configs_from_anywhere(tmp_path):
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("attnres-*.whl"))
    env_dir = tmp_path / "venv"
    # The dependencies come from the environment running the tests, which may itself be a venv:
    # `system_site_packages=True` would give the *base* interpreter's packages, so this venv gets
    # a .pth file listing this environment's site folders instead (after its own site-packages,
    # so the wheel installed there wins over the editable checkout).
    venv.create(env_dir, system_site_packages=False, with_pip=True)
    py = env_dir / "bin" / "python"
    site = next(env_dir.glob("lib/python*/site-packages"))
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site_module.getsitepackages()}
    (site / "zz_outer_env.pth").write_text("\n".join(sorted(outer)) + "\n")
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--ignore-installed", str(wheel)], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [str(env_dir / "bin" / "attnres-run"), "--cfg", "job", "residual=block", "num_blocks=8"],
        cwd=elsewhere, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "_target_: attnres.BlockAttentionResidual" in result.stdout and "num_blocks: 8" in result.stdout
    where = subprocess.run([str(py), "-c", "import attnres, sys; print(attnres.__file__)"], cwd=elsewhere,
                           capture_output=True, text=True)
    assert str(env_dir) in where.stdout, where.stdout  # the wheel, not the source checkout
    assert (site / "attnres" / "conf" / "config.yaml").is_file() and (site / "attnres" / "cli.py").is_file()
    assert (site / "attnres" / "ops" / "csrc" / "depth_attention_cpu.cpp").is_file()  # the CPU kernel builds from it
    assert not (site / "cli.py").exists() and not (site / "conf").exists(), "generic top-level names installed"
