"""Every mistaken command gets one line on stderr, `attnres-run: error: <what>; <the fix>`,
exit status 2, no traceback, and nothing written (issue 10, items 2 and 11).

The table of mistaken commands runs the real CLI in a subprocess (slow: each start imports
Lightning); the checks behind it (attnres/config/) are also tested in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from attnres.config.command import check_command_line
from attnres.config.compose import suggest
from attnres.config.errors import ConfigError
from attnres.config.rules import validate_config

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# as tests/test_cli.py: a model and data small enough that a CLI run costs seconds
TINY = [
    "data=synthetic", "data.batch_size=8", "data.val_batches=1", "model.n_layer=2", "model.n_embd=32",
    "model.n_head=2", "trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "logger=none",
    "trainer.max_steps=2",
]
CUDA = torch.cuda.is_available()
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`attnres-run ARGS` in a subprocess (via `python -m attnres`, the same entry point), without
    the TRITON_INTERPRET=1 that tests/conftest.py sets for the kernel tests."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("HYDRA_FULL_ERROR", "TRITON_INTERPRET"):
        if name not in (env or {}):
            full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "attnres", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("attnres-run: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _read_only_folder(tmp_path: Path) -> str:
    if ROOT:  # permission bits do not stop root: a file system that refuses new folders does
        return "/sys/attnres-run"
    folder = tmp_path / "read-only"
    if folder.exists():
        return str(folder / "run")
    folder.mkdir()
    folder.chmod(0o555)
    return str(folder / "run")


# (id, arguments after TINY ("TINY" marks where TINY goes), fragments the error line must hold)
MISTAKES = [
    # item 2: a string where a boolean belongs counts as true
    ("overwrite=no", ["overwrite=no"], ["overwrite=no is not a boolean", "overwrite=true or overwrite=false"]),
    ("resume=no", ["resume=no"], ["resume=no is not a boolean", "resume=true or resume=false"]),
    ("compile=off", ["compile=off"], ["compile=off", "compile=true or compile=false"]),
    ("histograms=yes", ["callbacks.depth_dashboard.histograms=yes"],
     ["callbacks.depth_dashboard.histograms=yes", "true or", "false"]),
    ("tie_embeddings=1", ["model.tie_embeddings=1"], ["model.tie_embeddings=1", "model.tie_embeddings=true"]),
    # item 11: unknown keys
    ("typo-model-key", ["model.n_layers=4"], ["unknown key model.n_layers (did you mean model.n_layer?)"]),
    ("typo-trainer-key", ["trainer.max_step=10"], ["unknown key trainer.max_step (did you mean trainer.max_steps?)"]),
    ("typo-top-key", ["num_block=4"], ["unknown key num_block (did you mean num_blocks?)"]),
    ("typo-group", ["residul=block"], ["unknown key residul (did you mean residual?)"]),
    ("lr-not-top-level", ["lr=abc"], ["unknown key lr (did you mean optim.optimizer.lr?)"]),
    ("key-of-other-option", ["data.val_fraction=2"], ["unknown key data.val_fraction", "data=synthetic has no key"]),
    # values
    ("negative-lr", ["optim.optimizer.lr=-1"], ["optim.optimizer.lr=-1", "a number >= 0"]),
    ("seed-string", ["seed=foo"], ["seed=foo is not an integer", "seed=0"]),
    ("seed-negative", ["seed=-1"], ["seed=-1", "an integer >= 0"]),
    ("val-check-0", ["trainer.val_check_interval=0"], ["trainer.val_check_interval=0", "an integer >= 1"]),
    ("max-steps-negative", ["trainer.max_steps=-5"], ["trainer.max_steps=-5", "an integer >= 1"]),
    ("batch-size-0", ["data.batch_size=0"], ["data.batch_size=0", "an integer >= 1"]),
    ("n-embd-vs-n-head", ["model.n_embd=30"], ["model.n_embd=30", "model.n_head=2", "model.n_embd=32"]),
    ("num-blocks-0", ["residual=block", "num_blocks=0"], ["num_blocks=0 must divide the 4 sublayers", "1, 2, 4"]),
    ("num-blocks-string", ["residual=block", "num_blocks=abc"], ["num_blocks=abc is not an integer", "1, 2, 4"]),
    ("precision", ["trainer.precision=bf17"], ["trainer.precision=bf17", "bf16-mixed"]),
    ("devices-0", ["trainer.devices=0"], ["trainer.devices=0", "trainer.devices=auto"]),
    ("deleted-key-in-use", ["~model.n_layer"], ["model.n_layer", "not found"]),
    ("triton-without-cuda", ["residual=full", "residual.kernel=triton"],
     ["residual.kernel=triton", "residual.kernel=auto", "residual.kernel=torch"]),
    ("gpu-without-gpu", ["trainer.accelerator=gpu"], ["trainer.accelerator=gpu", "trainer.accelerator=cpu"]),
    # the output folder
    ("run-dir-impossible", ["hydra.run.dir=/proc/attnres-run"], ["/proc/attnres-run", "hydra.run.dir="]),
    ("run-dir-under-file", ["hydra.run.dir=a-file/run"], ["a-file/run", "is a file", "hydra.run.dir="]),
    ("run-dir-read-only", ["hydra.run.dir=READ_ONLY"], ["READ_ONLY", "hydra.run.dir="]),
    # the shape of the command line
    ("missing-equals-pair", ["residual", "block"], ["'residual' has no '='", "residual=block"]),
    ("missing-equals", ["seed"], ["'seed' has no '='", "seed=<value>"]),
    ("multirun-in-the-middle", ["TINY", "-m", "seed=0,1"], ["seed=0,1 comes after -m", "attnres-run -m"]),
    ("unknown-flag", ["--bogus"], ["unknown option --bogus", "key=value"]),
    ("dashed-override", ["--seed=3"], ["unknown option --seed=3", "seed=3"]),
    ("sweep-without-m", ["seed=0,1"], ["seed=0,1", "add -m"]),
    # sweeps: refused before any job starts
    ("empty-sweep", ["-m", "TINY", "seed=range(0,0)"], ["seed=range(0,0)", "no values", "seed=range(0,3)"]),
    ("sweep-key-of-one-option", ["-m", "TINY", "residual=standard,block", "residual.kernel=torch"],
     ["unknown key residual.kernel", "residual=standard has no key kernel"]),
    ("sweep-bad-second-value", ["-m", "TINY", "model.n_embd=32,30"], ["model.n_embd=30", "model.n_embd=32"]),
]


NEEDS_NO_CUDA = {"triton-without-cuda", "gpu-without-gpu"}
NO_CUDA = pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
# the rows that also run through the real CLI: one of each kind (a CLI start costs seconds)
THROUGH_CLI = {
    "overwrite=no", "typo-model-key", "typo-group", "lr-not-top-level", "seed-string", "max-steps-negative",
    "gpu-without-gpu", "run-dir-impossible", "missing-equals-pair", "multirun-in-the-middle", "unknown-flag",
    "empty-sweep", "sweep-bad-second-value",
}


def _rows(only: set[str] | None = None) -> list:
    return [pytest.param(args, expected, id=name, marks=[NO_CUDA] if name in NEEDS_NO_CUDA else [])
            for name, args, expected in MISTAKES if only is None or name in only]


def _command(args: list[str], folder: Path) -> tuple[list[str], str]:
    """The full argument list (TINY where the row says, else first) and the read-only folder."""
    (folder / "a-file").write_text("not a folder")
    read_only = _read_only_folder(folder)
    args = [a.replace("READ_ONLY", read_only) for a in args]
    at = args.index("TINY") if "TINY" in args else 0
    return [*args[:at], *TINY, *args[at + ("TINY" in args):]], read_only


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


@pytest.mark.parametrize(("args", "expected"), _rows())
def test_mistake_in_process(tmp_path, monkeypatch, args, expected):
    """Every row of the table, through `check_command_line` (what cli.main runs before Hydra)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, read_only = _command(args, tmp_path)
    before = set(tmp_path.iterdir())
    with pytest.raises(ConfigError) as err:
        check_command_line(args, CONF)
    message = str(err.value)
    assert "\n" not in message
    for fragment in expected:
        assert fragment.replace("READ_ONLY", read_only) in message, message
    assert set(tmp_path.iterdir()) == before, "the check wrote something"


