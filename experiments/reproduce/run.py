"""The reproduction study: which of the Attention Residuals paper's claims does a CPU resolve?

    python experiments/reproduce/run.py                   # every part (about 4.5 hours on 2 free cores), then REPORT.md
    python experiments/reproduce/run.py --parts ordering  # one part (prepare, ordering, blocksize, depth, ..., tasks)
    python experiments/reproduce/run.py --report-only     # rebuild REPORT.md from the runs so far

Part `prepare` tokenizes the stdlib with a 1,024-token BPE into experiments/reproduce/data/stdlib-1k
(once). Every other part is one `attnres-run -m` sweep of experiment=repro_study
(experiments/reproduce/conf/, the shapes and budgets; STUDY_PLAN.md, why), or for part `tasks` of
experiment=synthetic_depth with `eval.tasks=[attnres_pointer]` (tasks_part.py), into
`experiments/reproduce/runs/<part>/` (`--out` moves it). Every sweep runs with `resume=true`: run
the command again after a crash, a kill or Ctrl-C and finished jobs are skipped, unfinished ones
continue from their last checkpoint. The wall time of each part is added up across invocations in
`runs/state.json`; a part with a budget (Part.budget_h: tuned_seeds 3 hours, depth_tuned 4) is
stopped, as by a kill, when that sum reaches it, and not run again without --over-budget. The report
is always experiments/reproduce/REPORT.md and figures/ (beside this file; `--out` moves the runs,
not the report), built by report.py from the runs in the output folder: rebuilt whole when the
folder holds every part's runs; where it holds only some (another machine ran the rest), the
sections of the parts that stand alone (tuned, tasks) are spliced into REPORT.md and the rest is
kept as written, figures included. `--report-only` does the same from the runs already there, and
refuses, in one line and writing nothing, a folder with none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONF = HERE / "conf"


@dataclass(frozen=True)
class Sweep:
    folder: str  # under the output folder
    overrides: tuple[str, ...]
    #: overrides that an earlier sweep of the part decides: (the output folder) -> them; a ValueError
    #: (one line naming the fix) while that sweep has not decided them
    carried: Callable[[Path], tuple[str, ...]] | None = None


@dataclass(frozen=True)
class Part:
    name: str
    question: str
    sweeps: tuple[Sweep, ...]
    #: the part's budget in hours of wall time, added up over its invocations (runs/state.json): a sweep
    #: running when it is spent is stopped as by a kill (resumable), and a spent part is not run again
    #: (--over-budget runs it); None: no budget
    budget_h: float | None = None


REPO = HERE.parent.parent
DATA = HERE / "data" / "stdlib-1k"
SEEDS = "seed=0,1,2,3,4"
STUDY = ("experiment=repro_study",)
#: part tuned's choices (REPORT.md section 7), which part tuned_seeds runs at without searching again
TUNED_CHOICES = "{standard:{optim.optimizer.lr:0.024},block:{optim.optimizer.lr:0.012}}"
#: the paper's smallest Table 2 gain of Block AttnRes over the baseline (1.06% of its loss)
TUNED_MARGIN = "1.06%"


def depth_carried(out: Path) -> tuple[str, ...]:
    """Part depth_tuned's 48-sublayer sweep: each arm at the lr its 24-sublayer search chose."""
    from depth_part import carried_overrides  # experiments/reproduce/depth_part.py, beside this file

    return carried_overrides(out)


