"""The benchmark and study scripts under experiments/ answer a bad argument with one line naming
it, exit status 2, before any model is built (experiments/bench_decode.py, coord_check.py)."""

from __future__ import annotations

import pytest

from tests.helpers import load_experiment


@pytest.fixture(scope="module")
def decode():
    return load_experiment("bench_decode")


@pytest.fixture(scope="module")
def coord():
    return load_experiment("coord_check")


@pytest.mark.parametrize(("args", "said"), [
    (["--num-blocks", "0"], "--num-blocks 0 must divide shape tiny's 4 sublayers; valid values: 1, 2, 4"),
    (["--num-blocks", "3"], "--num-blocks 3 must divide shape tiny's 4 sublayers"),
    (["--rounds", "0"], "--rounds takes 1 or more"),
    (["--rounds", "-1"], "--rounds takes 1 or more"),
    (["--warmup", "-1"], "--warmup takes 0 or more"),
    (["--threads", "0"], "--threads takes 1 or more"),
    (["--device", "nosuch"], "--device takes cpu or cuda (cuda:N for one GPU), got 'nosuch'"),
    (["--device", "mps"], "--device takes cpu or cuda"),
    (["--strategies", ","], "--strategies takes"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_decode_bench_refuses_a_bad_argument_in_one_line(decode, capsys, monkeypatch, args, said):
    monkeypatch.setattr(decode, "bench_shape", lambda *a: pytest.fail("a refused argument ran the benchmark"))
    with pytest.raises(SystemExit) as stop:
        decode.main(["--shapes", "tiny", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("bench_decode.py: ") and said in err, err


def test_decode_bench_refuses_cuda_where_there_is_none(decode, capsys, monkeypatch):
    monkeypatch.setattr(decode.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        decode.parse_args(["--shapes", "tiny", "--device", "cuda"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "sees no CUDA device; use --device cpu" in err


@pytest.mark.parametrize(("args", "said"), [
    (["--sizes", "30"], "--sizes needs at least two sizes (a slope is fitted across them), got 30"),
    (["--sizes", "0,32"], "--sizes takes positive widths, got 0"),
    (["--axis", "depth", "--sizes=-2,4"], "--sizes takes positive depths, got -2"),
    (["--steps", "0"], "--steps takes 1 or more"),
    (["--lr", "-1"], "--lr takes a positive learning rate, got -1"),
    (["--lr", "nan"], "--lr takes a positive learning rate, got nan"),
    (["--fixed", "0"], "--fixed takes a positive depth, got 0"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_coordinate_check_names_each_mistake(coord, capsys, monkeypatch, tmp_path, args, said):
    monkeypatch.setattr(coord, "run", lambda *a, **k: pytest.fail("a refused argument ran the check"))
    assert coord.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("coord_check.py: ") and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "out").exists()