@pytest.mark.slow
def test_full_error_keeps_the_trace(tmp_path):
    result = run_cli(*TINY, "overwrite=no", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr and "ConfigError" in result.stderr
    assert not (tmp_path / "outputs").exists()


# -- in-process: the same checks, fast ----------------------------------------------------------
@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield tmp_path
    assert not any(tmp_path.iterdir()), f"the check wrote {list(tmp_path.iterdir())}"


SHAPE_MISTAKES = [
    ("spaced-equals", ["seed", "=", "3"], "write seed=3"),
    ("flag-typo", ["--multirn"], "did you mean --multirun?"),
    ("split-overrides", ["seed=1", "--cfg", "job", "residual=block"], "residual=block comes after --cfg"),
    ("two-commands", ["--cfg", "job", "-m"], "cannot be combined"),
    ("resolve-alone", ["--resolve"], "--resolve only works with --cfg"),
    ("cfg-choice", ["--cfg", "everything"], "invalid choice: 'everything'"),
    ("info-eats-override", ["--info", "seed=1"], "--info took 'seed=1'"),
    ("grammar", ["x=[1,2"], "cannot read the override x=[1,2"),
    ("range-without-m", ["seed=range(0,3)"], "add -m"),
    ("empty-sweep", ["-m", "seed=range(3,3)"], "sweeps over no values"),
    ("hydra-sweep", ["-m", "hydra.run.dir=a,b"], "cannot vary Hydra's own settings"),
    ("interval-sweep", ["-m", "optim.optimizer.lr=interval(0,1)"], "cannot enumerate an interval"),
    ("unknown-option", ["residual=blok"], "did you mean block?"),
]


@pytest.mark.parametrize(("args", "fragment"), [m[1:] for m in SHAPE_MISTAKES], ids=[m[0] for m in SHAPE_MISTAKES])
def test_command_line_shape(in_tmp, args, fragment):
    with pytest.raises(ConfigError) as err:
        check_command_line(args, CONF)
    assert fragment in str(err.value), str(err.value)


COMPOSED_MISTAKES = [
    ("hydra-key", ["hydra.nope=1"], "unknown key hydra.nope"),
    ("add-existing", ["+seed=3"], "drop the + to change it"),
    ("delete-missing", ["~nope"], "~nope deletes a key that does not exist"),
    ("launcher", ["hydra/launcher=nope"], "unknown hydra/launcher 'nope'"),
    ("leaf-elsewhere", ["batch_size=4"], "did you mean data.batch_size?"),
    ("config-as-value", ["optim.optimizer=5"], "optim.optimizer is a group of settings"),
    ("bool-untyped-key", ["callbacks.checkpoint.auto_insert_metric_name=no"], "true or"),
    ("int-untyped-key", ["callbacks.progress_bar.refresh_rate=abc"], "is not an integer"),
    ("broken-interpolation", ["model.n_layer=${nope}"], "model.n_layer"),
    ("fsdp-on-cpu", ["trainer=fsdp"], "trainer.strategy=fsdp needs GPUs"),
    ("text-without-path", ["data=text"], "data.path is not set"),
    ("name-escapes", ["name=../x"], "name=../x is not a folder name"),
    ("resume-and-overwrite", ["resume=true", "overwrite=true"], "contradict"),
    ("missing-ckpt", ["ckpt_path=/no/such.ckpt"], "ckpt_path=/no/such.ckpt is not a file"),
    ("schedule", ["optim.schedule.warmup_steps=-1"], "optim.schedule.warmup_steps=-1"),
    ("betas", ["optim.optimizer.betas=[0.9,2]"], "two numbers in [0, 1)"),
    ("fast-dev-run", ["debug=fast_dev_run", "trainer.fast_dev_run=maybe"], "a number of batches"),
    ("cache-dir", ["data=stdlib", "data.cache_dir=/proc/attnres-cache"], "data.cache_dir="),
    ("sweep-last-job", ["-m", "model.n_embd=32,36", "model.n_head=2,4"], "model.n_embd=36 must split into"),
    ("sweep-glob-type", ["-m", "residual=glob(*)", "num_blocks=2", "seed=0,x"], "seed=x is not an integer"),
]
if not CUDA:
    COMPOSED_MISTAKES.append(("triton-sweep", ["-m", "residual=standard,full", "residual.kernel=triton"],
                              "unknown key residual.kernel"))


@pytest.mark.parametrize(("args", "fragment"), [m[1:] for m in COMPOSED_MISTAKES],
                         ids=[m[0] for m in COMPOSED_MISTAKES])
def test_composed_config(in_tmp, args, fragment):
    flags = [a for a in args if a.startswith("-")]
    with pytest.raises(ConfigError) as err:
        check_command_line([*flags, *TINY, *(a for a in args if not a.startswith("-"))], CONF)
    assert fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args", [
    [], ["residual=block", "num_blocks=2"], ["-m", "seed=range(0,3)"],
    ["-m", "residual=glob(*)", "num_blocks=2"], ["--cfg", "job", "seed=foo"], ["--cfg", "job", "hydra.run.dir=/proc/x"],
    ["--help"], ["--version"], ["--info", "defaults"], ["+model.new_knob=1"], ["trainer.deterministic=warn"],
    ["callbacks.checkpoint.save_last=link"], ["trainer.devices=auto"], ["optim.schedule=null"],
    ["debug=fast_dev_run", "trainer.fast_dev_run=3"], ["trainer.max_steps=-1", "optim.total_steps=10"],
    ["hydra/launcher=basic", "-m", "seed=0,1"], ["-m", "model.n_embd=32,64", "model.n_head=2,4,8", "seed=0,1"],
    ["hydra.run.dir=elsewhere/run", "name=other"], ["residual=block", "num_blocks=2", "residual.block_sizes=[3,1]"],
], ids=lambda a: " ".join(a) or "tiny")
def test_good_commands_pass(in_tmp, args):
    flags = [a for a in args if a.startswith("-") or a in ("job", "defaults")]
    check_command_line([*flags, *TINY, *(a for a in args if a not in flags)], CONF)


