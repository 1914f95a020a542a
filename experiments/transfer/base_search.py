"""What mup carries from the base besides the lr: does tuning `model.init_std` at the base close the
gap between a wide mup model and the standard parametrization tuned at full width?

The width axis of run.py found that mup transfers the best lr from width 32 to 256 while standard
does not, yet the mup runs at width 256 end well above standard at its own best lr. Under mup the
hidden matrices' init std is init_std x sqrt(base_width / width), so a wide model keeps the base's
init *constant*, while standard's fixed 0.02 (GPT-2's, chosen at width 768) grows against
1 / sqrt(width) as the width grows. The muP authors tune the init at the base along with the lr
(Tensor Programs V, 2022); the study tuned the lr alone. This measures what that costs:

    python experiments/transfer/base_search.py                # resumable (resume=true), about 45 min on 2 cores
    python experiments/transfer/base_search.py --report-only  # its section of TRANSFER.md from the runs so far

1. **Base search** (runs/base_search/base): at the base (width 32, where mup and standard are the
   same model), a grid of lr x init_std over tuning seeds 1000 and 1001, for standard and Block N=4.
   The best mean val/loss picks each strategy's pair.
2. **Target** (runs/base_search/target_*): at width 256, on seeds 0, 1, 2 (which no search saw),
   three arms per strategy: standard at its best lr at 256 (run.py's width axis, which searched it
   there on the tuning seeds), mup at the lr the width axis found at the base (init_std 0.02), and
   mup at the base search's pair.

The section it writes sits between two markers in TRANSFER.md; run.py's report keeps it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STRATEGIES = ("standard", "block")
BASE_WIDTH, TARGET_WIDTH = 32, 256
LRS = (0.006, 0.012, 0.024, 0.048)
INIT_STDS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
TUNING_SEEDS, SEEDS = (1000, 1001), (0, 1, 2)
# From TRANSFER.md's width axis (2 tuning seeds a point): both strategies' best lr at width 256 under
# standard, and at the base (width 32) under mup.
STANDARD_BEST_AT_TARGET, MUP_BEST_AT_BASE = 0.0015, 0.024
START, END = "<!-- base_search.py: start -->", "<!-- base_search.py: end -->"
MUP = ("model.parametrization=mup", f"model.base_width={BASE_WIDTH}")


def _run_module():
    spec = importlib.util.spec_from_file_location("transfer_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _list(values) -> str:
    return ",".join(map(str, values))


def base_sweep() -> tuple[str, list[str]]:
    return "base", ["experiment=transfer_study", f"model.n_embd={BASE_WIDTH}", *MUP,
                    f"residual={_list(STRATEGIES)}", f"seed={_list(TUNING_SEEDS)}",
                    f"optim.optimizer.lr={_list(LRS)}", f"model.init_std={_list(INIT_STDS)}"]


def target_sweeps(chosen: dict[str, tuple[float, float]]) -> list[tuple[str, list[str]]]:
    """The target's sweeps: the two fixed arms for both strategies at once, then the base search's
    pair, one sweep per distinct pair."""
    common = ["experiment=transfer_study", f"model.n_embd={TARGET_WIDTH}", f"seed={_list(SEEDS)}"]
    out = [("target_standard", [*common, f"residual={_list(STRATEGIES)}",
                                f"optim.optimizer.lr={STANDARD_BEST_AT_TARGET}"]),
           ("target_mup", [*common, *MUP, f"residual={_list(STRATEGIES)}", f"optim.optimizer.lr={MUP_BEST_AT_BASE}"])]
    pairs: dict[tuple[float, float], list[str]] = {}
    for strategy in STRATEGIES:
        if strategy in chosen:
            pairs.setdefault(chosen[strategy], []).append(strategy)
    for (lr, init), strategies in pairs.items():
        out.append((f"target_mup_lr{lr:g}_init{init:g}", [*common, *MUP, f"residual={_list(strategies)}",
                                                          f"optim.optimizer.lr={lr}", f"model.init_std={init}"]))
    return out


def read_runs(folder: Path) -> list[dict]:
    """Each finished run under `folder`: its strategy, seed, width, parametrization, lr, init_std and
    val/loss (non-finite kept: a diverged run is a result)."""
    runs = []
    for path in sorted(folder.glob("**/metrics.json")):
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if m.get("status") != "finished":
            continue
        o = dict(x.lstrip("+").split("=", 1) for x in m.get("overrides", []) if "=" in x)
        loss = (m.get("metrics") or {}).get("val/loss")
        runs.append({"strategy": m.get("residual", o.get("residual", "standard")), "seed": int(o.get("seed", -1)),
                     "width": int(o.get("model.n_embd", 0)),
                     "parametrization": o.get("model.parametrization", "standard"),
                     "lr": float(o.get("optim.optimizer.lr", "nan")),
                     "init_std": float(o.get("model.init_std", 0.02)),
                     "loss": float(loss) if loss is not None else math.nan})
    return runs


def choose(runs: list[dict]) -> dict[str, tuple[float, float]]:
    """Each strategy's (lr, init_std) of lowest mean val/loss over the tuning seeds, among pairs
    every tuning seed finished (a diverged seed makes its pair's mean infinite, not missing)."""
    chosen = {}
    for strategy in STRATEGIES:
        cells: dict[tuple[float, float], dict[int, float]] = {}
        for r in runs:
            if r["strategy"] == strategy and r["width"] == BASE_WIDTH and r["seed"] in TUNING_SEEDS:
                cells.setdefault((r["lr"], r["init_std"]), {})[r["seed"]] = r["loss"]
        means = {pair: (statistics.fmean(v.values()) if all(map(math.isfinite, v.values())) else math.inf)
                 for pair, v in cells.items() if set(v) == set(TUNING_SEEDS)}
        if len(means) == len(LRS) * len(INIT_STDS):
            chosen[strategy] = min(sorted(means), key=lambda pair: means[pair])
    return chosen


def base_table(runs: list[dict], strategy: str) -> list[str]:
    cells: dict[tuple[float, float], list[float]] = {}
    for r in runs:
        if r["strategy"] == strategy and r["width"] == BASE_WIDTH and r["seed"] in TUNING_SEEDS:
            cells.setdefault((r["lr"], r["init_std"]), []).append(r["loss"])
    lines = ["| init_std \\ lr | " + " | ".join(f"{lr:g}" for lr in LRS) + " |", "|---" * (len(LRS) + 1) + "|"]
    for init in INIT_STDS:
        row = [f"{statistics.fmean(cells[(lr, init)]):.3f}" if len(cells.get((lr, init), [])) == len(TUNING_SEEDS)
               else "-" for lr in LRS]
        lines.append(f"| {init:g} | " + " | ".join(row) + " |")
    return lines


def _interval(diffs: list[float]) -> tuple[float, float] | None:
    if len(diffs) < 2:
        return None
    from scipy import stats

    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = stats.t.ppf(0.975, len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return mean - half, mean + half


def arms(runs: list[dict], chosen: dict[str, tuple[float, float]], strategy: str) -> dict[str, dict[int, float]]:
    """{arm name: {seed: val/loss}} at the target width."""
    out: dict[str, dict[int, float]] = {}
    for r in runs:
        if r["strategy"] != strategy or r["width"] != TARGET_WIDTH or r["seed"] not in SEEDS:
            continue
        if r["parametrization"] == "standard" and r["lr"] == STANDARD_BEST_AT_TARGET and r["init_std"] == 0.02:
            name = "standard"
        elif r["parametrization"] == "mup" and r["lr"] == MUP_BEST_AT_BASE and r["init_std"] == 0.02:
            name = "mup"
        elif r["parametrization"] == "mup" and chosen.get(strategy) == (r["lr"], r["init_std"]):
            name = "mup_base_tuned"
        else:
            continue
        out.setdefault(name, {})[r["seed"]] = r["loss"]
    return out


def section(runs: list[dict]) -> str:
    chosen = choose(runs)
    lines = [START, "## What mup carries from the base: the init", "",
             "Written by `python experiments/transfer/base_search.py` (its docstring says what runs). Under mup a "
             "wide model keeps the base's init constant (hidden init std = init_std x sqrt(base_width / width)), "
             "while standard's fixed `init_std=0.02` grows against 1/sqrt(width); the width axis above tuned the lr "
             "alone. Here the base (width 32) searches lr x init_std on tuning seeds 1000 and 1001, and width 256 "
             "runs each arm on seeds 0, 1 and 2, which no search saw.", ""]
    names = {"standard": f"standard at its best lr at width 256 ({STANDARD_BEST_AT_TARGET:g}, searched there)",
             "mup": f"mup at the base's best lr ({MUP_BEST_AT_BASE:g}), init_std 0.02",
             "mup_base_tuned": "mup at the base search's lr and init_std"}
    for strategy in STRATEGIES:
        label = "Block N=4" if strategy == "block" else "Standard residual"
        lines += [f"**{label}**, mean val/loss at the base over the tuning seeds:", "", *base_table(runs, strategy), ""]
        if strategy not in chosen:
            lines += ["The base search has not finished.", ""]
            continue
        lr, init = chosen[strategy]
        edges = [f"{key} on its grid's edge" for key, value, grid in (("lr", lr, LRS), ("init_std", init, INIT_STDS))
                 if value in (grid[0], grid[-1])]
        edge = f" ({' and '.join(edges)}: a bound, not an optimum)" if edges else ""
        lines += [f"Chosen at the base: lr {lr:g}, init_std {init:g}{edge}.", "", "At width 256:", ""]
        found = arms(runs, chosen, strategy)
        for name in ("standard", "mup", "mup_base_tuned"):
            losses = [found.get(name, {}).get(s) for s in SEEDS]
            done = [x for x in losses if x is not None]
            spread = f" +- {statistics.stdev(done):.3f}" if len(done) > 1 and all(map(math.isfinite, done)) else ""
            value = f"{statistics.fmean(done):.3f}{spread} over {len(done)} seed(s)" if done else "not run yet"
            lines.append(f"- {names[name]}: {value}")
        for name in ("mup", "mup_base_tuned"):
            pairs = [(found[name][s], found["standard"][s]) for s in SEEDS
                     if s in found.get(name, {}) and s in found.get("standard", {})]
            diffs = [a - b for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
            ci = _interval(diffs)
            if ci is not None:
                short = "mup (init_std 0.02)" if name == "mup" else "mup (base-tuned)"
                lines.append(f"- {short} minus standard: {statistics.fmean(diffs):+.3f} nats "
                             f"[{ci[0]:+.3f}, {ci[1]:+.3f}], 95% t interval paired over {len(diffs)} seeds")
        lines.append("")
    lines += ["Where this does not hold: one base width (32) and one target (256), 400 steps of 8 x 128 bytes, "
              "three seeds at the target; standard's init_std was not searched at width 256 (its lr alone was), so "
              "the base-tuned mup arm had one knob more searched than standard; and the other base hyperparameters "
              "(the readout multiplier, the attention scale, warm-up) were left at their defaults.", END]
    return "\n".join(lines)


def splice(text: str, block: str) -> str:
    """`text` with the marked section replaced by `block` (appended when it has none)."""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        return head + block + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write(out: Path, target: Path = HERE / "TRANSFER.md") -> Path:
    runs = read_runs(out / "base_search")
    text = target.read_text() if target.exists() else ""
    tmp = target.with_suffix(".md.tmp")
    tmp.write_text(splice(text, section(runs)))
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--jobs", type=int, default=0, help="parallel jobs (default 0: the launcher's)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default experiments/transfer/runs)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite this study's section of TRANSFER.md")
    args = parser.parse_args(argv)
    if args.jobs < 0:
        print("base_search.py: --jobs must be 0 or more (0: the launcher decides)", file=sys.stderr)
        return 2
    out = (args.out or HERE / "runs").resolve()
    (out / "base_search").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run = _run_module()
        todo = [base_sweep()]
        done = 0
        while done < len(todo):
            folder, overrides = todo[done]
            print(f"\n== {folder}", flush=True)
            start = time.monotonic()
            code = run.run_sweep(f"base_search/{folder}", overrides, out, args.jobs or None)
            state = run.read_state(out)
            entry = state.setdefault(f"base_search/{folder}", {"wall_s": 0.0, "invocations": 0})
            entry["wall_s"] = round(entry["wall_s"] + time.monotonic() - start, 1)
            entry["invocations"] += 1
            run.write_state(out, state)
            if code:
                print(f"base_search.py: sweep {folder} stopped (exit {code}); run the same command again to continue",
                      file=sys.stderr)
                write(out)
                return code
            if folder == "base":
                chosen = choose(read_runs(out / "base_search"))
                said = ", ".join(f"{s} lr {lr:g} init_std {i:g}" for s, (lr, i) in chosen.items())
                print(f"chosen at the base: {said}", flush=True)
                todo += target_sweeps(chosen)
            done += 1
    print(f"report: {write(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
