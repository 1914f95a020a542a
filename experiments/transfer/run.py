"""Learning-rate transfer across width and depth, measured: does the best lr of a small model stay
the best of a large one under model.parametrization=mup, does it move under standard, and does
Block AttnRes transfer across depth where the standard residual does not?

    python experiments/transfer/run.py                      # both axes, resumable (resume=true)
    python experiments/transfer/run.py --axes width         # one axis
    python experiments/transfer/run.py --report-only        # TRANSFER.md and the figures from the runs so far

Four `attnres-run -m tune=lr` sweeps of experiment=transfer_study (conf/experiment/, the shapes and
budget), each into runs/<axis>_<parametrization>/: widths 32, 64, 128, 256 at 4 layers and depths 4,
8, 16 at width 64, each size x {standard, Block N=4} an arm whose lr the tuned sweep searches on a
5-point log grid (factor 2 around 3e-3, grown at an edge) over tuning seeds 1000 and 1001; under mup
the smallest size is the base (model.base_width=32, model.base_depth=4). Each arm's one verdict run
(seed 0) is not used here. The wall time of each sweep adds up across invocations in
runs/state.json. The report (`report`, below) writes TRANSFER.md beside this file (`--out` moves the
runs, not the report; an axis without runs there keeps its section, and `--report-only` from a folder
with none is refused in one line) and figures/transfer_<axis>.png: loss against lr, a curve per size,
a panel per strategy and parametrization; and, per setting, the optimum at each size and how many grid steps it moved.
base_search.py (beside this file) measures what mup carries from the base besides the lr: the init.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CONF = HERE / "conf"
STUDY = ("experiment=transfer_study", "tune=lr", "residual=standard,block", "seed=0")
AXES = {
    "width": ("model.n_embd", (32, 64, 128, 256), "model.base_width=32"),
    "depth": ("model.n_layer", (4, 8, 16), "model.base_depth=4"),
}
PARAMETRIZATIONS = ("standard", "mup")
STRATEGIES = ("standard", "block")


def sweeps(axes: list[str]) -> list[tuple[str, list[str]]]:
    """(folder, overrides) of each sweep, in order."""
    out = []
    for axis in axes:
        key, sizes, base = AXES[axis]
        for parametrization in PARAMETRIZATIONS:
            extra = ["model.parametrization=mup", base] if parametrization == "mup" else []
            out.append((f"{axis}_{parametrization}", [*STUDY, f"{key}={','.join(map(str, sizes))}", *extra]))
    return out


def _reproduce_run():
    """experiments/reproduce/run.py, whose runs/state.json helpers this study shares."""
    spec = importlib.util.spec_from_file_location("reproduce_run", HERE.parent / "reproduce" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_REPRODUCE = _reproduce_run()
read_state, write_state, call_forwarding = _REPRODUCE.read_state, _REPRODUCE.write_state, _REPRODUCE.call_forwarding
STOPPED = _REPRODUCE.STOPPED  # call_forwarding's status after Ctrl-C or a SIGTERM to this script


def has_runs(folder: Path) -> bool:
    """Whether a sweep's folder holds a tuned search's record (what the report reads)."""
    from attnres.results import tuning

    return bool(tuning.read_state(folder).get("groups"))


def run_sweep(folder: str, overrides: list[str], out: Path, jobs: int | None) -> int:
    command = [sys.executable, "-m", "attnres", "-m", f"hydra.searchpath=[file://{CONF}]", *overrides,
               f"hydra.sweep.dir={out / folder}", "resume=true", "trainer.enable_progress_bar=false"]
    if jobs:
        command.append(f"hydra.launcher.cpu_jobs={jobs}")
    print("+ " + " ".join(command[1:]), flush=True)
    return call_forwarding(command, REPO)


# -- the report --------------------------------------------------------------------------------------
def _size_and_strategy(overrides: list[str], key: str) -> tuple[int | None, str]:
    found = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o)
    size = found.get(key)
    return (int(size) if size is not None else None), found.get("residual", "standard")


def curves(state: dict, key: str) -> dict:
    """{(strategy, size): {"lrs": [...], "means": [...], "points": [(lr, loss), ...], "best": lr or None,
    "best_step": k, "edge": bool}} from a tuned sweep's tuning.json."""
    from attnres.results import tuning

    seeds = state.get("tuning_seeds") or []
    factor = float(((state.get("signature") or {}).get("grid") or {}).get("factor", 2.0))
    found = {}
    for group in state.get("groups", []):
        size, strategy = _size_and_strategy(group.get("overrides", []), key)
        centre = (group.get("centre") or {}).get("optim.optimizer.lr")
        if size is None or not isinstance(centre, (int, float)) or "chosen" not in group:
            continue  # a search stopped before it ended: its optimum is not known yet
        trials = [t for t in group.get("trials", []) if isinstance(t.get("point"), int)]
        means = tuning.point_means(trials, seeds)
        best = tuning.best_point(means)
        steps = sorted(means)
        found[(strategy, size)] = {
            "lrs": [centre * factor ** k for k in steps], "means": [means[k] for k in steps],
            "points": [(centre * factor ** t["point"], tuning.trial_value(t)) for t in trials],
            "best": None if best is None else centre * factor ** best, "best_step": best,
            "edge": tuning.grid_edge(best, steps) is not None,
        }
    return found


