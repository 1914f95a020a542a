"""The manual cannot drift from the code: every shell command shown in README.md and docs/*.md is
checked, and the README stays the short front door that links every page of docs/.

Which blocks are commands: fenced blocks tagged bash, sh, shell or console, and untagged fenced
blocks whose first line starts with a known command. In a `console` block the commands are the
lines after `$ `; the lines under one are what it prints, and when that is an `attnres-run: error:`
line, the command must fail with exactly that line. A trailing `\\` continues a command.

How each command is checked (nothing trains, nothing is installed, nothing is downloaded):

- `attnres-run ...` and `python -m attnres ...`: composed and checked in-process with
  `attnres.config.command.check_command_line(argv, conf/)`, which composes every job of the
  command with Hydra and checks its values, without running anything; a `_target_=` override
  must name an importable object. `--help` and `--hydra-help` run in a subprocess (exit 0).
- `python experiments/X.py ...` and the other installed commands (`attnres-prepare`, `attnres-export`,
  `attnres-summarize`, `attnres-plot`, `attnres-probe`: every `[project.scripts]` entry of
  pyproject.toml): run with `--help` (exit 0), and every `--option` the command uses must be one the
  help lists. An installed command runs through its pyproject.toml entry point (`module:function`),
  so the check holds before an editable checkout is reinstalled; tests/test_installed_commands.py
  runs them from a built wheel.
- `pip install ...`: the extras named exist in pyproject.toml, a pinned torch is the one CI
  installs and meets the project's requirement, a named package is a dependency of an extra.
- `python -m pytest ...`: the markers named are declared, `-n` has pytest-xdist in the `test`
  extra, the files named exist (the suite itself is not run here).
- `tensorboard ...`: the executable is installed (not started).
- `lint-imports`: run (it takes a fraction of a second).
- `experiments/slurm/cluster.sh SUB`: the script exists, is executable and knows SUB (no cluster
  is started).
- `experiments/gpu_check.sh ...`: the script is executable, every `--option` is one its `--help`
  lists, `--stages` names only the stages its usage line lists, and every `GPU_CHECK_*` variable
  set before it is one the script reads (nothing is run but `--help`).

Every command is checked from "the reader's folder", a temporary folder made once per module,
because the docs' paths are the reader's: `data/mycorpus` is a real token folder written by
attnres-prepare from a small generated corpus, any other `data.path=` that does not exist there
is made (a copy of that token folder for `data=tokens`, a small text file otherwise), any
`ckpt_path=` is made as an empty file (the check only asks for a file), and a python or YAML
block whose first line is a comment naming a file (`# my_residual.py`) is written there first,
so the docs' own example files are what the commands use. A command that names a GPU
(`trainer=gpu`, `trainer=fsdp`, ...) is checked as on a machine with one. Nothing is skipped: a
command no rule knows fails, and asks for a rule.

Python blocks that start with their imports are run (in this process, each in a namespace of its
own). Besides the commands: README.md has at most 250 lines, keeps the `ci:test-command` marker
with CI's test command after it, installs what CI installs and links every page of docs/ (and
only those); links resolve inside the repository; every file, folder and `attnres.*` name shown
in inline code exists; docs/layout.md's tree names every module of attnres/.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which hatchling (in the test extra) brings
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
README = REPO / "README.md"
DOC_FILES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 250
CI_TEST_COMMAND = "python -m pytest -n auto"

SHELL_TAGS = {"bash", "sh", "shell", "console"}
#: first words that make an untagged block a shell block, and that every command must start with
COMMANDS = {"attnres-run", "attnres-prepare", "attnres-export", "attnres-summarize", "attnres-plot", "attnres-probe",
            "attnres-tasks",
            "python", "pip", "tensorboard", "lint-imports", "experiments/slurm/cluster.sh", "experiments/gpu_check.sh",
            "cd", "git"}
#: commands shown but never executed here, and why
NOT_EXECUTED = {"cd": "changes the reader's folder", "git": "changes the checkout"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


# == reading the docs ==============================================================================
@dataclass
class Block:
    path: Path
    line: int  # of the first line inside the fence
    tag: str
    lines: list[str]


@dataclass
class Command:
    where: str  # README.md:12
    text: str
    output: list[str] = field(default_factory=list)  # what a console block shows under it


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def fenced_blocks(path: Path) -> list[Block]:
    blocks, open_fence, current = [], None, None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if open_fence is None:
            match = FENCE.match(stripped)
            if match:
                open_fence = match.group(1)
                current = Block(path, number + 1, match.group(2).lower(), [])
        elif stripped.startswith(open_fence) and stripped.strip(open_fence[0]) == "":
            blocks.append(current)
            open_fence = None
        else:
            current.lines.append(line)
    assert open_fence is None, f"{rel(path)}: a code fence is never closed"
    return blocks


def first_word(line: str) -> str:
    words = [w for w in line.strip().removeprefix("$ ").split() if not ENV_ASSIGNMENT.match(w)]
    return words[0] if words else ""


def is_shell(block: Block) -> bool:
    if block.tag in SHELL_TAGS:
        return True
    first = next((ln for ln in block.lines if ln.strip()), "")
    return block.tag == "" and first_word(first) in COMMANDS


def block_commands(block: Block) -> list[Command]:
    commands: list[Command] = []
    pending, start = "", 0
    for offset, raw in enumerate(block.lines):
        line = raw.rstrip()
        if block.tag == "console" and not pending:
            if not line.startswith("$ "):
                if line.strip() and commands:
                    commands[-1].output.append(line)
                continue
            line = line[2:]
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = block.line + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append(Command(f"{rel(block.path)}:{start}", pending + line))
        pending = ""
    assert not pending, f"{rel(block.path)}:{start}: a command ends with a line continuation"
    return commands


def all_commands() -> list[Command]:
    return [c for path in DOC_FILES for b in fenced_blocks(path) if is_shell(b) for c in block_commands(b)]


COMMANDS_SHOWN = all_commands()


# == the reader's folder ===========================================================================
FILE_COMMENT = re.compile(r"^#\s*([\w./-]+\.(?:py|ya?ml))\b")


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """The folder the docs' commands are checked from: a token folder, and the docs' example files."""
    from attnres.data.prepare import main as prepare

    folder = tmp_path_factory.mktemp("reader")
    corpus = folder / "corpus.txt"  # one file: its last 5% is the validation split
    words = "the quick brown fox jumps over a lazy dog def return import class while".split()
    corpus.write_text("\n".join(" ".join(words[(j + k) % len(words)] for k in range(10)) for j in range(600)) + "\n")
    prepare([str(corpus), str(folder / "data" / "mycorpus"), "--vocab-size", "300", "--workers", "1"])
    for path in DOC_FILES:
        for block in fenced_blocks(path):
            match = FILE_COMMENT.match(block.lines[0].strip()) if block.lines else None
            if match and block.tag in ("python", "py", "yaml", "yml"):
                target = folder / match.group(1)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text("\n".join(block.lines) + "\n")
    return folder


def provide_paths(argv: list[str], folder: Path) -> None:
    """The files a command reads, made in the reader's folder when the docs name paths of theirs."""
    values = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    for key in ("data.path", "ckpt_path", "data.tokenizer"):
        raw = values.get(key, "")
        quoted = len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\""
        value = raw[1:-1] if quoted else raw
        if not value or any(c in value for c in ("*?$" if quoted else "*?$,")) or value.startswith(("/", "~")):
            continue  # a glob, a sweep, an interpolation, or a path outside the reader's folder
        target = folder / value
        if target.exists():
            continue
        if key == "ckpt_path":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        elif key == "data.tokenizer":
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / "data" / "mycorpus" / "tokenizer.json", target)
        elif values.get("data") == "tokens":
            shutil.copytree(folder / "data" / "mycorpus", target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("def main():\n    return 0\n" * 50)


# == the rules =====================================================================================
def words_of(command: Command) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command.text, comments=True)
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


