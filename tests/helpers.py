"""What the tests share: the tiny-run overrides (one definition, with variants), the one
command-line runner (`attnres-run` in a subprocess), the sublayers that remember what they read
and wrote, and the runs and the sweep trained once per test session (`shared_once`), which the
fixtures of tests/conftest.py hand to every test that only reads their outputs.

Import it as `from tests import helpers` (tests/ is a package; `python -m pytest` from the
repository root, as CI runs it, puts the root on sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONF = REPO / "conf"

# ------------------------------------------------------------------------------------------------
# the tiny run: a model and data small enough that a CLI run costs seconds on 2 cores
# ------------------------------------------------------------------------------------------------

TINY_MODEL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2"]


def tiny(*extra: str, data: str | None = "synthetic", batch_size: int = 8, val_batches: int = 1,
         steps: int | None = None, val_every: int | None = None, logger: bool = False,
         progress_bar: bool = True, width: bool = True) -> list[str]:
    """The tiny run's overrides, then `extra`: synthetic data (`data=None` leaves the data group
    to the caller, who names it in `extra`), a 2 x 32 model (`width=False` leaves model.n_embd to
    the caller, e.g. to sweep it), CPU, no logger unless `logger`, and the step count, validation
    interval and progress bar when given."""
    args = [f"data={data}"] if data else []
    model = TINY_MODEL if width else [m for m in TINY_MODEL if not m.startswith("model.n_embd=")]
    args += [f"data.batch_size={batch_size}", f"data.val_batches={val_batches}", *model, "trainer.accelerator=cpu"]
    if steps is not None:
        args.append(f"trainer.max_steps={steps}")
    if val_every is not None:
        args.append(f"trainer.val_check_interval={val_every}")
    if not progress_bar:
        args.append("trainer.enable_progress_bar=false")
    if not logger:
        args.append("logger=none")
    return [*args, *extra]


#: the CLI tests' tiny run (quiet: no progress bar, no logger)
TINY = tiny(progress_bar=False)

# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------

#: `attnres-run` (the same entry point as `python -m attnres`)
CLI = [sys.executable, "-m", "attnres"]
#: variables of the test process that a run must not inherit unless a test sets them: full Hydra
#: errors (the tests read the one-line ones), the Triton interpreter (tests/conftest.py sets it for
#: the kernel tests, a user's run has it not), a test strategy's hold file
NOT_INHERITED = ("HYDRA_FULL_ERROR", "TRITON_INTERPRET", "SLEEPER_HOLD")


def load_experiment(name: str):
    """experiments/<name>.py as a module (the folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run: this one's (the slot folder and data cache tests/conftest.py set
    included), one thread (2 shared cores), and `env` on top."""
    full = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    full["OMP_NUM_THREADS"] = "1"
    full.update(env or {})
    return full


def faultinject_env() -> dict[str, str]:
    """For `cli_env`: tests/ on PYTHONPATH, so that a run can name the callbacks of
    tests/faultinject.py on its command line (`+callbacks.fault._target_=faultinject.KillAt`)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """`attnres-run ARGS` in a subprocess with a clean environment (`cli_env`), its output captured."""
    return subprocess.run([*CLI, *args], cwd=cwd, env=cli_env(env), capture_output=True, text=True, timeout=timeout)


def run_script(script: str | Path, *args: str, cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """A script of experiments/ (or any file) under this interpreter, in the same environment."""
    path = Path(script) if Path(script).is_absolute() else REPO / script
    return subprocess.run([sys.executable, str(path), *args], cwd=cwd, env=cli_env(env), capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one `attnres-run: error:` line of a refused command (exit status `code`, no traceback)."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@contextlib.contextmanager
def small_disk(where: Path, size: str, required: bool = True) -> Iterator[bool]:
    """A tmpfs of `size` (mount's words: "256k", "20m") mounted at `where` (created) for the block,
    unmounted after: a disk that fills. Yields whether it is mounted; without root, or where mount
    fails, skips the test when `required`, else yields False (the caller simulates the full disk)."""
    where.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                    str(where)], capture_output=True).returncode == 0
    if not mounted and required:
        import pytest

        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=False)