def shift_line(by_size: dict[int, dict]) -> str:
    """`0.006 (4x) at 32, ... : moved 2 grid steps` for one setting, sizes ascending."""
    sizes = sorted(s for s in by_size if by_size[s]["best_step"] is not None)
    if not sizes:
        return "no finished search yet"
    steps = [by_size[s]["best_step"] for s in sizes]
    cells = ", ".join(f"{by_size[s]['best']:.3g} at {s}" + (" (edge)" if by_size[s]["edge"] else "") for s in sizes)
    moved = max(steps) - min(steps)
    word = "stays within one grid step" if moved <= 1 else f"moves by {moved} grid steps (a factor of {2 ** moved:g})"
    edge = "; an optimum at the grid's edge is a bound, not a value" if any(by_size[s]["edge"] for s in sizes) else ""
    return f"{cells}: {word}{edge}"


def moved(by_size: dict[int, dict]) -> tuple[int, bool] | None:
    """(grid steps between the sizes' optima, whether one lies on its grid's edge), or None before
    two sizes have an optimum."""
    found = [v for v in by_size.values() if v["best_step"] is not None]
    if len(found) < 2:
        return None
    steps = [v["best_step"] for v in found]
    return max(steps) - min(steps), any(v["edge"] for v in found)


def _steps(m: tuple[int, bool]) -> str:
    return f"{m[0]} grid step{'s' if m[0] != 1 else ''}{' (an optimum on its grid edge)' if m[1] else ''}"


def answers(found: dict[str, dict]) -> list[str]:
    """The study's three questions answered plainly from found[axis][parametrization] = curves():
    does the optimum stay within one grid step under mup, does it shift under standard, and does
    Block AttnRes transfer across depth where the standard residual does not?"""
    lines = []
    for axis, results in found.items():
        by = {(p, strategy): moved({size: v for (s, size), v in results.get(p, {}).items() if s == strategy})
              for p in PARAMETRIZATIONS for strategy in STRATEGIES}
        for strategy in STRATEGIES:
            name = "Block N=4" if strategy == "block" else "the standard residual"
            plain, mup = by["standard", strategy], by["mup", strategy]
            if plain is None or mup is None:
                lines.append(f"- Across {axis}, {name}: not both parametrizations searched at two sizes yet.")
                continue
            if mup[0] <= 1 < plain[0]:
                word = "mup transfers it, the standard parametrization does not"
            elif mup[0] <= 1 and plain[0] <= 1:
                word = "both keep it within one step at these sizes, so this range cannot tell them apart"
            elif mup[0] > 1 and plain[0] <= 1:
                word = "mup moves it more than the standard parametrization does: mup does not transfer it here"
            else:
                word = "neither keeps it within one step: mup does not transfer it here"
            lines.append(f"- Across {axis}, {name}: the optimum moves {_steps(plain)} under the standard "
                         f"parametrization and {_steps(mup)} under mup: {word}.")
        if axis == "depth":
            block, plain = by["standard", "block"], by["standard", "standard"]
            if block is None or plain is None:
                continue
            if block[0] <= 1 < plain[0]:
                word = "yes: Block's optimum stays within one step, the standard residual's does not"
            elif block[0] <= 1 and plain[0] <= 1:
                word = "neither moves by more than one step at these depths, so there is nothing here for it to fix"
            elif block[0] > 1 >= plain[0]:
                word = "no: Block's optimum moves where the standard residual's does not"
            else:
                word = "no: both optima move"
            lines.append(f"- Does Block AttnRes transfer across depth unaided (the standard parametrization), "
                         f"where the standard residual does not? {word} ({_steps(block)} against {_steps(plain)}).")
    return lines


