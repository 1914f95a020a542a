"""The command-line checks (`attnres.config.command.check_command_line`, what cli.main runs before
Hydra): every mistaken command raises one line, `<what>; <the fix>`, and writes nothing (issue 10,
items 2 and 11); good commands pass. The same table through the real CLI is in tests/test_cli.py;
the checks of composed configs in test_compose.py, of values in test_rules.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from attnres.config.command import check_command_line
from attnres.config.errors import ConfigError
from tests.helpers import CONF
from tests.helpers import TINY_CHECKED as TINY

CUDA = torch.cuda.is_available()
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


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


# -- in-process: the same checks, fast ----------------------------------------------------------


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




def test_seeds_on_demand_without_m_is_refused_naming_what_a_run_alone_would_do(in_tmp):
    """A run alone has no arms and no looks: Hydra trained it on one seed, the design never read."""
    with pytest.raises(ConfigError) as err:
        check_command_line([*TINY, "residual=block", "num_blocks=2", "seeds.on_demand=true", "seed=4"], CONF)
    assert str(err.value) == (
        "seeds.on_demand=true needs a sweep: add -m and the arms to compare (attnres-run -m residual=standard,block "
        "seeds.on_demand=true); without -m it would train one run on seed 4 and read no verdict, so leave "
        "seeds.on_demand=true out of a run alone")
    with pytest.raises(ConfigError, match="would train one run on seed 0 and read no verdict"):  # the configured seed
        check_command_line([*TINY, "num_blocks=2", "seeds.on_demand=true"], CONF)
    for fine in (["-m", *TINY, "residual=standard,block", "num_blocks=2", "seeds.on_demand=true"],
                 ["--cfg", "job", *TINY, "seeds.on_demand=true"], [*TINY, "num_blocks=2", "seeds.on_demand=false"]):
        check_command_line(fine, CONF)