def check_exact_resume(cwd: Path, common: list[str], steps: int = 8, stop: int = 3
                       ) -> subprocess.CompletedProcess:
    """Train `steps` steps in one go (`whole/`), and `stop` steps then `resume=true` to `steps`
    (`split/`): the resumed run trained on, and ends with the uninterrupted run's weights bit for bit.
    Returns the uninterrupted run's result."""
    whole = run_cli(*common, f"trainer.max_steps={steps}", "hydra.run.dir=whole", cwd=cwd)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli(*common, f"trainer.max_steps={stop}", "hydra.run.dir=split", cwd=cwd)
    assert first.returncode == 0, first.stderr[-3000:]
    halfway = weights(cwd / "split/checkpoints/last.ckpt")
    second = run_cli(*common, f"trainer.max_steps={steps}", "hydra.run.dir=split", "resume=true", cwd=cwd)
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = weights(cwd / "whole/checkpoints/last.ckpt"), weights(cwd / "split/checkpoints/last.ckpt")
    assert a.keys() == b.keys()
    assert not all(torch.equal(halfway[k], b[k]) for k in b), "the resumed run did not train"
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between resumed and uninterrupted runs"
    assert f'"steps": {steps}' in (cwd / "split/metrics.json").read_text()
    return whole


def metrics(run_dir: Path) -> dict:
    """A run's metrics.json, strictly (NaN or Infinity in it raise: they are not JSON)."""
    def refuse(constant: str):
        raise ValueError(f"metrics.json holds {constant}, which is not JSON")
    return json.loads((run_dir / "metrics.json").read_text(), parse_constant=refuse)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


# ------------------------------------------------------------------------------------------------
# sublayers that remember what they read and wrote
# ------------------------------------------------------------------------------------------------