def figure(results: dict, axis: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(STRATEGIES), len(PARAMETRIZATIONS), figsize=(10, 7.5), squeeze=False,
                             sharey=True)
    cmap = plt.get_cmap("viridis")
    for r, strategy in enumerate(STRATEGIES):
        for c, parametrization in enumerate(PARAMETRIZATIONS):
            ax = axes[r][c]
            by_size = {size: v for (s, size), v in results.get(parametrization, {}).items() if s == strategy}
            sizes = sorted(by_size)
            for i, size in enumerate(sizes):
                v, colour = by_size[size], cmap(i / max(1, len(sizes) - 1))
                finite = [(lr, m) for lr, m in zip(v["lrs"], v["means"], strict=True) if math.isfinite(m)]
                if finite:
                    ax.plot(*zip(*finite, strict=True), marker="o", ms=3, color=colour, label=f"{axis} {size}")
                pts = [(lr, y) for lr, y in v["points"] if math.isfinite(y)]
                if pts:
                    ax.scatter(*zip(*pts, strict=True), s=8, color=colour, alpha=0.4)
                if v["best"] is not None:
                    best = v["means"][v["lrs"].index(v["best"])]
                    ax.scatter([v["best"]], [best], marker="*", s=120, color=colour, edgecolor="black", zorder=5)
            ax.set_xscale("log", base=2)
            grid = sorted({lr for v in by_size.values() for lr in v["lrs"]})
            if grid:  # the grid's own values, not powers of 2
                ax.set_xticks(grid, [f"{lr:.2g}" for lr in grid], rotation=45, fontsize=7)
                ax.minorticks_off()
            ax.set_title(f"{'Block N=4' if strategy == 'block' else 'standard residual'}, "
                         f"parametrization={parametrization}", fontsize=9)
            ax.set_xlabel("AdamW learning rate")
            if c == 0:
                ax.set_ylabel("val/loss")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
            elif not sizes:
                ax.text(0.5, 0.5, "not run yet", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"learning-rate transfer across {axis}: lines the mean of 2 tuning seeds, dots each seed, "
                 "the star each size's best", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)


