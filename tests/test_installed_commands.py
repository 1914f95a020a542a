"""The commands a user types outside the clone work from any folder with the package installed
from a wheel (not only from an editable checkout): every `[project.scripts]` command the docs
show (`attnres-summarize`, `attnres-plot`, `attnres-probe`, ...), each one's `python -m` module,
and the `figures` command a run prints at its end (README.md's end block and
`attnres.training.report.end_block`). The wheel is built once for the module and installed into
a fresh virtual environment; every command runs from an empty folder."""

from __future__ import annotations

import json
import shlex
import site as site_module
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import numpy as np
import pytest

from tests import test_docs
from tests.helpers import REPO, cli_env

pytestmark = pytest.mark.slow
SCRIPTS = test_docs.pyproject()["project"]["scripts"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment holding the built wheel (its dependencies are this environment's)."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp / "dist"), str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("attnres-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, system_site_packages=False, with_pip=True)
    site = next(env_dir.glob("lib/python*/site-packages"))
    # this environment's site folders after the venv's own (see tests/test_cli.py): the dependencies,
    # and not the editable checkout (a .pth line is a folder added as it is, its own .pth files unread)
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site_module.getsitepackages()}
    (site / "zz_outer_env.pth").write_text("\n".join(sorted(outer)) + "\n")
    install = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--no-deps",
                              "--ignore-installed", str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    return env_dir


@pytest.fixture
def empty(tmp_path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def run_here(env_dir: Path, words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`words` as a user types them with the environment's bin/ first on PATH, from `cwd`."""
    env = cli_env({"PATH": f"{env_dir / 'bin'}:{cli_env()['PATH']}"})
    env.pop("PYTHONPATH", None)
    if words[0] == "python":
        words = [str(env_dir / "bin" / "python"), *words[1:]]
    return subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_is_what_runs(installed, empty):
    where = run_here(installed, ["python", "-c", "import attnres; print(attnres.__file__)"], empty)
    assert str(installed) in where.stdout and str(REPO) not in where.stdout, where.stdout + where.stderr


def test_every_installed_command_answers_help_from_anywhere(installed, empty):
    """Each `[project.scripts]` command and the `python -m` of its module."""
    for name, target in SCRIPTS.items():
        module = target.partition(":")[0]
        for words in ([name, "--help"], ["python", "-m", module, "--help"]):
            if name == "attnres-run" and words[0] == "python":
                words = ["python", "-m", "attnres", "--help"]
            done = run_here(installed, words, empty)
            assert done.returncode == 0, f"{' '.join(words)}: {done.stderr[-2000:]}"
            assert "usage" in done.stdout.lower() or name == "attnres-run", done.stdout[:500]


DOCS_INSTALLED = [c for c in test_docs.COMMANDS_SHOWN if test_docs.words_of(c)[1][:1] != ["attnres-run"]
                  and test_docs.words_of(c)[1][:1][0] in SCRIPTS]


@pytest.mark.parametrize("command", DOCS_INSTALLED, ids=[c.where for c in DOCS_INSTALLED])
def test_the_commands_the_docs_show_run_from_anywhere(installed, empty, command):
    """The program each docs command names is installed by the wheel and knows every option used."""
    _, words = test_docs.words_of(command)
    done = run_here(installed, [words[0], "--help"], empty)
    assert done.returncode == 0, f"{command.where}: {words[0]} --help: {done.stderr[-2000:]}"
    for option in (w.split("=", 1)[0] for w in words[1:] if w.startswith("--")):
        assert option in done.stdout, f"{command.where}: {words[0]} has no {option}"


def _run_with_figures(folder: Path) -> Path:
    """A run folder holding the raw array of one dashboard figure (magnitude/plot), as a run logs it."""
    from torch.utils.tensorboard import SummaryWriter

    from attnres.results import figures
    from attnres.training.tensorboard import log_array

    run = folder / "outputs" / "default" / "model.n_layer=2,residual=block"
    writer = SummaryWriter(str(run))
    labels = ["L0 attn", "L0 mlp", "L1 attn", "L1 mlp"]
    log_array(writer, figures.FIGURE_TAGS["magnitude/plot"], np.linspace(0.5, 2.0, 8).reshape(2, 4),
              {"strategy": "Block AttnRes (N=2)", "labels": labels}, 20)
    writer.close()
    return run


def _figures_command(line: str, run: Path) -> list[str]:
    """The command of an end block's `figures` line, its run folder made `run`."""
    words = shlex.split(line.split("figures", 1)[1])
    return [*words[:-1], str(run)]


def test_the_figures_line_of_the_readme_works_from_anywhere(installed, empty):
    run = _run_with_figures(empty)
    lines = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.strip().startswith("figures ")]
    assert lines, "README.md's end block shows no figures line"
    for line in lines:
        done = run_here(installed, _figures_command(line, run), empty)
        assert done.returncode == 0, f"{line.strip()}: {done.stderr[-2000:]}"
        assert (run / "plots" / "magnitude.png").is_file(), done.stdout


def test_the_figures_line_a_run_prints_works_from_anywhere(installed, empty):
    from attnres.training.report import end_block

    run = _run_with_figures(empty)
    summary = {"status": "finished", "wall_time_s": 2.0, "steps": 20, "tokens_seen": 40960,
               "metrics": {"val/loss": 4.2}}
    line = next(ln for ln in end_block(summary, run, run).splitlines() if ln.strip().startswith("figures "))
    done = run_here(installed, _figures_command(line, run), empty)
    assert done.returncode == 0, f"{line.strip()}: {done.stderr[-2000:]}"
    assert (run / "plots" / "magnitude.png").is_file(), done.stdout


def test_summarize_rebuilds_a_sweep_from_anywhere(installed, empty):
    sweep = empty / "multirun" / "quick"
    for seed in (0, 1):
        job = sweep / f"seed={seed}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n")
        (job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\nresidual: {{}}\n")
        (job / "metrics.json").write_text(json.dumps({"status": "finished", "metrics": {"val/loss": 1.0 + seed}}))
    done = run_here(installed, ["attnres-summarize", "multirun/quick"], empty)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 jobs, 2 finished" in done.stdout and (sweep / "summary.md").is_file()
    missing = run_here(installed, ["attnres-probe", "nowhere"], empty)
    assert missing.returncode == 2 and "nowhere is not a folder" in missing.stderr, missing.stderr