def test_multirun_flag_after_the_overrides(in_tmp):
    """argparse reads `a=1,2 -m` as a sweep (Hydra runs it): only overrides on both sides of -m are refused."""
    check_command_line([*TINY, "residual=standard,full", "-m"], CONF)


def test_user_config_folder(in_tmp):
    user = in_tmp.parent / f"{in_tmp.name}-conf"
    (user / "residual").mkdir(parents=True)
    (user / "residual" / "mine.yaml").write_text("_target_: attnres.FullAttentionResidual\n_partial_: true\n"
                                                 "kernel: auto\n")
    search = f"hydra.searchpath=[file://{user}]"
    check_command_line([*TINY, search, "residual=mine"], CONF)
    with pytest.raises(ConfigError, match=r"did you mean residual\.kernel\?"):
        check_command_line([*TINY, search, "residual=mine", "residual.kernl=torch"], CONF)


# -- validate_config on one composed config --------------------------------------------------------
@pytest.fixture(scope="module")
def job_cfg():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "residual=block", "num_blocks=2"])
    GlobalHydra.instance().clear()
    return cfg


def _with(cfg, **values):
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


@pytest.mark.parametrize(("values", "fragment"), [
    ({"overwrite": "no"}, "overwrite=no is not a boolean"),
    ({"seed": "foo"}, "seed=foo is not an integer"),
    ({"seed": 2**32}, "seed=4294967296"),
    ({"num_blocks": 3}, "num_blocks=3 must divide the 4 sublayers (2 per transformer layer), or give unequal "
                        "blocks with residual.block_sizes=[...]; valid values: 1, 2, 4"),
    ({"num_blocks": 2, "residual__block_sizes": [3, 2]}, "residual.block_sizes=[3,2] must be positive integers "
                                                           "summing to the 4 sublayers"),
    ({"num_blocks": 3, "residual__block_sizes": [3, 1]}, "num_blocks=3 disagrees with residual.block_sizes"),
    ({"model__n_embd": 30}, "model.n_embd=30 must split into model.n_head=2"),
    ({"model__n_head": 32}, "model.n_embd=32 must split into model.n_head=32"),
    ({"model__dropout": 1.0}, "model.dropout=1.0"),
    ({"model__mlp": "relu"}, "gelu, swiglu"),
    ({"residual__kernel": "trit"}, "auto, triton, cpu, torch, naive"),
    ({"trainer__max_steps": -1}, "optim.total_steps"),
    ({"trainer__max_steps": 1e3}, "trainer.max_steps=1000.0 is not an integer"),
    ({"trainer__val_check_interval": 0.5}, "trainer.val_check_interval=0.5 is not an integer"),
    ({"trainer__precision": "bf17"}, "trainer.precision=bf17 is not a precision"),
    ({"trainer__devices": 0}, "trainer.devices=0 is invalid"),
    ({"trainer__devices": -1}, "trainer.devices=-1 is invalid"),
    ({"trainer__accelerator": "abacus"}, "trainer.accelerator=abacus is not an accelerator"),
    ({"trainer__strategy": "dpp"}, "did you mean ddp?"),
    ({"trainer__deterministic": "maybe"}, "trainer.deterministic=true or trainer.deterministic=false or"),
    ({"optim__optimizer__betas": [0.9]}, "optim.optimizer.betas=[0.9]"),
    ({"optim__query_lr_scale": -0.1}, "optim.query_lr_scale=-0.1"),
    ({"data__num_workers": -1}, "data.num_workers=-1"),
    ({"callbacks__checkpoint__save_last": "always"}, "or callbacks.checkpoint.save_last=link"),
    ({"name": ""}, "name='' is not a folder name"),
    ({"name": "/abs"}, "name=/abs is not a folder name"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_validate_config_rejects(job_cfg, values, fragment):
    with pytest.raises(ConfigError) as err:
        validate_config(_with(job_cfg, **values))
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("values", [
    {}, {"trainer__deterministic": "warn"}, {"trainer__devices": "auto"}, {"trainer__devices": "2"},
    {"callbacks__checkpoint__save_last": "link"}, {"trainer__fast_dev_run": True}, {"trainer__fast_dev_run": 3},
    {"trainer__max_steps": -1, "optim__total_steps": 10}, {"trainer__gradient_clip_val": None},
    {"name": "study/part-1"}, {"model___target_": "my.Model", "model__n_embd": "wide"},
    {"optim__optimizer___target_": "my.Optimizer", "optim__optimizer__lr": "cyclic"},
], ids=lambda v: repr(v))
def test_validate_config_accepts(job_cfg, values):
    validate_config(_with(job_cfg, **values))


def test_validate_config_needs_no_hydra_node():
    validate_config(OmegaConf.create({"seed": 1, "model": {"_target_": "attnres.Transformer", "n_layer": 2}}))
    with pytest.raises(ConfigError, match="compile=yes is not a boolean"):
        validate_config(OmegaConf.create({"compile": "yes"}))


def test_suggest():
    keys = ["seed", "num_blocks", "model.n_layer", "trainer.max_steps", "optim.optimizer.lr", "data.batch_size",
            "model.block_size", "data.block_size"]
    assert suggest("model.n_layers", keys) == ["model.n_layer"]
    assert suggest("lr", keys) == ["optim.optimizer.lr"]
    assert suggest("block_size", keys) == ["model.block_size", "data.block_size"]
    assert suggest("trainer.max_stepz", keys) == ["trainer.max_steps"]
    assert suggest("completely_else", keys) == []