PARTS = (
    Part("prepare", "tokenized stdlib, a 1,024-token byte-level BPE", ()),
    Part("ordering", "the loss ordering of standard, Block (N=4, S=4) and Full at the deep shape; magnitudes and "
                     "gradient norms across depth from the same runs",
         (Sweep("ordering", (*STUDY, "shape=deep", "residual=standard,block,full", SEEDS)),)),
    Part("blocksize", "Figure 6's trend at the deep shape: S = 2 (N=8) and 8 (N=2); S = 1 (Full) and 4 (N=4) "
                      "come from part ordering",
         (Sweep("blocksize", (*STUDY, "shape=deep", "residual=block", "num_blocks=8,2", SEEDS)),)),
    Part("depth", "Figure 7's direction at equal non-embedding parameters: Block S=2 minus standard at the "
                  "shallow shape (2 x 80) against the deep one (8 x 40, from parts ordering and blocksize)",
         (Sweep("depth", (*STUDY, "shape=shallow", "residual=standard,block", "num_blocks=2", SEEDS)),)),
    Part("tuned", "Block N=4 against standard at the deep shape, each arm at its own learning rate: a 5-point "
                  "log grid (factor 2 around 3e-3) on tuning seeds 1000 and 1001, grown at an edge, then 5 "
                  "verdict seeds at each arm's best (docs/sweeps.md#tuned-comparisons)",
         (Sweep("tuned", (*STUDY, "shape=deep", "tune=lr", "residual=standard,block", "num_blocks=4", SEEDS)),)),
    Part("tuned_seeds", "part tuned's comparison extended by seeds on demand: Block N=4 and standard at the lrs "
                        "its search chose (block 0.012, standard 0.024; hydra.sweeper.method=given), 5 seeds, then "
                        "3 a look while the verdict at a margin of 1.06% is not resolved, at most 17 "
                        "(docs/sweeps.md#seeds-on-demand), within a budget of 3 hours",
         (Sweep("tuned_seeds", (*STUDY, "shape=deep", "tune=lr", "residual=standard,block", "num_blocks=4",
                                "hydra.sweeper.method=given", f"hydra.sweeper.given={TUNED_CHOICES}",
                                "seeds.on_demand=true", "seeds.start=5", "seeds.batch=3", "seeds.max=17",
                                f"verdict.margin={TUNED_MARGIN}")),), budget_h=3.0),
    Part("ladder", "the compute multiplier of Block N=8 over standard on a four-rung ladder (8 layers, width "
                   "16, 24, 32 at 3 seeds, and 40 from parts ordering and blocksize; 25 tokens per parameter)",
         (Sweep("ladder", (*STUDY, "shape=w16,w24,w32", "residual=standard,block", "num_blocks=8",
                           "seed=0,1,2")),)),
    Part("tasks", "Block N=4 against standard on a downstream task through lm-eval: two-hop pointer chasing "
                  "(attnres_pointer, multiple choice, chance 0.25) after experiment=synthetic_depth's 3,000 "
                  "steps, 5 seeds (docs/tasks.md)",
         (Sweep("tasks", ("experiment=synthetic_depth", "residual=standard,block", SEEDS,
                          "eval.tasks=[attnres_pointer]")),)),
    Part("depth_tuned", "where and why (issue 51): standard, Block N=8 and two controls (depth_scaled, block_static) "
                        "at 8, 24 and 48 sublayers of width 40, each arm at its own lr: searched at 8 and 24, "
                        "carried from 24 to 48 (experiment=depth_study; depth_part.py); about 4 hours",
         (Sweep("depth_tuned", ("experiment=depth_study", "depth=L8,L24")),
          Sweep("depth_tuned_L48", ("experiment=depth_study", "depth=L48", "hydra.sweeper.method=given"),
                carried=depth_carried)), budget_h=4.0),
)
STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # what call_forwarding returns after Ctrl-C or a kill
BUDGET_SPENT = 124  # what call_forwarding returns when it stopped the sweep at its deadline (as timeout(1) does)
#: the parts that read the tokenized stdlib
NEEDS_DATA = ("ordering", "blocksize", "depth", "tuned", "tuned_seeds", "ladder")


def prepare() -> int:
    """Tokenize the stdlib once (the folder is written atomically, meta.json last)."""
    if (DATA / "meta.json").is_file():
        print(f"prepare: {DATA} is there", flush=True)
        return 0
    command = ["attnres-prepare", "stdlib", str(DATA), "--vocab-size", "1024"]
    print("+ " + " ".join(command), flush=True)
    return call_forwarding(command, REPO)


