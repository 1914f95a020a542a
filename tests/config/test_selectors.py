"""A value that names no entry of a config table (`experiment=paper_*`'s `scale=` and `size=`) is
one line naming the key as typed and its valid values, for a run, a sweep and `--cfg job`
(issue "Trust, round three", items 5 and 8); a single run of a built-in sweep says so (item 11)."""

from __future__ import annotations

import re
import sys

import pytest

from attnres.config.command import check_command_line
from attnres.config.errors import ConfigError
from tests.helpers import CONF

SIZES = "194m, 241m, 296m, 436m, 528m"

CASES = {
    "sweep-size-case": (["-m", "experiment=paper_scaling", "scale=cpu", "size=194M"],
                        f"size=194M is not one of {SIZES}", "did you mean size=194m?"),
    "sweep-second-value": (["-m", "experiment=paper_scaling", "scale=cpu", "size=194m,241n"],
                           f"size=241n is not one of {SIZES}", "did you mean size=241m?"),
    "sweep-scale": (["-m", "experiment=paper_scaling", "scale=cpuu"], "scale=cpuu is not one of paper, cpu",
                    "did you mean scale=cpu?"),
    "run-size": (["experiment=paper_base", "scale=cpu", "size=19m"], f"size=19m is not one of {SIZES}",
                 "did you mean size=194m?"),
    "blocksize-size": (["-m", "experiment=paper_blocksize", "scale=cpu", "size=big"], f"size=big is not one of {SIZES}",
                       "pick one, e.g. size=194m"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_value_that_names_no_entry_is_one_line_naming_the_key_and_its_values(case):
    args, said, hint = CASES[case]
    with pytest.raises(ConfigError) as err:
        check_command_line(args, CONF)
    message = str(err.value)
    assert said in message and hint in message, message
    assert "Interpolation" not in message and "\n" not in message


def test_cfg_job_answers_a_mistyped_size_in_one_line(monkeypatch, capsys):
    """`attnres-run --cfg job experiment=paper_scaling size=19m residual=block` printed 131 lines."""
    import cli

    monkeypatch.setattr(sys, "argv", ["attnres-run", "--cfg", "job", "experiment=paper_scaling", "size=19m",
                                      "residual=block"])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(rf"attnres-run: error: size=19m is not one of {SIZES} \(the entries of sizes\.paper\); "
                    r"did you mean size=194m\?$", err[0]), err


def test_a_single_run_of_a_built_in_sweep_says_it_trains_one_job(capsys):
    check_command_line(["experiment=paper_scaling", "scale=cpu"], CONF)
    err = capsys.readouterr().err
    assert "experiment=paper_scaling is a sweep of 15 jobs over size, residual" in err, err
    assert "trains one of them (size=436m, residual=standard); add -m" in err, err


@pytest.mark.parametrize("args", [["-m", "experiment=paper_scaling", "scale=cpu"],
                                  ["experiment=paper_scaling", "scale=cpu", "size=194m", "residual=block"],
                                  ["residual=block"]])
def test_no_note_for_a_sweep_or_a_run_that_picks_its_job(capsys, args):
    check_command_line(args, CONF)
    assert "is a sweep of" not in capsys.readouterr().err


@pytest.mark.parametrize(("value", "said"), [
    ("budget=abc", "budget=abc is not a number"), ("budget=0", "budget=0 is out of range"),
    ("gpus_per_job=x", "gpus_per_job=x is not an integer"), ("gpus_per_node=0", "gpus_per_node=0 is out of range"),
    ("szie=194m", "unknown key szie (did you mean size?)"), ("budgte=0.1", "unknown key budgte (did you mean budget?)"),
])
def test_a_bad_value_of_a_paper_key_is_named(value, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        check_command_line(["-m", "experiment=paper_scaling", "scale=cpu", value], CONF)


def test_cfg_job_shows_a_resolvers_own_words(monkeypatch, capsys):
    import cli

    monkeypatch.setattr(sys, "argv", ["attnres-run", "--cfg", "job", "experiment=paper_scaling", "gpus_per_job=x"])
    with pytest.raises(SystemExit):
        cli.main()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("attnres-run: error: GPUs per job and per node must be whole numbers >= 1, got 'x'"), line
    assert "${...}" not in line and "raised while resolving" not in line
