"""How long a user waits for attnres-run's first answer: a mistaken command's one line against
`--help`, measured in the same run (issue "The first hour", item 2).

    python experiments/bench_first_answer.py            # 5 interleaved rounds
    python experiments/bench_first_answer.py --rounds 9

Each command runs as its own process (`python -m attnres`, which is `attnres-run`), from an empty
folder, rounds interleaved so that a busy machine slows them alike; the table gives the median wall
time and its ratio to `--help`'s, and whether the process imported torch (it must not, to answer
a mistake).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "--help": ["--help"],
    "unknown key": ["model.n_layers=4"],
    "unknown option": ["residual=blok"],
    "bad value": ["trainer.max_steps=-5"],
    "typo in a sweep": ["-m", "residual=standard,blok"],
}
#: run after the command, in the same process: did it import torch?
PROBE = ("import atexit, sys; atexit.register(lambda: print('torch imported' if 'torch' in sys.modules "
         "else 'no torch', file=sys.stderr)); sys.argv = ['attnres-run', *sys.argv[1:]]; "
         "from attnres._entry import main; main()")


def one(args: list[str], folder: str) -> tuple[float, bool]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=folder, capture_output=True, text=True)
    return time.perf_counter() - start, "torch imported" in done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    torch_seen: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for name, args in COMMANDS.items():
                elapsed, imported = one(args, folder)
                times[name].append(elapsed)
                torch_seen[name] = torch_seen.get(name, False) or imported
    base = statistics.median(times["--help"])
    print(f"{'command':<18} {'median s':>9} {'x --help':>9}  torch")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<18} {median:>9.3f} {median / base:>8.1f}x  {'yes' if torch_seen[name] else 'no'}")


if __name__ == "__main__":
    main()