#: a command line's choices that need one of the heavy integrations (the `test-full` extra; `test` lacks them):
#: (pattern, module, extra). Without it, the command's check skips, naming the extra, as their own tests do.
HEAVY = [(r"logger=(mlflow|many)", "mlflow", "mlflow"), (r"logger=(wandb|many)", "wandb", "wandb"),
         (r"tune=optuna", "optuna", "tune"), (r"\+?eval\.tasks=\[.+\]", "lm_eval", "eval")]


def skip_without_heavy_extras(argv: list[str]) -> None:
    import importlib.util

    for pattern, module, extra in HEAVY:
        if any(re.fullmatch(pattern, a) for a in argv) and importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {extra} extra ({module}), in test-full: pip install -e '.[test-full]'")


def check_attnres_run(command: Command, argv: list[str], env: dict[str, str], folder: Path, monkeypatch,
                      capsys) -> None:
    if any(a in ("--help", "-h", "--hydra-help") for a in argv):
        result = subprocess.run(["attnres-run", *argv], capture_output=True, text=True, cwd=folder,
                                env={**os.environ, **env}, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return
    import attnres.config.rules as rules
    from attnres.config.command import check_command_line
    from attnres.config.errors import user_errors

    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))  # as attnres-run does: ./my_residual.py plugs in
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if any(re.search(r"gpu|cuda|fsdp", a) for a in argv):
        monkeypatch.setattr(rules, "_cuda_available", lambda: True)  # checked as on a machine with a GPU
    provide_paths(argv, folder)
    expected = [line for line in command.output if line.startswith("attnres-run: error:")]
    if not expected:
        skip_without_heavy_extras(argv)
    if expected:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
        with pytest.raises(SystemExit) as stop, user_errors():
            check_command_line(argv, CONF)
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip() == expected[0], "the docs show another error line"
        return
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # a failure of the checks themselves is raised too
    check_command_line(argv, CONF)
    check_sweep_start(argv, folder)
    from hydra._internal.utils import _locate

    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key.endswith("._target_"):
            _locate(value)  # raises when the docs name something that does not exist


