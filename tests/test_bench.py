"""experiments/bench_residuals.py runs end to end on a tiny shape and writes every figure: a
smoke test, so that a GPU session does not find the script broken. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from attnres.functional import resolve_kernel
from tests.helpers import load_experiment


@pytest.fixture(scope="module")
def bench():
    return load_experiment("bench_residuals")


TINY = "--n-layer 2 --n-embd 32 --n-head 2 --seq-len 16 --batch 2 --vocab 64 --num-blocks 2 --steps 2 --warmup 1"


@pytest.mark.usefixtures("torch_single_thread")
def test_bench_writes_every_figure(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main([*TINY.split(), "--device", "cpu", "--no-compile", "--json", str(out)])
    results = json.loads(out.read_text())
    fast = resolve_kernel("auto", torch.zeros(1))  # "cpu" where the C++ kernel builds
    assert results["info"]["kernel_resolved"] == fast and results["info"]["modes"] == ["eager"]
    for name in ("standard", "block", "full"):
        row = results["eager"][name]
        assert row["train_step_s"] > 0 and row["prefill_s"] > 0 and len(row["train_samples_s"]) == 2
        assert row["peak_train_bytes"] is None  # not measured on CPU
        assert results["saved_for_backward_bytes"][name] > 0
    op = results["op"]
    # on the C++ kernel also with the next pre-norm fused in (cpu+norm) and composed after it (cpu,norm)
    cpu_arms = {"cpu", "cpu+norm", "cpu,norm"} if fast == "cpu" else set()
    assert op["sources"] == 3 and set(op["kernels"]) == {"naive", "torch"} | cpu_arms
    assert all(r["forward"]["vs_floor"] > 0 for r in op["kernels"].values())
    assert set(results["depth_traffic"]) == {"block", "full"}  # standard makes no depth-attention call
    assert results["cold_stream_bandwidth_bytes_per_s"] > 0
    assert all(t["cold_stream_s"] >= t["floor_s"] > 0 and t["calls"] == 5 for t in results["depth_traffic"].values())
    printed = capsys.readouterr().out
    assert "activations saved for backward" in printed and "block" in printed and "x floor" in printed
    assert "depth-attention traffic" in printed and "eager: floor" in printed
    assert "median (quartiles) over rounds: block" in printed


def test_op_is_timed_with_the_prenorm_fused_on_every_kernel_that_fuses_it(bench):
    # the C++ kernel and Triton's one-query path fuse the next pre-norm: each timed fused (+norm) and
    # composed after the plain op (,norm), so the first GPU session measures the fused path too
    arms = bench.op_arms(["naive", "torch", "triton", "cpu"])
    assert arms == [("naive", ""), ("torch", ""), ("triton", ""), ("cpu", ""), ("triton", "+norm"),
                    ("triton", ",norm"), ("cpu", "+norm"), ("cpu", ",norm")]
    assert bench.op_arms(["naive", "torch"]) == [("naive", ""), ("torch", "")]


def test_step_ratio_pairs_each_round_with_standards(bench):
    assert bench.paired_ratio([1.0, 1.1, 1.2, 1.3, 1.4], [1.0] * 5) == pytest.approx((1.1, 1.2, 1.3))
    # a round on a slow machine is slow for both: its ratio is that of the others
    assert bench.paired_ratio([1.1, 2.2, 1.1], [1.0, 2.0, 1.0]) == pytest.approx((1.1, 1.1, 1.1))
    assert bench.paired_ratio([1.5], [1.0]) == (1.5, 1.5, 1.5)


def test_saved_bytes_count_each_storage_once_and_leave_out_parameters(bench):
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, idx, targets=None):
            x = idx.float().unsqueeze(-1).expand(*idx.shape, 8).contiguous()  # a fresh (B, T, 8)
            y = x @ self.w  # saves x (and w, a parameter: not counted)
            return {"loss": (y * y).sum()}  # saves y twice: counted once

    args = bench.parse_args([*TINY.split(), "--device", "cpu"])
    case = bench.Case("standard", args)
    case.model = Toy()
    b, t = case.idx.shape
    assert case.saved_bytes() == 2 * b * t * 8 * 4


def test_runner_ratio_is_the_median_of_each_rounds_own_ratio():
    """experiments/bench_runner.py: a machine that slows down between rounds moves both runs of
    a round; the ratio pairs them (the ratio of the medians would mix rounds)."""
    runner = load_experiment("bench_runner")
    tps = {"standard": [100.0, 200.0, 150.0], "block": [90.0, 170.0, 140.0]}
    out = runner.summarise({n: [{"tokens_per_sec": v} for v in vs] for n, vs in tps.items()})
    assert out["median_tokens_per_sec"] == {"standard": 150.0, "block": 140.0}
    block = out["paired_ratio"]["block"]
    assert block["rounds"] == pytest.approx([0.9, 0.85, 140 / 150])
    assert (block["median"], block["min"], block["max"]) == pytest.approx((0.9, 0.85, 140 / 150))
    assert out["paired_ratio"]["standard"]["median"] == 1.0
    assert out["ratio_of_medians"]["block"] == pytest.approx(140 / 150)


@pytest.mark.usefixtures("torch_single_thread")
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_depth_traffic_counts_each_call_of_a_block_step(bench, kernel):
    """Block N=2 on 4 sublayers (S=2): phase 1 over [e] (K=2), phase 2 over sublayer 0's output
    p1 (after a prefix), phase 1 over [e, b1] with the output's query (K=3), phase 2 over
    sublayer 2's output, the output's merge of b2 (after a prefix). Rows (one (B, T, D) tensor
    each), forward n + P + K and backward n + K + 2P: 6 + 7 + 10 + 7 + 7 = 37; the source
    gradients, 2c - 1 for a source c calls read (e 2, the rest 1): 3 + 1 + 1 + 1 + 1 = 7.
    Statistics per token, twice: (n + K n + K + P) = 5 + 4 + 11 + 4 + 4 = 28."""
    args = bench.parse_args([*TINY.split(), "--device", "cpu", "--kernel", kernel])
    assert bench.depth_traffic(bench.Case("standard", args)) is None
    traffic = bench.depth_traffic(bench.Case("block", args))
    s = args.shape
    tokens = s["batch"] * s["seq_len"]
    assert traffic == {"calls": 5, "bytes": 44 * tokens * s["n_embd"] * 4 + 2 * 28 * tokens * 4}


@pytest.mark.usefixtures("torch_single_thread")
def test_depth_traffic_of_a_fused_prenorm_step_takes_over_the_norms(bench):
    """block-prenorm: the same 5 calls, the first 4 each with a sublayer's pre-norm fused in on the
    C++ kernel (the output's merge has none): each writes and reads h (2 rows) and spares the
    sublayer's own norm (5 rows), 3 rows less a call than the 44 of block's step above."""
    args = bench.parse_args([*TINY.split(), "--device", "cpu"])
    if resolve_kernel("auto", torch.zeros(1)) != "cpu":
        pytest.skip("the C++ kernel is not built here")
    traffic = bench.depth_traffic(bench.Case("block-prenorm", args))
    s = args.shape
    tokens = s["batch"] * s["seq_len"]
    assert traffic == {"calls": 5, "bytes": (44 - 4 * 3) * tokens * s["n_embd"] * 4 + 2 * 28 * tokens * 4}


def test_unknown_strategy_is_refused_before_any_work(bench, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--strategies", "standard,block-norm"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--strategies takes a comma-separated subset of standard,block,full,block-prenorm,full-prenorm" in err[-1]
    assert "block-norm" in err[-1]


@pytest.mark.parametrize(("child_exit", "code", "signame"), [(130, 130, "SIGINT"), (-15, 143, "SIGTERM")])
def test_runner_stopped_mid_run_says_so_in_one_line_and_leaves_no_run_folder(
        monkeypatch, tmp_path, capsys, child_exit, code, signame):
    """A run that ends by SIGINT (Ctrl-C reaches the whole process group) or SIGTERM stops the
    benchmark with it: one line, the signal's exit code, the temporary run folders removed, the
    finished runs' figures kept."""
    import subprocess
    import tempfile

    runner = load_experiment("bench_runner")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        run_dir = Path(next(a for a in cmd if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        if len(calls) == 1:  # standard finishes
            run_dir.mkdir(parents=True)
            (run_dir / "metrics.json").write_text(json.dumps({"tokens_per_sec": 1000.0, "wall_time_s": 1.0}))
            return subprocess.CompletedProcess(cmd, 0, "", "")
        run_dir.mkdir(parents=True)  # block is stopped part way
        return subprocess.CompletedProcess(cmd, child_exit, "", "")

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    out = tmp_path / "figures" / "runner.json"
    with pytest.raises(SystemExit) as stop:
        runner.main(["--steps", "20", "--rounds", "1", "--strategies", "block", "--json", str(out)])
    assert stop.value.code == code and len(calls) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"bench_runner: stopped by {signame}") and str(out) in err[0]
    assert not list(tmp_path.glob("bench_runner-*"))
    assert list(json.loads(out.read_text())["runs"]) == ["standard"]


class _Stopped(Exception):  # noqa: N818  (a stand-in for the timeout, not an error)
    """Raised where the benchmark is cut short."""


@pytest.mark.usefixtures("torch_single_thread")
def test_bench_stopped_midway_keeps_what_finished(bench, tmp_path, monkeypatch):
    """A run cut short (gpu_check.sh runs it under `timeout`) leaves the JSON of what it measured:
    the stages before, and in the mode it was in, the strategies already done; nothing after."""
    out = tmp_path / "bench.json"
    measured, calls = bench.peak_bytes, []

    def stop_at_block(case, fn, device):  # two calls per strategy (train, prefill): the third is block's
        calls.append(case)
        if len(calls) == 3:
            raise _Stopped
        return measured(case, fn, device)

    monkeypatch.setattr(bench, "peak_bytes", stop_at_block)
    with pytest.raises(_Stopped):
        bench.main([*TINY.split(), "--device", "cpu", "--no-compile", "--strategies", "standard,block,full",
                    "--json", str(out)])
    results = json.loads(out.read_text())
    assert results["stages_done"] == ["op", "saved_and_traffic"]  # eager did not finish
    assert results["op"]["kernels"] and results["saved_for_backward_bytes"]["full"] > 0
    rows = results["eager"]
    assert all(rows[n]["train_step_s"] > 0 and rows[n]["prefill_s"] > 0 for n in ("standard", "block", "full"))
    assert set(rows["standard"]) == set(rows["block"])  # every key there, the unmeasured ones None
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left beside it


@pytest.mark.usefixtures("torch_single_thread")
def test_decode_bench_writes_every_route_and_ratio(tmp_path, capsys):
    """experiments/bench_decode.py end to end at its tiny shape: attnres and Hugging Face
    generate() and the interleaved steps, each strategy's per-token and prefill times and their
    paired ratios to standard's (no timing asserted)."""
    pytest.importorskip("transformers")
    decode = load_experiment("bench_decode")
    out = tmp_path / "decode.json"
    decode.main(["--shapes", "tiny", "--rounds", "2", "--hf", "--device", "cpu", "--json", str(out)])
    results = json.loads(out.read_text())
    routes = results["shapes"]["tiny"]["routes"]
    assert set(routes) == {"attnres", "hf", "steps"}
    new = decode.SHAPES["tiny"]["new"]
    for route, rows in routes.items():
        assert set(rows) == {"standard", "block", "full"}
        for name, row in rows.items():
            assert row["token_s"] > 0 and row["prefill_s"] > 0, (route, name)
            ratio, low, high = row["vs_standard"]["token_s"]
            assert low <= ratio <= high and (name != "standard" or ratio == 1.0)
        steps = rows["block"]["samples"]["token_s"]  # generate: one median step per call; steps: every step
        assert len(steps) == (2 * (new - 1) if route == "steps" else 2)
    assert "steps, interleaved" in capsys.readouterr().out


def test_decode_ratios_pair_each_round():
    decode = load_experiment("bench_decode")
    assert decode.paired([1.0, 2.2, 3.3], [1.0, 2.0, 3.0])[0] == pytest.approx(1.1)
    assert decode.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