class Capture(nn.Module):
    """A sublayer that remembers what it read and wrote."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.inputs, self.outputs = inner, [], []

    def forward(self, x):
        out = self.inner(x)
        self.inputs.append(x.detach().clone())
        self.outputs.append(out.detach().clone())
        return out


def mixed_sublayers(L: int, d: int, seed: int = 0) -> nn.ModuleList:  # noqa: N803
    """Float64 capturing sublayers; every other one is not scale-invariant (LayerNorm first, then
    Linear-Tanh-Linear), so a wrongly scaled input shows."""
    torch.manual_seed(seed)
    layers = []
    for index in range(L):
        if index % 2 == 0:
            inner = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.Tanh())
        else:
            inner = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        layers.append(Capture(inner))
    return nn.ModuleList(layers).double()


def mlp_sublayers(L: int, d: int, seed: int = 0) -> nn.ModuleList:  # noqa: N803
    """Float64 capturing sublayers, none scale-invariant (Linear-Tanh-Linear each)."""
    torch.manual_seed(seed)
    return nn.ModuleList(Capture(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))) for _ in range(L)).double()


# ------------------------------------------------------------------------------------------------
# work done once per test session, shared by the xdist workers
# ------------------------------------------------------------------------------------------------


def session_root(tmp_path_factory) -> Path:
    """A folder the whole test session shares: under pytest-xdist, the workers' common parent of
    their own temporary folders; without it, the session's temporary folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def shared_once(tmp_path_factory, name: str, produce: Callable[[Path], Any]) -> tuple[Path, Any]:
    """`produce(folder)` once per test session, whichever worker asks first (the others wait for
    it and read what it left): returns the folder and what `produce` returned (JSON)."""
    root = session_root(tmp_path_factory)
    folder, done = root / name, root / f"{name}.json"
    with _exclusive(root / f"{name}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed half way
            folder.mkdir(parents=True)
            done.write_text(json.dumps(produce(folder)))
    return folder, json.loads(done.read_text())


@dataclass
class Ran:
    """A finished CLI run: its folder, exit status and output."""

    dir: Path
    returncode: int
    stdout: str
    stderr: str


def run_concurrently(root: Path, commands: dict[str, list[str]], env: dict[str, str] | None = None,
                     timeout: float = 400) -> dict[str, dict]:
    """`attnres-run` once per command, all at once (one thread each), each in `root/<name>`."""
    procs = {}
    for name, args in commands.items():
        log = open(root / f"{name}.out", "w+")  # noqa: SIM115  (closed below)
        err = open(root / f"{name}.err", "w+")  # noqa: SIM115
        procs[name] = (subprocess.Popen([*CLI, *args, f"hydra.run.dir={name}"], cwd=root, env=cli_env(env),
                                        stdout=log, stderr=err, text=True), log, err)
    done = {}
    for name, (proc, log, err) in procs.items():
        proc.wait(timeout=timeout)
        log.seek(0)
        err.seek(0)
        done[name] = {"returncode": proc.returncode, "stdout": log.read(), "stderr": err.read()}
        log.close()
        err.close()
    return done


def copy_run(run: Path, to: Path) -> Path:
    """A copy of a shared run folder for a test that writes into it."""
    shutil.copytree(run, to, symlinks=True)
    return to


# ------------------------------------------------------------------------------------------------
# the runs the tests share (trained once per session: tests/conftest.py's fixtures)
# ------------------------------------------------------------------------------------------------

#: the shared strategy runs: 6 steps of the tiny model on synthetic data, the TensorBoard logger on,
#: the depth dashboard every 2 steps, the progress bar on (as a user's terminal has it), and the
#: default validation interval (250): a run shorter than it validates once, at its end
RUN_STEPS, RUN_N_LAYER, RUN_NUM_BLOCKS, RUN_EVERY = 6, 2, 2, 2
_RUN = tiny("data.block_size=64",  # room for any of the task's default sizes
            val_batches=2, steps=RUN_STEPS, logger=True)
_EVERY = f"callbacks.depth_dashboard.every_n_steps={RUN_EVERY}"
STRATEGY_RUNS = {
    "standard": [*_RUN, "residual=standard", _EVERY],
    "full": [*_RUN, "residual=full", _EVERY],
    "block": [*_RUN, "residual=block", f"num_blocks={RUN_NUM_BLOCKS}", _EVERY],
    "no_callbacks": [*_RUN, "residual=block", f"num_blocks={RUN_NUM_BLOCKS}", "callbacks=none"],
}


def train_strategy_runs(root: Path) -> dict[str, dict]:
    return run_concurrently(root, STRATEGY_RUNS, env={"HYDRA_FULL_ERROR": "1"})


def sweep_command(root: Path) -> list[str]:
    """The shared sweep: standard and Block N=2, seeds 0 and 1, on a few stdlib files (bits per
    byte), 6 steps validated every 3, on two simulated GPUs (ATTNRES_FAKE_GPUS=2: two slots, the
    jobs still on the CPU)."""
    return ["-m", *tiny("data.max_files=40", "data.block_size=32", f"data.cache_dir={root / 'cache'}", "callbacks=none",
                        data="stdlib", val_batches=2, steps=6, val_every=3, logger=True),
            "residual=standard,block", "num_blocks=2", "seed=0,1", "hydra.sweep.dir=sweep",
            f"hydra.launcher.lock_dir={root / 'locks'}"]


SWEEP_ENV = {"ATTNRES_FAKE_GPUS": "2"}


def run_shared_sweep(root: Path) -> dict:
    result = run_cli(*sweep_command(root), cwd=root, env=SWEEP_ENV, timeout=600)
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}


#: the tiny run the command-line checks compose (tests/config/): quiet, 2 steps
TINY_CHECKED = tiny(progress_bar=False, steps=2)


def event_accumulator(run: Path):
    """TensorBoard's own reader of a run folder's events, everything kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    where = run if any(run.glob("events.out.tfevents.*")) else run / "tb"  # tb/: the layout before the issue 11 one
    acc = EventAccumulator(str(where), size_guidance={"images": 0, "tensors": 0, "scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def tensor_array(event) -> Any:
    """The numpy array a tensor event holds."""
    import numpy as np

    proto = event.tensor_proto
    return np.asarray(proto.float_val, dtype=np.float32).reshape([d.size for d in proto.tensor_shape.dim])


def job_dirs(sweep: Path) -> dict[str, Path]:
    """A sweep's run folders by the overrides that differ between them (as the summary labels them)."""
    from attnres.results.summary import find_job_dirs, job_labels, job_overrides

    dirs = find_job_dirs(sweep)
    labels = job_labels({d.name: job_overrides(d) or {} for d in dirs})
    return {labels[d.name]: d for d in dirs}


#: the sweep tests' tiny run: 3 steps, validated at the last
TINY_SWEEP = tiny(steps=3, val_every=3)