def sweep_start_checks(argv: list[str], sweep_dir: Path) -> str:
    """What the sweeper of a `-m` command checks as it starts, without running a job: the tuned
    sweeper (`tune=lr`, `tune=optuna`) its settings, the arms, metric, baseline and centres
    (`TunedSweeper.check`, `start_state`); the plain one the jobs of its cross product (each
    composed as the launcher will). Returns which sweeper it was; raises what the sweeper would."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.utils import setup_globals
    from hydra.types import HydraContext, RunMode
    from omegaconf import OmegaConf

    import attnres.config.naming  # noqa: F401  (the run folder names' resolver)
    from attnres.config.command import parse_arguments
    from attnres.sweep import plan
    from attnres.sweep.tuned import TunedSweeper

    args = parse_arguments(argv)
    setup_globals()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    config = loader.load_configuration(args.config_name or "config", overrides=[*args.overrides,
                                       f"hydra.sweep.dir={sweep_dir}"], run_mode=RunMode.MULTIRUN)
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    target = str(config.hydra.sweeper.get("_target_", ""))
    if target.endswith("TunedSweeper"):
        settings = OmegaConf.to_container(config.hydra.sweeper, resolve=False)
        settings.pop("_target_")
        sweeper = TunedSweeper(**settings)
        sweeper.config, sweeper.hydra_context = config, HydraContext(config_loader=loader, callbacks=None)
        jobs = sweeper.jobs_of(task)
        if not jobs:
            raise plan.no_jobs_error(config)
        sweeper.check(jobs)
        sweeper.start_state(sweep_dir, jobs, announce=False)  # the start line's GPU-hours price is no check
        return "tuned"
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=loader)
    jobs = BasicSweeper.split_arguments(parser.parse_overrides([*params, *task]), None)[0]
    if not jobs:
        raise plan.no_jobs_error(config)
    for job in jobs:
        loader.load_sweep_config(config, list(job))
    return "plain"


SWEEPS_CHECKED: dict[str, list[str]] = {"tuned": [], "plain": []}


def check_sweep_start(argv: list[str], folder: Path) -> None:
    if not any(a in ("-m", "--multirun") for a in argv) or any(a.startswith(("--cfg", "--info", "-c")) for a in argv):
        return
    from attnres.sweep import slots

    sweep_dir = folder / "docs-sweep"
    kind = sweep_start_checks(argv, sweep_dir)
    assert not sweep_dir.exists(), "the sweeper's start checks wrote into the sweep folder"
    assert str(sweep_dir.resolve()) not in slots._sweep_locks
    SWEEPS_CHECKED[kind].append(" ".join(argv))


@functools.cache
def help_text(*program: str) -> str:
    result = subprocess.run([*program, "--help"], capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{' '.join(program)} --help failed: {result.stderr[-2000:]}"
    return result.stdout


def check_options(program: tuple[str, ...], args: list[str]) -> None:
    text = help_text(*program)
    for arg in args:
        if arg.startswith("--"):
            option = arg.split("=", 1)[0]
            assert re.search(rf"(^|[\s\[,]){re.escape(option)}\b", text), f"{' '.join(program)} has no {option}"


@functools.lru_cache(maxsize=1)
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def entry_point(name: str) -> tuple[str, ...]:
    """The program that runs the installed command `name` as pyproject.toml declares it (module:function)."""
    scripts = pyproject()["project"]["scripts"]
    assert name in scripts, f"{name} is no [project.scripts] entry of pyproject.toml"
    module, _, function = scripts[name].partition(":")
    code = (f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; "
            f"sys.exit({function}())")
    return sys.executable, "-c", code


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def check_pip(args: list[str]) -> None:
    assert args[:1] == ["install"], f"pip {' '.join(args)}: only `pip install` is described"
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    for arg in args[1:]:
        if arg.startswith("-"):
            assert arg in ("-e", "--editable"), f"pip install {arg}: an option the docs do not explain"
            continue
        match = re.fullmatch(r"(\.|attnres)(?:\[([\w,-]+)\])?", arg)
        if match:
            for extra in filter(None, (match.group(2) or "").split(",")):
                assert extra in extras, f"pip install {arg}: pyproject.toml has no extra {extra!r}"
            continue
        name, _, version = arg.partition("==")
        if name == "torch":
            from packaging.specifiers import SpecifierSet

            assert version, "pin torch as CI does"
            ci = (REPO / ".ci" / "run").read_text()
            assert f"pip install --quiet torch=={version}" in ci, f"CI installs another torch than {version}"
            spec = next(r for r in project["dependencies"] if r.startswith("torch"))
            assert version in SpecifierSet(spec.removeprefix("torch")), f"torch=={version} does not meet {spec}"
            continue
        in_extras = set().union(*(requirement_names(r) for r in extras.values()))
        assert name.lower() in in_extras, f"pip install {arg}: not a dependency of any extra of attnres"


def check_pytest(args: list[str]) -> None:
    config = pyproject()["tool"]["pytest"]["ini_options"]
    markers = {m.split(":", 1)[0].strip() for m in config["markers"]}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            names = set(re.findall(r"[A-Za-z_]\w*", args[i + 1])) - {"and", "or", "not"}
            assert names <= markers, f"pytest -m {args[i + 1]}: undeclared markers {names - markers}"
            i += 2
            continue
        if arg == "-n":
            test_extra = requirement_names(pyproject()["project"]["optional-dependencies"]["test"])
            assert "pytest-xdist" in test_extra, "pytest -n needs pytest-xdist in the test extra"
            i += 2
            continue
        if arg in ("-q", "-x", "-v", "-ra"):
            i += 1
            continue
        assert not arg.startswith("-"), f"pytest {arg}: an option this test does not know; add a rule"
        assert (REPO / arg.split("::", 1)[0]).exists(), f"pytest {arg}: no such file"
        i += 1


def check_cluster(args: list[str]) -> None:
    script = REPO / "experiments" / "slurm" / "cluster.sh"
    assert script.is_file() and os.access(script, os.X_OK), f"{rel(script)} is missing or not executable"
    usage = re.search(r"usage: \S+ ([\w|]+)", script.read_text())
    assert usage and args[:1] and args[0] in usage.group(1).split("|"), f"cluster.sh has no subcommand {args[:1]}"


def check_gpu_check(args: list[str], env: dict[str, str]) -> None:
    script = REPO / "experiments" / "gpu_check.sh"
    assert script.is_file() and os.access(script, os.X_OK), f"{rel(script)} is missing or not executable"
    check_options((str(script),), args)
    usage = re.search(r"--stages ([a-z,]+)\]", help_text(str(script)))
    assert usage, "gpu_check.sh --help has no usage line naming its stages"
    for i, arg in enumerate(args):
        if arg == "--stages":
            assert i + 1 < len(args), "gpu_check.sh --stages needs a list of stages"
        stages = arg.partition("=")[2] if arg.startswith("--stages=") else args[i + 1] if arg == "--stages" else ""
        unknown = set(filter(None, stages.split(","))) - set(usage.group(1).split(","))
        assert not unknown, f"gpu_check.sh --stages {stages}: no stage {', '.join(sorted(unknown))}"
    text = script.read_text()
    for key in env:
        assert re.search(rf"\${{?{key}\b", text), f"gpu_check.sh does not read {key}"


def check(command: Command, folder: Path, monkeypatch, capsys) -> None:
    env, words = words_of(command)
    assert words, f"{command.where}: an empty command"
    program, args = words[0], words[1:]
    if program == "python" and args[:2] == ["-m", "attnres"]:
        program, args = "attnres-run", args[2:]
    if program == "attnres-run":
        check_attnres_run(command, args, env, folder, monkeypatch, capsys)
    elif program == "python" and args[:2] == ["-m", "pytest"]:
        check_pytest(args[2:])
    elif program == "python" and args and args[0].endswith(".py"):
        script = REPO / args[0]
        assert script.is_file(), f"no script {args[0]}"
        check_options((sys.executable, str(script)), args[1:])
    elif program in pyproject()["project"]["scripts"]:  # attnres-prepare, attnres-export, attnres-plot, ...
        check_options(entry_point(program), args)
    elif program == "pip":
        check_pip(args)
    elif program == "tensorboard":
        assert shutil.which("tensorboard"), "tensorboard is not installed"
        assert args[:1] == ["--logdir"], "tensorboard is shown with --logdir"
    elif program == "lint-imports":
        result = subprocess.run(["lint-imports", "--no-cache", *args], capture_output=True, text=True, cwd=REPO,
                                timeout=300)
        assert result.returncode == 0, result.stdout[-3000:]
    elif program == "experiments/slurm/cluster.sh":
        check_cluster(args)
    elif program == "experiments/gpu_check.sh":
        check_gpu_check(args, env)
    elif program in NOT_EXECUTED:
        pass  # shown for the reader, never run here (NOT_EXECUTED says why)
    else:
        pytest.fail(f"{command.where}: no rule for `{program}`; add one to tests/test_docs.py")


#: a shown sweep of this many jobs or more is checked in the slow tier: its check composes every job twice
#: (check_command_line, then the sweeper's start checks), 1.3 to 12 s for each such sweep on a 2-core
#: machine; the smaller sweeps shown (up to 6 jobs), plain and tuned, keep the check in the quick tier
SLOW_SWEEP_JOBS = 9


def top_level_values(value: str) -> int:
    """How many values a sweep override lists: one more than its commas outside brackets and parentheses
    (`seed=0,1,2` lists 3, `eval.tasks=[a,b]` one)."""
    depth, count = 0, 1
    for char in value:
        if char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            count += 1
    return count


def sweep_jobs(command: Command) -> int:
    """The jobs an `attnres-run -m` command shown sweeps over, counted from its comma lists and its
    experiment's own sweep (conf/experiment/NAME.yaml's hydra.sweeper.params), without composing; 1
    for a command that is no sweep."""
    import yaml

    words = words_of(command)[1]
    args = words[3:] if words[:3] == ["python", "-m", "attnres"] else words[1:] if words[:1] == ["attnres-run"] else []
    if "-m" not in args and "--multirun" not in args:
        return 1
    swept: dict[str, int] = {}
    for word in args:
        key, _, value = word.lstrip("+").partition("=")
        preset = CONF / "experiment" / f"{value}.yaml"
        if key == "experiment" and preset.is_file():
            params = ((yaml.safe_load(preset.read_text()) or {}).get("hydra") or {}).get("sweeper", {}).get("params")
            swept.update({k: top_level_values(str(v)) for k, v in (params or {}).items()})
    for word in args:
        key, equals, value = word.lstrip("+").partition("=")
        if equals and not key.startswith("hydra."):
            swept[key] = top_level_values(value)
    jobs = 1
    for count in swept.values():
        jobs *= count
    return jobs


SHOWN = [pytest.param(c, id=c.where, marks=[pytest.mark.slow] if sweep_jobs(c) >= SLOW_SWEEP_JOBS else [])
         for c in COMMANDS_SHOWN]


@pytest.mark.parametrize("command", SHOWN)
def test_command_shown_in_the_docs_works(command, reader, monkeypatch, capsys):
    check(command, reader, monkeypatch, capsys)


# == python examples ===============================================================================
PY_BLOCKS = [b for path in DOC_FILES for b in fenced_blocks(path)
             if b.tag in ("python", "py") and b.lines and b.lines[0].startswith(("import ", "from "))]


@pytest.mark.parametrize("block", PY_BLOCKS, ids=[f"{rel(b.path)}:{b.line}" for b in PY_BLOCKS])
def test_python_example_runs(block, reader, monkeypatch):
    """Run in this process (torch is loaded already), in a namespace of its own, from the reader's folder."""
    monkeypatch.chdir(reader)
    code = compile("\n".join(block.lines), f"{rel(block.path)}:{block.line}", "exec")
    exec(code, {"__name__": "__docs_example__"})