def read_state(out: Path) -> dict:
    try:
        return json.loads((out / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def write_state(out: Path, state: dict) -> None:
    tmp = out / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / "state.json")


def call_forwarding(command: list[str], cwd: Path, deadline: float | None = None) -> int:
    """Run a sweep and wait for it, passing Ctrl-C and SIGTERM on to it exactly once each: the sweep
    runs in a session of its own, so a terminal's Ctrl-C reaches it through this script alone, and a
    `kill` of this script stops the sweep (its jobs save) instead of leaving it running unseen.
    Returns the sweep's exit status, or 128 + the signal's number (130, 143: STOPPED) when one came:
    a sweep may end 1 (or even 0) after its own SIGTERM, and the caller must stop all the same
    instead of starting the next sweep. At `deadline` (time.monotonic()) the sweep gets one SIGTERM,
    as from a kill, and this returns BUDGET_SPENT once it has saved and ended."""
    proc = subprocess.Popen(command, cwd=cwd, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    timed_out = False
    try:
        try:
            code = proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return BUDGET_SPENT if timed_out else code


def run_sweep(sweep: Sweep, out: Path, jobs: int | None, deadline: float | None = None) -> int:
    try:
        carried = sweep.carried(out) if sweep.carried else ()
    except ValueError as err:
        print(f"run.py: {sweep.folder} not started: {err}", file=sys.stderr, flush=True)
        return 1
    command = [sys.executable, "-m", "attnres", "-m", f"hydra.searchpath=[file://{CONF}]", *sweep.overrides,
               *carried, f"hydra.sweep.dir={out / sweep.folder}", "resume=true", "trainer.enable_progress_bar=false"]
    if jobs:
        command.append(f"hydra.launcher.cpu_jobs={jobs}")
    print("+ " + " ".join(command[1:]), flush=True)
    return call_forwarding(command, REPO, deadline)


def report_only(out: Path, wanted: list[str]) -> int:
    """--report-only: REPORT.md from the runs already in `out` (report.rebuild), or one line, exit 2."""
    from report import NoRunsError, rebuild  # experiments/reproduce/report.py, beside this file

    try:
        report, kept = rebuild(out, [p for p in wanted if p != "prepare"])
    except NoRunsError as err:
        print(f"run.py: {err}", file=sys.stderr)
        return 2
    print(f"report: {report}" + (f" ({kept})" if kept else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    names = [p.name for p in PARTS]
    parser.add_argument("--parts", default=",".join(names),
                        help=f"comma-separated, of {', '.join(names)} (default: all)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="parallel jobs, each with its share of the cores (default 2; 0: the launcher's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the runs' folder (default experiments/reproduce/runs); REPORT.md and figures/ stay "
                             "beside run.py, built from the runs found here")
    parser.add_argument("--over-budget", action="store_true",
                        help="run parts whose budget (hours of wall time, runs/state.json) is spent, and past it")
    parser.add_argument("--report-only", action="store_true",
                        help="only update REPORT.md from the runs in --out (refused when it holds none of --parts')")
    args = parser.parse_args(argv)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        print(f"run.py: unknown part {', '.join(unknown)}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    if args.jobs < 0:
        print("run.py: --jobs must be 0 or more (0: the launcher decides)", file=sys.stderr)
        return 2
    out = (args.out or HERE / "runs").resolve()
    if args.report_only:
        return report_only(out, wanted)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    state = read_state(out)
    spent = {p.name for p in PARTS if p.budget_h is not None and not args.over_budget
             and state.get(p.name, {}).get("wall_s", 0.0) >= p.budget_h * 3600}
    if ("prepare" not in wanted and not (DATA / "meta.json").is_file()
            and any(p in NEEDS_DATA and p not in spent for p in wanted)):
        wanted.insert(0, "prepare")  # the sweeps read the tokenized data
    parts = [p for p in PARTS if p.name in wanted]
    for number, part in enumerate(parts, 1):
        print(f"\n== part {number}/{len(parts)}: {part.name}: {part.question}", flush=True)
        wall = state.get(part.name, {}).get("wall_s", 0.0)  # no other part's run changes this part's entry
        if part.name in spent:
            print(f"== part {part.name}: its budget of {part.budget_h:g} h is spent ({wall / 3600:.2f} h in all): "
                  "not run again (--over-budget runs it)", flush=True)
            continue
        left = None if part.budget_h is None or args.over_budget else part.budget_h * 3600 - wall
        start = time.monotonic()
        deadline = None if left is None else start + left
        codes = [prepare()] if part.name == "prepare" else []
        for sweep in part.sweeps:
            codes.append(run_sweep(sweep, out, args.jobs or None, deadline))
            if codes[-1] in (*STOPPED, BUDGET_SPENT):
                break
        if codes and codes[-1] == BUDGET_SPENT:
            print(f"run.py: part {part.name} reached its budget of {part.budget_h:g} h and was stopped; its section "
                  "says where (--over-budget continues it)", file=sys.stderr, flush=True)
        state = read_state(out)
        entry = state.setdefault(part.name, {"wall_s": 0.0, "invocations": 0})
        entry["wall_s"] = round(entry["wall_s"] + time.monotonic() - start, 1)
        entry["invocations"] += 1
        entry["complete"] = all(code == 0 for code in codes)
        if codes and codes[-1] == BUDGET_SPENT:
            entry["budget_spent"] = True
        write_state(out, state)
        print(f"== part {part.name}: {'done' if entry['complete'] else 'INCOMPLETE'} "
              f"({entry['wall_s'] / 60:.1f} min in all)", flush=True)
        if not entry["complete"] and not entry.get("budget_spent"):
            failed.append(part.name)
        if codes[-1] in STOPPED:  # Ctrl-C or SIGTERM: stop here, resumable
            print("run.py: interrupted; run the same command again to continue", file=sys.stderr)
            return codes[-1]
    from report import update_report  # experiments/reproduce/report.py, beside this file

    report, kept = update_report(out, [p.name for p in PARTS if p.name in wanted])
    print(f"report: {report}" + (f" ({kept})" if kept else ""))
    if failed:
        print(f"run.py: part(s) {', '.join(failed)} did not finish every job; the report says which; "
              "run the same command again to continue", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
