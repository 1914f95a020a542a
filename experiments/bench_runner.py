"""What a user sees: the runner's training tokens/s for each residual strategy, as ratios to
the standard residual measured in the same invocation.

Runs `python -m attnres` (the same as `attnres-run`) once per strategy per round, the
strategies interleaved (standard, block, full, then again in a rotated order) so that a busy
machine slows all of them alike, and reads `tokens_per_sec` (training tokens over training
time, validation and checkpointing excluded) from each run's `metrics.json`. Every run is the
default configuration (the tiny model on the stdlib corpus, TensorBoard and dashboards on,
one validation at the end) unless overrides are given.

    python experiments/bench_runner.py                         # 300 steps, 3 rounds, torch's threads
    python experiments/bench_runner.py --steps 1500 --rounds 1 # the README's default run
    python experiments/bench_runner.py --compile               # compile=true (first-step cost reported)
    python experiments/bench_runner.py -- model.n_embd=64 model.n_layer=12   # any overrides after --

Prints a table (median tokens/s over rounds; the ratio to standard as the median of each
round's ratio, with the smallest and largest; wall time) and, with --json PATH, writes every
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnres.atomic import write_json

STRATEGIES = {"standard": ["residual=standard"], "block": ["residual=block", "num_blocks=8"],
              "full": ["residual=full"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="runs per strategy, interleaved (default 3)")
    p.add_argument("--strategies", default="standard,block,full", help=f"subset of {','.join(STRATEGIES)}")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the runs (default: unset, torch's choice, as a user runs it)")
    p.add_argument("--compile", action="store_true", help="compile=true in every run")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all figures here")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep the run folders here (default: a temporary folder, removed)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        p.error(f"--strategies takes a subset of {','.join(STRATEGIES)}, got {args.strategies!r}")
    if "standard" not in names:
        names.insert(0, "standard")  # the ratios' denominator
    if args.steps < 20 or args.rounds < 1:
        p.error("--steps must be at least 20 (tokens/s skips the first steps) and --rounds at least 1")
    args.strategies = names
    return args


def run_once(name: str, args: argparse.Namespace, root: Path, round_: int) -> dict:
    run_dir = root / f"{name}-r{round_}"
    cmd = [sys.executable, "-m", "attnres", *STRATEGIES[name], f"trainer.max_steps={args.steps}",
           f"trainer.val_check_interval={args.steps}",
           f"compile={'true' if args.compile else 'false'}", f"hydra.run.dir={run_dir}", *args.overrides]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode in (130, -signal.SIGINT):  # the run was stopped (Ctrl-C reaches it too): so is this
        raise KeyboardInterrupt
    if proc.returncode in (143, -signal.SIGTERM):
        raise Stopped
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"bench_runner: {name} failed (exit {proc.returncode}): {' | '.join(tail)}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {"tokens_per_sec": metrics.get("tokens_per_sec"), "wall_s": round(wall, 1),
            "run_wall_time_s": metrics.get("wall_time_s")}


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per strategy: the median tokens/s over rounds and, as the ratio to standard, the median
    of each round's own ratio (its run over standard's run of the same round; the two ran one
    after the other, so a machine that slows down between rounds moves both), with the
    smallest and largest round."""
    medians = {n: statistics.median(x["tokens_per_sec"] for x in rs) for n, rs in runs.items()}
    paired = {}
    for n, rs in runs.items():
        rounds = [x["tokens_per_sec"] / s["tokens_per_sec"] for x, s in zip(rs, runs["standard"], strict=True)]
        paired[n] = {"median": statistics.median(rounds), "min": min(rounds), "max": max(rounds), "rounds": rounds}
    return {"median_tokens_per_sec": medians, "paired_ratio": paired,
            "ratio_of_medians": {n: v / medians["standard"] for n, v in medians.items()}}


class Stopped(BaseException):  # as KeyboardInterrupt: no `except Exception` swallows it
    """SIGTERM, raised where the main thread is (as SIGINT raises KeyboardInterrupt), so that the
    run in progress is stopped (`subprocess.run` kills it) and the temporary run folders are
    removed on the way out."""


def _stop(signum, frame):
    raise Stopped


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _main(args)
    except (KeyboardInterrupt, Stopped) as stop:
        sigint = isinstance(stop, KeyboardInterrupt)
        kept = f"; the finished runs' figures are in {args.json}" if args.json and args.json.exists() else ""
        where = f"the run folders are in {args.keep}" if args.keep else "the temporary run folders were removed"
        print(f"\nbench_runner: stopped by {'SIGINT' if sigint else 'SIGTERM'}; the run in progress was stopped, "
              f"{where}{kept}", file=sys.stderr)
        raise SystemExit(130 if sigint else 143) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> dict:
    results: dict = {"info": {"steps": args.steps, "rounds": args.rounds, "threads": args.threads,
                              "compile": args.compile, "overrides": args.overrides}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_runner-") as tmp:
        root = args.keep or Path(tmp)
        names = list(args.strategies)
        total = len(names) * args.rounds
        done = 0
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                res = run_once(name, args, root, r)
                results["runs"].setdefault(name, []).append(res)
                done += 1
                print(f"[{done}/{total}] {name}: {res['tokens_per_sec']:.0f} tokens/s, {res['wall_s']:.0f} s wall",
                      flush=True)
                if args.json:
                    write_json(args.json, results)
    results.update(summarise(results["runs"]))
    print(f"\n{args.steps} steps x {args.rounds} rounds, compile={args.compile}, threads={args.threads or 'default'}")
    medians, paired = results["median_tokens_per_sec"], results["paired_ratio"]
    for n, v in medians.items():
        walls = [x["wall_s"] for x in results["runs"][n]]
        spread = "" if n == "standard" or len(paired[n]["rounds"]) < 2 else \
            f" (rounds {paired[n]['min']:.3f}-{paired[n]['max']:.3f})"
        print(f"  {n:<9} {v:9.0f} tokens/s  {paired[n]['median']:.3f}x standard{spread}   "
              f"wall {statistics.median(walls):.0f} s per run")
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