# == the README and the pages ======================================================================
def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # not inside code blocks
    return re.findall(r"\]\(([^)\s]+)\)", text)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_readme_is_the_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    marker = [i for i, line in enumerate(lines) if "ci:test-command" in line]
    assert len(marker) == 1, "README.md must keep exactly one <!-- ci:test-command --> marker"
    following = [line for line in lines[marker[0] + 1:marker[0] + 5] if not line.startswith("```")]
    assert lines[marker[0] + 1].strip() == "```bash" and following[0] == CI_TEST_COMMAND, \
        "the line CI runs (.ci/run reads the line after the marker) must be " + CI_TEST_COMMAND
    linked = {link.split("#")[0] for link in links(README) if link.startswith("docs/")}
    pages = {rel(p) for p in DOC_FILES[1:]}
    assert linked <= pages, f"README.md links pages that do not exist: {sorted(linked - pages)}"
    assert pages <= linked, f"README.md's index does not link {sorted(pages - linked)}"


def test_readme_installs_what_ci_installs():
    """.ci/run installs exactly what README.md's "Set up" says, in that order."""
    ci = [re.sub(r"python -m pip install --quiet ", "pip install ", line.strip())
          for line in (REPO / ".ci" / "run").read_text().splitlines() if "pip install" in line
          and not line.lstrip().startswith("#")]
    shown = [c.text.split("#")[0].strip() for c in COMMANDS_SHOWN if c.where.startswith("README.md:")
             and c.text.startswith("pip install")]
    assert shown[:len(ci)] == ci, f"README.md shows {shown}, CI runs {ci}"