def _sections(text: str) -> dict[str, list[str]]:
    """A report's `## ` sections by their heading line (each with its heading), and its marked
    blocks (base_search.py's) under their start marker."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    marked = False
    for line in text.splitlines():
        if line.startswith("<!-- ") and line.endswith(": start -->"):
            current, marked = out.setdefault(line, []), True
        elif line.startswith("## ") and not marked:
            current = out.setdefault(line, [])
        elif marked and line.startswith("<!-- ") and line.endswith(": end -->"):
            current.append(line)
            current, marked = None, False
            continue
        if current is not None:
            current.append(line)
    return out


def report(out: Path, target: Path = HERE / "TRANSFER.md") -> Path:
    """TRANSFER.md from the runs under `out`. An axis with no runs there keeps its section, figure and
    answers from the TRANSFER.md already written (the runs are not in the repository: a fresh clone's
    `--report-only` must not wipe what was measured), and base_search.py's block is kept as it is."""
    from attnres.results import tuning

    old = _sections(target.read_text()) if target.exists() else {}
    old_answers = old.get("## Answers", [])
    kept: list[str] = []
    figures = target.parent / "figures"
    lines = ["# Learning-rate transfer across width and depth", "",
             "Written by `python experiments/transfer/run.py` (its docstring says what runs; "
             "`--report-only` rewrites this file). Each curve: the mean val/loss of 2 tuning seeds at each lr "
             "of a tuned sweep's log grid (factor 2); the best lr of each size, and how far it moved across "
             "the sizes, in grid steps. Under `mup` the smallest size is the base, where mup and standard "
             "are the same model.", ""]
    found = {}
    for axis, (key, sizes, _) in AXES.items():
        results = {}
        for parametrization in PARAMETRIZATIONS:
            folder = out / f"{axis}_{parametrization}"
            sweep_state = tuning.read_state(folder)
            if sweep_state.get("groups"):
                results[parametrization] = curves(sweep_state, key)
        heading = (f"## Across {axis} ({', '.join(map(str, sizes))}"
                   f"{' layers, width 64' if axis == 'depth' else ' wide, 4 layers'})")
        previous = old.get(heading, [])
        if not results and any(line.startswith("- ") for line in previous):
            kept.append(axis)
            previous = [line for line in previous if not line.startswith("(Kept from the last report")]
            while previous and not previous[-1]:
                previous.pop()
            lines += [*previous,
                      "(Kept from the last report: the output folder holds no runs of this axis.)", ""]
            continue
        lines += [heading, ""]
        if not results:
            lines += [f"Not run yet: `python experiments/transfer/run.py --axes {axis}`.", ""]
            continue
        if not any(v["best_step"] is not None for r in results.values() for v in r.values()):
            lines += [f"Started, no search finished yet: `python experiments/transfer/run.py --axes {axis}` "
                      "continues it.", ""]
            continue
        found[axis] = results
        figure(results, axis, figures / f"transfer_{axis}.png")
        for parametrization in PARAMETRIZATIONS:
            for strategy in STRATEGIES:
                by_size = {size: v for (s, size), v in results.get(parametrization, {}).items() if s == strategy}
                lines.append(f"- {strategy}, parametrization={parametrization}: "
                             f"{shift_line(by_size) if by_size else 'not run yet'}")
        walls = [read_state(out).get(f"{axis}_{p}", {}).get("wall_s") for p in PARAMETRIZATIONS]
        wall = sum(w for w in walls if w)
        lines += ["", f"![loss against lr across {axis}](figures/transfer_{axis}.png)", "",
                  f"Wall time of this axis's sweeps on this machine: {wall / 60:.0f} min.", ""]
    def kept_answers(axis: str) -> list[str]:
        return [line for line in old_answers if axis in kept and (
            line.startswith(f"- Across {axis},") or axis == "depth" and line.startswith("- Does Block"))]

    said = [line for axis in AXES for line in (answers({axis: found[axis]}) if axis in found else kept_answers(axis))]
    if said:
        lines += ["## Answers", "", "A grid step is a factor of 2 in lr. An optimum on its grid's edge, after the "
                  "grid grew by up to 3 points there, is a bound rather than a value, and the move it enters is "
                  "marked.", "", *said, ""]
    lines += ["Where this does not hold: one token budget for every size (not compute-optimal), 400 steps of "
              "8 x 128 bytes, byte-level stdlib, two tuning seeds per point (the noise between them is in the "
              "dots), the lr alone searched (warm-up, weight decay and the pseudo-queries' lr scale fixed), and sizes "
              "far below the paper's.", ""]
    for heading, block in old.items():
        if heading.startswith("<!-- "):
            lines += [*block, ""]
    tmp = target.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--axes", default="width,depth", help="comma-separated, of width, depth (default: both)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="parallel jobs, each with its share of the cores (default 0: the launcher's, "
                             "half the cores this process may use; 1 under `taskset -c 1`)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the runs' folder (default experiments/transfer/runs); TRANSFER.md and figures/ stay "
                             "beside run.py, built from the runs found here (an axis without runs there keeps "
                             "its section)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild TRANSFER.md from the runs so far")
    args = parser.parse_args(argv)
    axes = [a for a in args.axes.split(",") if a]
    unknown = sorted(set(axes) - set(AXES))
    if unknown or not axes:
        print(f"run.py: unknown axis {', '.join(unknown) or '(none)'}; choose from {', '.join(AXES)}",
              file=sys.stderr)
        return 2
    if args.jobs < 0:
        print("run.py: --jobs must be 0 or more (0: the launcher decides)", file=sys.stderr)
        return 2
    out = (args.out or HERE / "runs").resolve()
    if args.report_only and not any(has_runs(out / folder) for folder, _ in sweeps(list(AXES))):
        print(f"run.py: {out} holds no runs of the study's sweeps: nothing to rebuild TRANSFER.md from (it and its "
              "figures are kept as written); pass the output folder of a run.py that ran them (--out)",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    if not args.report_only:
        todo = sweeps(axes)
        for number, (folder, overrides) in enumerate(todo, 1):
            print(f"\n== sweep {number}/{len(todo)}: {folder}", flush=True)
            start = time.monotonic()
            code = run_sweep(folder, overrides, out, args.jobs or None)
            state = read_state(out)
            entry = state.setdefault(folder, {"wall_s": 0.0, "invocations": 0})
            entry["wall_s"] = round(entry["wall_s"] + time.monotonic() - start, 1)
            entry["invocations"] += 1
            entry["complete"] = code == 0
            write_state(out, state)
            if code:
                failed.append(folder)
            if code in STOPPED:  # Ctrl-C or SIGTERM, whatever the sweep exited with: stop here, resumable
                print("run.py: interrupted; run the same command again to continue", file=sys.stderr)
                return code
    print(f"report: {report(out)}")
    if failed:
        print(f"run.py: sweep(s) {', '.join(failed)} did not finish every job; run the same command again to "
              "continue", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
