"""The reproduction study: does small scale reproduce the Attention Residuals paper's claims?

    python experiments/reproduce/run.py                 # every part on CPU, then REPORT.md
    python experiments/reproduce/run.py --parts shapes  # one part (shapes, knobs, ladder)
    python experiments/reproduce/run.py --report-only   # rebuild REPORT.md from the runs so far
    python experiments/reproduce/run.py --gpu           # the same study at the GPU sizes

Each part is one or more `attnres-run -m` sweeps (configs: experiments/reproduce/conf/ and
conf/experiment/scaling_ladder.yaml) into `experiments/reproduce/runs/<sweep>/` (`--out`
moves it). Every sweep runs with `resume=true`: run the command again after a crash, a kill or
Ctrl-C and finished jobs are skipped, unfinished ones continue from their last checkpoint. The
wall time of each part is added up across invocations in `runs/state.json`. The report
(experiments/reproduce/report.py) is written at the end, or alone with `--report-only`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONF = HERE / "conf"


@dataclass(frozen=True)
class Sweep:
    folder: str  # under the output folder
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Part:
    name: str
    question: str
    sweeps: tuple[Sweep, ...]


SEEDS = "seed=0,1,2"
SHAPES = ("experiment=repro_shapes",)
PARTS = (
    Part("shapes", "the loss ordering of standard, Block and Full AttnRes at a wide and a deep shape; "
                   "magnitudes, gradient norms and depth attention across depth",
         (Sweep("shapes", (*SHAPES, "shape=wide,deep", "residual=standard,block,full", SEEDS)),)),
    Part("knobs", "how the answer depends on optim.query_lr_scale and num_blocks (wide shape, L = 8; its "
                  "standard runs, Block N=4 at scale 0.1 and Full, which is Block N=8, come from part shapes)",
         (Sweep("knobs_query_lr", (*SHAPES, "shape=wide", "residual=block", "optim.query_lr_scale=0.03,0.3,1", SEEDS)),
          Sweep("knobs_num_blocks", (*SHAPES, "shape=wide", "residual=block", "num_blocks=2", SEEDS)))),
    Part("ladder", "the compute-equivalence multiplier of Block AttnRes over a four-rung size ladder",
         (Sweep("ladder", ("experiment=scaling_ladder",)),)),
)
GPU = ("scale=gpu", "trainer=gpu")


def read_state(out: Path) -> dict:
    try:
        return json.loads((out / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def write_state(out: Path, state: dict) -> None:
    tmp = out / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "state.json")


def run_sweep(sweep: Sweep, out: Path, gpu: bool, jobs: int | None) -> int:
    command = [sys.executable, "-m", "attnres", "-m", f"hydra.searchpath=[file://{CONF}]", *sweep.overrides,
               *(GPU if gpu else ()), f"hydra.sweep.dir={out / sweep.folder}", "resume=true"]
    if jobs:
        command.append(f"hydra.launcher.cpu_jobs={jobs}")
    print("+ " + " ".join(command[1:]), flush=True)
    return subprocess.call(command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    names = [p.name for p in PARTS]
    parser.add_argument("--parts", default=",".join(names),
                        help=f"comma-separated, of {', '.join(names)} (default: all)")
    parser.add_argument("--gpu", action="store_true", help="the GPU sizes (scale=gpu trainer=gpu)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="parallel jobs without a GPU (default 1: timings of one job at a time; 0: the launcher's)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default experiments/reproduce/runs, "
                                                                 "runs-gpu with --gpu)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild REPORT.md from the runs so far")
    args = parser.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        print(f"run.py: unknown part {', '.join(unknown)}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    if args.jobs < 0:
        print("run.py: --jobs must be 0 or more (0: the launcher decides)", file=sys.stderr)
        return 2
    out = (args.out or HERE / ("runs-gpu" if args.gpu else "runs")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        parts = [p for p in PARTS if p.name in wanted]
        for number, part in enumerate(parts, 1):
            print(f"\n== part {number}/{len(parts)}: {part.name}: {part.question}", flush=True)
            start = time.monotonic()
            codes = [run_sweep(sweep, out, args.gpu, args.jobs or None) for sweep in part.sweeps]
            state = read_state(out)
            entry = state.setdefault(part.name, {"wall_s": 0.0, "invocations": 0})
            entry["wall_s"] = round(entry["wall_s"] + time.monotonic() - start, 1)
            entry["invocations"] += 1
            entry["complete"] = all(code == 0 for code in codes)
            write_state(out, state)
            print(f"== part {part.name}: {'done' if entry['complete'] else 'INCOMPLETE'} "
                  f"({entry['wall_s'] / 60:.1f} min in all)", flush=True)
            if not entry["complete"]:
                failed.append(part.name)
            if any(code in (130, 143) for code in codes):  # Ctrl-C or SIGTERM: stop here, resumable
                print("run.py: interrupted; run the same command again to continue", file=sys.stderr)
                return codes[-1]
    from report import write_report  # experiments/reproduce/report.py, beside this file

    report = write_report(out, gpu=args.gpu)
    print(f"report: {report}")
    if failed:
        print(f"run.py: part(s) {', '.join(failed)} did not finish every job; the report says which; "
              "run the same command again to continue", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