@pytest.mark.parametrize("path", DOC_FILES, ids=[rel(p) for p in DOC_FILES])
def test_links_resolve_inside_the_repository(path):
    for link in links(path):
        assert not re.match(r"^[a-z]+:", link), f"{rel(path)} links {link}, outside the repository"
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists() and REPO in file.parents, f"{rel(path)} links {link}, which does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{rel(path)} links {link}: no such heading in {file.name}"


@pytest.mark.parametrize("path", DOC_FILES, ids=[rel(p) for p in DOC_FILES])
def test_every_command_is_in_a_checked_block(path):
    """A command in an indented block, or in a block tagged otherwise, would escape the checks."""
    text = path.read_text().splitlines()
    inside = set()
    for block in fenced_blocks(path):
        inside.update(range(block.line, block.line + len(block.lines)))
        if not is_shell(block) and block.tag not in ("text", "python", "py", "yaml", "yml", "toml", "csv"):
            pytest.fail(f"{rel(path)}:{block.line}: tag the block (bash for commands, text for output)")
        if block.tag in ("python", "py") and not (block.lines and (block.lines[0].startswith(("import ", "from "))
                                                                 or FILE_COMMENT.match(block.lines[0]))):
            pytest.fail(f"{rel(path)}:{block.line}: a python example starts with its imports (it is run) "
                        "or with a comment naming its file (it is written for the commands)")
    for number, line in enumerate(text, 1):
        if number not in inside and line.startswith("    ") and first_word(line) in COMMANDS:
            pytest.fail(f"{rel(path)}:{number}: an indented command; put it in a ```bash block")


#: where the docs name what no longer exists on purpose (the table of old names and their new homes)
HISTORY = ("## Names that moved",)
REPO_PATH = re.compile(r"^(?:attnres|tests|experiments|conf|docs|\.ci)/[\w./-]*$")
DOTTED = re.compile(r"^attnres(?:\.[A-Za-z_]\w*)+$")


def named_in_text(path: Path) -> list[tuple[int, str]]:
    """The inline-code spans of a page (outside code blocks and the history sections), with lines."""
    out, in_block, in_history = [], False, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            in_block = not in_block
            continue
        if line.startswith("#") and not in_block:
            in_history = line.startswith(HISTORY)
        if not in_block and not in_history:
            out += [(number, span) for span in re.findall(r"`([^`\s]+)`", line)]
    return out


def resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", DOC_FILES, ids=[rel(p) for p in DOC_FILES])
def test_paths_and_modules_named_exist(path):
    """`attnres/sweep/slots.py`, `tests/sweep/test_slurm.py`, `attnres.results.figures`: every file,
    folder and module the page names in inline code exists (so a move cannot leave the manual behind)."""
    missing = []
    for number, span in named_in_text(path):
        if REPO_PATH.match(span) and not (REPO / span.rstrip("/")).exists():
            missing.append(f"{rel(path)}:{number}: {span}")
        elif DOTTED.match(span) and span != "attnres.log" and not resolves(span):
            missing.append(f"{rel(path)}:{number}: {span}")
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def test_the_layout_names_every_module():
    """docs/layout.md's tree names every module of attnres/, and no module that is gone."""
    page = (REPO / "docs" / "layout.md").read_text()
    tree = fenced_blocks(REPO / "docs" / "layout.md")[0]
    modules = {p.stem for p in (REPO / "attnres").rglob("*.py") if not p.name.startswith("__")}
    unnamed = sorted(m for m in modules if not re.search(rf"\b{re.escape(m)}\b", page))
    assert not unnamed, f"docs/layout.md does not say where these modules are or what they do: {unnamed}"
    shown = set(re.findall(r"\b(\w+)\.py\b", "\n".join(tree.lines)))
    others = [*REPO.glob("*.py"), *REPO.glob("experiments/**/*.py"), *REPO.glob("tests/**/*.py")]
    present = modules | {p.stem for p in others}
    assert shown <= present, f"docs/layout.md's tree names files that do not exist: {sorted(shown - present)}"


def test_the_docs_show_commands():
    assert len(COMMANDS_SHOWN) > 20 and all(c.text for c in COMMANDS_SHOWN)


def test_every_installed_command_is_a_known_first_word():
    """A block of `attnres-<new command>` lines is a command block, checked like the others."""
    scripts = set(pyproject()["project"]["scripts"])
    assert scripts <= COMMANDS, f"add {sorted(scripts - COMMANDS)} to COMMANDS"


def test_the_sweep_start_checks_refuse_what_the_sweeper_refuses(tmp_path):
    from attnres.config.errors import ConfigError

    with pytest.raises(ConfigError, match="hydra.sweeper.metric=val/los"):
        sweep_start_checks(["-m", "tune=lr", "residual=standard,block", "seed=0", "hydra.sweeper.metric=val/los"],
                           tmp_path / "sweep")
    assert sweep_start_checks(["-m", "residual=standard,block", "seed=0,1"], tmp_path / "sweep") == "plain"
