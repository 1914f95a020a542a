"""Part `depth_tuned` of the CPU study (experiments/reproduce/run.py --parts depth_tuned; issue 51):
does a tuned Block AttnRes gain grow with depth, and is it the routing or the bounded scale?

The runs are two sweeps of `attnres-run -m experiment=depth_study` (conf/experiment/depth_study.yaml:
standard, Block N=8, and the controls depth_scaled and block_static, width 40): at 8 and 24 sublayers
each arm and depth searches its own lr grid, then runs the verdict seeds at its choice (folder
`depth_tuned`); at 48 sublayers each arm runs the verdict seeds at the lr it chose at 24, without a
search (`hydra.sweeper.method=given`, folder `depth_tuned_L48`; `carried_overrides`): the 48-sublayer
grids alone would have cost about two of the part's four hours (section text: why, and what it
risks). This module turns the sweep folders into the report's section: per depth, each arm minus
the standard residual, both at their own best lr, as a share of the standard's val/loss, paired
by seed, with a 95% interval held jointly over the arms of a depth (Bonferroni), the margin verdict
of docs/sweeps.md#verdicts (0.5% of the baseline) and the seeds used; a figure of the gap against
depth, one line per arm; and the plain answers. `section(out, figs)` is all report.py needs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import records
from scipy import stats

from attnres.atomic import read_json
from attnres.results import sequential, tuning
from attnres.results.verdict import few_seeds, margin_verdict

FOLDER = "depth_tuned"
CARRIED = "depth_tuned_L48"  # the deepest depth's sweep: each arm at the lr it chose one depth shallower
CARRY = ("L24", "L48")  # (the depth whose choices are carried, the depth that runs at them)
TITLE = "9. Where and why: the tuned gain against depth, and its controls"
BASELINE = "standard"
#: the arms in the order the section lists them, with what each one keeps of Block AttnRes
ARMS = {"block": "Block AttnRes, N = 8 (input-dependent routing, bounded scale)",
        "block_static": "learned static mix (routing that ignores the input)",
        "depth_scaled": "standard residual, CompleteP's depth-scaled branches (bounded growth, no mix)",
        "block_uniform": "Block's sources, uniform weights (the standard residual up to eps)"}
MARGIN_PCT = 0.5  # the smallest difference that matters: 0.5% of the baseline's val/loss (verdict.margin)
RUN = "python experiments/reproduce/run.py --parts depth_tuned"
BUDGET_H = 4.0  # run.py's budget for the part (issue 51: at most 4 hours of this 2-core machine)


@dataclass
class Gap:
    """One arm minus the standard residual at one depth, in percent of the standard's val/loss."""

    arm: str
    sublayers: int
    per_seed: dict[int, float]
    arms: int = 1  # the arms that share this depth's standard: each interval at 1 - 0.05 / arms (Bonferroni)
    design: Mapping[str, Any] | None = None  # seeds on demand (<sweep>/seeds.json): its design, looks and final

    @property
    def level(self) -> float:
        return 1 - 0.05 / self.arms

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed.values())

    @property
    def ci(self) -> tuple[float, float] | None:
        """The paired t interval; with seeds on demand, the design's repeated interval at the look the
        sweep reached (valid whichever look it stopped at: attnres.results.sequential), at alpha / arms."""
        n = len(self.per_seed)
        if n < 2:
            return None
        if self.design and self.design.get("design"):
            plan = self.design["design"]
            return sequential.repeated_interval(self.per_seed, self.design.get("looks", []), int(plan["max"]),
                                                float(plan["alpha"]) / self.arms, bool(self.design.get("final")))
        half = stats.t.ppf(1 - (1 - self.level) / 2, n - 1) * statistics.stdev(self.per_seed.values()) / math.sqrt(n)
        return self.mean - half, self.mean + half

    def verdict(self) -> str:
        n = len(self.per_seed)
        if n == 0:
            return "no pairs yet"
        if n <= 2:
            return few_seeds(n)
        low, high = self.ci
        return margin_verdict(low, high, MARGIN_PCT, lower_is_better=True)

    def text(self) -> str:
        if not self.per_seed:
            return "no pairs yet"
        ci = self.ci
        return f"{self.mean:+.2f}%" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else " (one seed, no interval)")


def _override(overrides: Sequence[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")), None)


def read_arms(sweep: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """(residual, sublayers) -> {"lr", "edge", "runs": {seed: metrics.json}, "design": its seeds.json,
    "sweep": the folder's name} of a tuned depth sweep."""
    state = tuning.read_state(sweep)
    design = sequential.read_record(sweep)
    groups = {g["label"]: g for g in state.get("groups", [])}
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for arm in state.get("arms", []):
        residual, depth = _override(arm["overrides"], "residual"), _override(arm["overrides"], "depth")
        if residual is None or depth is None:
            continue
        group = groups.get(arm.get("group", arm["label"]), {})
        runs = {}
        for seed, job in arm.get("jobs", {}).items():
            metrics = read_json(sweep / job / "metrics.json")
            if metrics.get("status") == "finished" and isinstance(metrics.get("metrics", {}).get("val/loss"), float):
                runs[int(seed)] = metrics
        found[residual, _sublayers(depth)] = {
            "lr": (group.get("chosen_values") or {}).get("optim.optimizer.lr"), "edge": group.get("edge"),
            "runs": runs, "seeds": len(arm.get("jobs", {})), "design": design, "sweep": sweep.name}
    return found


def read_all(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """read_arms of both sweeps of the part (the deepest depth's carried sweep second)."""
    return {**read_arms(out / FOLDER), **read_arms(out / CARRIED)}


def given_override(lrs: Mapping[str, float]) -> str:
    """`hydra.sweeper.given=...` setting each arm (by residual) at its lr."""
    arms = ",".join(f"{arm}:{{optim.optimizer.lr:{lr:g}}}" for arm, lr in lrs.items())
    return f"hydra.sweeper.given={{{arms}}}"


def carried_overrides(out: Path) -> tuple[str, ...]:
    """The carried sweep's `given`: each arm's lr as the search of `out / FOLDER` chose it at CARRY[0].
    ValueError (one line naming the fix) while that search has not chosen every arm's."""
    arms = read_arms(out / FOLDER)
    source = _sublayers(CARRY[0])
    lrs = {arm: found["lr"] for (arm, depth), found in arms.items() if depth == source}
    missing = sorted(arm for arm, lr in lrs.items() if not isinstance(lr, (int, float)))
    if not lrs or missing:
        raise ValueError(f"{CARRIED} runs each arm at the lr it chose at {CARRY[0]}, and {out / FOLDER} has not "
                         f"chosen {'those of ' + ', '.join(missing) if missing else 'any'} yet: run the part "
                         "again to finish its search first")
    return (given_override(lrs),)


def _sublayers(depth: Any) -> int:
    return int(str(depth).lstrip("L"))


def record_rows(sweep: Path) -> list[dict[str, Any]]:
    """Every run of the sweep as results/depth_tuned.json keeps it: each search trial (its lr, tuning
    seed and val/loss) and each verdict run (its arm's chosen lr, seed, val/loss, tokens and rate)."""
    state = tuning.read_state(sweep)
    groups = {g["label"]: g for g in state.get("groups", [])}
    rows: list[dict[str, Any]] = []
    for group in groups.values():
        overrides = group.get("overrides", [])
        residual, depth = _override(overrides, "residual"), _override(overrides, "depth")
        for trial in group.get("trials", []):
            rows.append({"stage": "search", "sweep": sweep.name, "residual": residual, "depth": depth,
                         "seed": trial.get("seed"),
                         "lr": (trial.get("values") or {}).get("optim.optimizer.lr"), "status": trial.get("status"),
                         "val/loss": trial.get("value"), "job": trial.get("job"),
                         **_load(read_json(sweep / trial["job"] / "metrics.json") if trial.get("job") else {})})
    for arm in state.get("arms", []):
        residual, depth = _override(arm["overrides"], "residual"), _override(arm["overrides"], "depth")
        group = groups.get(arm.get("group", arm["label"]), {})
        for seed, job in arm.get("jobs", {}).items():
            found = read_json(sweep / job / "metrics.json")
            rows.append({"stage": "verdict", "sweep": sweep.name, "residual": residual, "depth": depth,
                         "seed": int(seed),
                         "lr": (group.get("chosen_values") or {}).get("optim.optimizer.lr"), "edge": group.get("edge"),
                         "status": found.get("status", "unfinished"),
                         "val/loss": (found.get("metrics") or {}).get("val/loss"),
                         "tokens_seen": found.get("tokens_seen"),
                         "non_embedding_parameters": found.get("non_embedding_parameters"),
                         "tokens_per_sec_after_warmup": found.get("tokens_per_sec_after_warmup"), "job": job,
                         **_load(found)})
    return rows


def _load(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's metrics.json says of the machine it shared: its wall seconds, the mean 1-minute
    load while it trained, and the cores (attnres/training/machine_load.py); {} for a run without them."""
    load = metrics.get("machine_load") or {}
    if not all(isinstance(v, (int, float)) for v in (metrics.get("wall_time_s"), load.get("mean_1min"),
                                                      load.get("cpu_count"))):
        return {}
    return {"wall_time_s": metrics["wall_time_s"], "load_1min": load["mean_1min"], "cpu_count": load["cpu_count"]}


def machine_share(rows: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """How much of the machine the part's runs had: each run trains on one thread, and at a mean
    1-minute load l on c cores it had about min(1, c / l) of its core. Returns the runs, their
    run-hours, those that ran beside other work (l above 1.5 c: more than the part's own jobs and
    its sweep) with their run-hours, and `share`, the run-hours weighted by that share over all."""
    timed = [r for r in rows if all(isinstance(r.get(k), (int, float)) and r[k] > 0
                                    for k in ("wall_time_s", "load_1min", "cpu_count"))]
    if not timed:
        return None
    total = sum(r["wall_time_s"] for r in timed)
    shared = [r for r in timed if r["load_1min"] > 1.5 * r["cpu_count"]]
    return {"runs": len(timed), "hours": total / 3600, "shared_runs": len(shared),
            "shared_hours": sum(r["wall_time_s"] for r in shared) / 3600,
            "share": sum(r["wall_time_s"] * min(1.0, r["cpu_count"] / r["load_1min"]) for r in timed) / total}


def arms_from_record(rows: Sequence[Mapping[str, Any]],
                     designs: Mapping[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """read_all's answer rebuilt from results/depth_tuned.json's verdict rows and its sweeps' seeds.json
    (`designs`, by sweep folder), with no runs on this machine."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        if row.get("stage") != "verdict" or row.get("residual") is None or row.get("depth") is None:
            continue
        sweep = row.get("sweep", FOLDER)
        arm = found.setdefault((row["residual"], _sublayers(row["depth"])),
                               {"lr": row.get("lr"), "edge": row.get("edge"), "runs": {}, "seeds": 0,
                                "design": designs.get(sweep) or {}, "sweep": sweep})
        arm["seeds"] += 1
        loss = row.get("val/loss")
        if row.get("status") == "finished" and isinstance(loss, float) and math.isfinite(loss):
            arm["runs"][int(row["seed"])] = {"status": "finished", "metrics": {"val/loss": loss},
                                             "tokens_seen": row.get("tokens_seen"),
                                             "non_embedding_parameters": row.get("non_embedding_parameters")}
    return found


def gaps(arms: Mapping[tuple[str, int], Mapping[str, Any]]) -> dict[tuple[str, int], Gap]:
    """Each non-standard arm against the standard at the same depth, paired by seed; the intervals of
    one depth hold together (1 - 0.05 / K for its K arms), each under its sweep's seeds.json."""
    out = {}
    for depth in sorted({d for _, d in arms}):
        base = arms.get((BASELINE, depth), {}).get("runs", {})
        others = [a for a, d in arms if d == depth and a != BASELINE]
        for arm in others:
            mine = arms[arm, depth]["runs"]
            seeds = sorted(set(mine) & set(base))
            loss = {s: (mine[s]["metrics"]["val/loss"], base[s]["metrics"]["val/loss"]) for s in seeds}
            out[arm, depth] = Gap(arm, depth, {s: 100 * (a - b) / b for s, (a, b) in loss.items()},
                                  max(1, len(others)), arms[arm, depth].get("design") or None)
    return out


def growth(shallow: Gap, deep: Gap) -> str:
    """Whether the gap (lower: the arm better) grows from the shallowest depth to the deepest:
    Welch's 95% interval on the difference of the two depths' per-seed gaps."""
    a, b = list(deep.per_seed.values()), list(shallow.per_seed.values())
    if len(a) < 2 or len(b) < 2:
        return "not resolved (fewer than 2 seeds at a depth)"
    low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    span = f"{statistics.fmean(a) - statistics.fmean(b):+.2f} points [{low:+.2f}, {high:+.2f}]"
    if high < 0:
        return (f"yes: the gap moves by {span} from {shallow.sublayers} to {deep.sublayers} sublayers, "
                "in the arm's favour")
    if low > 0:
        return f"no, it shrinks: {span} at {deep.sublayers} sublayers against {shallow.sublayers}"
    return f"not resolved: {span} from {shallow.sublayers} to {deep.sublayers} sublayers"


def figure(found: Mapping[tuple[str, int], Gap]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.axhspan(-MARGIN_PCT, MARGIN_PCT, color="0.9", label=f"margin ±{MARGIN_PCT}%")
    ax.axhline(0, color="0.4", lw=0.8)
    for arm in [a for a in ARMS if any(k[0] == a for k in found)]:
        points = sorted((d, g) for (a, d), g in found.items() if a == arm and g.per_seed)
        if not points:
            continue
        xs, means = [d for d, _ in points], [g.mean for _, g in points]
        lows = [g.mean - g.ci[0] if g.ci else 0.0 for _, g in points]
        highs = [g.ci[1] - g.mean if g.ci else 0.0 for _, g in points]
        shift = 2 ** (0.06 * (list(ARMS).index(arm) - 1))  # side by side at each depth (log x), not on top
        ax.errorbar([x * shift for x in xs], means, yerr=[lows, highs], marker="o", capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    depths = sorted({d for _, d in found})
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("sublayers L (width 40)")
    ax.set_ylabel("arm - standard, % of val/loss")
    ax.set_title("each arm at its own lr, minus the standard at its own")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _default_save(fig: Any, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path.as_posix()


def section(out: Path, figs: Path, save: Callable[[Any, Path], str] | None = None,
            record: Path | None = None) -> tuple[list[str], list[str]]:
    """The section's text and its claim lines (none: this part answers questions of its own, not
    one of the paper's claims), from `out / depth_tuned`. With `record` (report.py: results/ beside
    REPORT.md), the runs found are kept in `record/depth_tuned.json`, and where there are none (another
    machine trained them) the section is built from that record instead."""
    arms, source, rows = read_all(out), "", []
    part = read_json(out / "state.json").get(FOLDER, {})  # run.py's clock over the part's invocations
    if arms:
        rows = [row for name in (FOLDER, CARRIED) for row in record_rows(out / name)]
    if arms and record is not None:
        designs = {name: sequential.read_record(out / name) for name in (FOLDER, CARRIED)}
        records.write_record(record, FOLDER, rows, f"runs/{FOLDER} and runs/{CARRIED}",
                             {"seeds": designs, "part": part})
    elif not arms and record is not None and (record / f"{FOLDER}.json").is_file():
        saved = read_json(record / f"{FOLDER}.json")
        part, rows = (saved.get("extra") or {}).get("part") or {}, saved.get("runs", [])
        arms = arms_from_record(rows, (saved.get("extra") or {}).get("seeds") or {})
        source = (f" Built from {record.name}/{FOLDER}.json, the per-run record of {saved.get('source')} "
                  f"(written {saved.get('written')}), not from the runs themselves.")
    if not arms:
        return [f"Not run yet: `{RUN}`."], []
    found = gaps(arms)
    depths = sorted({d for _, d in arms})
    text = ["Standard, Block AttnRes (N = 8 at every depth, as the paper sets it; at 8 sublayers that is Full "
            "AttnRes) and the controls of docs/strategies.md#controls, at 8, 24 and 48 sublayers of width 40 "
            "(`attnres-run -m experiment=depth_study`: byte-level stdlib, 800 steps of 16 x 128 bytes). Each arm "
            "at 8 and 24 sublayers tuned its own lr on a 3-point grid (factor 2 around 0.012, grown at an edge) "
            "on tuning seeds 1000 and 1001, then ran the verdict seeds at its choice. " + _carry_text(arms)
            + " Gaps: arm minus standard, both at "
            f"their best, as a share of the standard's val/loss, paired by seed; the intervals of a depth hold "
            f"together (Bonferroni over its arms); the margin is {MARGIN_PCT}% (docs/sweeps.md#verdicts)."
            + _seeds_text(arms) + _budget_text(part, machine_share(rows)) + source, "",
            "| sublayers | tokens per parameter | arm | chosen lr (standard's) | gap [interval] | verdict | seeds |",
            "|---|---|---|---|---|---|---|"]
    for depth in depths:
        base = arms.get((BASELINE, depth), {})
        ratio = "—"
        if base.get("runs"):
            m = next(iter(base["runs"].values()))
            if m.get("non_embedding_parameters"):
                ratio = f"{m['tokens_seen'] / m['non_embedding_parameters']:.2g}"
        for arm in [a for a in ARMS if (a, depth) in found]:
            g, lr = found[arm, depth], arms[arm, depth]
            edge = ", on the grid's edge" if lr.get("edge") else ""
            if lr.get("sweep") == CARRIED:
                edge = f", carried from {_sublayers(CARRY[0])}"
            seeds = ", ".join(map(str, sorted(g.per_seed))) or "none"
            text.append(f"| {depth} | {ratio} | {arm} | {_lr(lr.get('lr'))}{edge} ({_lr(base.get('lr'))}) | "
                        f"{g.text()} | {g.verdict()} | {seeds} |")
    text += [""]
    try:
        path = (save or _default_save)(figure(found), figs / "depth_tuned.png")
        text += [f"![gap against depth]({path})", ""]
    except Exception as err:  # the numbers stand without the figure
        print(f"report: the depth figure was not drawn ({type(err).__name__}: {err})")
    text += _answers(found, depths, arms)
    return text, []


def _carry_text(arms: Mapping[tuple[str, int], Mapping[str, Any]]) -> str:
    """What the carried depth ran at, and how far each arm's choice moved between the searched depths."""
    shallow, source, deep = 8, _sublayers(CARRY[0]), _sublayers(CARRY[1])
    moves = []
    for arm in [BASELINE, *ARMS]:
        a, b = (arms.get((arm, d), {}).get("lr") for d in (shallow, source))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            moves.append(f"{arm} {_lr(a)} -> {_lr(b)}" if a != b else f"{arm} {_lr(a)} at both")
    moved = (f" From {shallow} to {source} sublayers the searches chose: {'; '.join(moves)}." if moves else "")
    return (f"At {deep} sublayers there was no search: each arm ran at the lr it chose at {source} "
            f"(`hydra.sweeper.method=given`), because the {deep}-sublayer grids alone would have cost about two "
            f"of the part's four hours.{moved} An arm whose best lr moves again between {source} and {deep} "
            f"sublayers runs there off its best (the transfer study saw at most one grid step, a factor of 2, "
            f"across a fourfold depth), which favours the arm whose best moves least.")


def _budget_text(part: Mapping[str, Any], share: Mapping[str, float] | None = None) -> str:
    """Where the part's wall-time budget stands (run.py's clock, runs/state.json), and how much of the
    machine its runs had (machine_share), which is why a part may be continued past its budget."""
    wall = part.get("wall_s")
    if not isinstance(wall, (int, float)):
        return ""
    shared = bool(share and share["shared_runs"])
    used = (f" {share['shared_runs']} of its {share['runs']} runs ({share['shared_hours']:.1f} of "
            f"{share['hours']:.1f} run-hours) trained at a mean 1-minute load above 1.5 times the cores, beside "
            "other work; counting each run at the share of a core it had (cores / load, at most 1), the part used "
            f"about {wall * share['share'] / 3600:.1f} h of the machine." if shared else "")
    if part.get("complete") and wall <= BUDGET_H * 3600:
        return f" Wall time: {wall / 3600:.2f} h of this 2-core machine (budget {BUDGET_H:g} h).{used}"
    if part.get("complete"):
        why = " because other work shared the machine for part of it:" if shared else "."
        return (f" Wall time: {wall / 3600:.2f} h, past the part's budget of {BUDGET_H:g} hours of wall time: it was "
                f"continued with run.py's `--over-budget`{why}{used}")
    if wall >= BUDGET_H * 3600:
        return (f" The part's budget of {BUDGET_H:g} hours was spent ({wall / 3600:.2f} h of wall time) "
                "before every run finished: a row without pairs, or with fewer "
                "seeds than the design's, is where it stopped; each interval holds at the look it reached." + used)
    return (f" Not finished: {wall / 3600:.2f} h of its {BUDGET_H:g}-hour budget spent so far; `{RUN}` continues "
            "it." + used)


def _seeds_text(arms: Mapping[tuple[str, int], Mapping[str, Any]]) -> str:
    designs: dict[str, tuple[list[int], Mapping[str, Any]]] = {}
    for (_, depth), arm in sorted(arms.items(), key=lambda item: item[0][1]):
        if (arm.get("design") or {}).get("design"):
            designs.setdefault(arm["sweep"], ([], arm["design"]))[0].append(depth)
    if not designs:
        return ""
    looks = ", and ".join(f"at {' and '.join(map(str, sorted(set(depths))))} sublayers: "
                          + "; ".join(", ".join(map(str, look)) for look in design.get("looks", []))
                          for depths, design in designs.values())
    first = next(iter(designs.values()))[1]["design"]
    return (f" The seeds came on demand ({sequential.describe(first)}; looks {looks}), so each interval is "
            "the design's repeated interval, valid whichever look the sweep stopped at.")


def _lr(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else "—"


def _spread(arms: Mapping[tuple[str, int], Mapping[str, Any]], depth: int) -> str:
    """Each arm's standard deviation of val/loss over its verdict seeds at `depth`, the standard first."""
    out = []
    for arm in [BASELINE, *ARMS]:
        runs = (arms.get((arm, depth)) or {}).get("runs") or {}
        if len(runs) >= 2:
            out.append(f"{arm} {statistics.stdev(m['metrics']['val/loss'] for m in runs.values()):.3f}")
    return ", ".join(out)


def _answers(found: Mapping[tuple[str, int], Gap], depths: Sequence[int],
             arms: Mapping[tuple[str, int], Mapping[str, Any]] | None = None) -> list[str]:
    shallow, deep = depths[0], depths[-1]
    lines = ["Plain answers, from these runs:", ""]
    block = (found.get(("block", shallow)), found.get(("block", deep)))
    if shallow == deep or not all(block):
        lines.append("- Does the tuned gain grow with depth here? Not answered yet: Block needs runs at two depths.")
    else:
        lines.append(f"- Does the tuned gain grow with depth here? {growth(*block)}; at {deep} sublayers Block "
                     f"minus standard is {block[1].text()} ({block[1].verdict()}).")
    for arm in [a for a in ARMS if a != "block" and (a, deep) in found]:
        g = found[arm, deep]
        if block[1] and "better" in block[1].verdict():
            same = "it gets it too" if "better" in g.verdict() else "it does not show it"
        else:
            same = f"Block has no resolved gain at {deep} sublayers for it to match"
        lines.append(f"- Does {arm} ({ARMS[arm]}) get it too? At {deep} sublayers it is {g.text()} against the "
                     f"standard ({g.verdict()}): {same}.")
    spread = _spread(arms or {}, deep)
    if spread:
        lines.append(f"- How noisy is it at {deep} sublayers? The spread of val/loss across the verdict seeds (sd): "
                     f"{spread}; the wider the standard's, the wider every interval of that depth.")
    lines += ["", "What this scale cannot show: one width (40) and one token budget for every depth, so the "
              "deepest models see the fewest tokens per parameter (the table) and the gap there mixes depth "
              "with under-training; at 48 sublayers each arm's lr carried from 24, not searched; "
              "800 steps of 128-byte sequences, far from the paper's 8,192-token context "
              "and 38.7B tokens; the lr alone tuned (warm-up, weight decay, the queries' lr scale fixed); three "
              "to four verdict seeds (seeds on demand stop at the budget's maximum, resolved or not). A gain "
              "that needs width or data to appear cannot appear here, and a null here is not "
              "evidence against it at the paper's sizes.", "",
              "The GPU preset asks the same at a useful size: `attnres-run -m experiment=depth_study scale=gpu "
              "data=tokens data.path=<corpus> trainer=gpu` runs the same arms and depths at width 512 on 1.5G "
              "tokens each (20 per parameter at 48 sublayers), about 40 H100-hours; the paper's sizes (12 to 17 "
              "layers, 24 to 34 sublayers, widths 888 to 1,258) sit inside its depth range, so a gain that grows "
              "with depth would show between its 24- and 48-sublayer points, and the controls there say whether "
              "a fixed depth scaling or a static mix gets it without routing.", ""]
    return lines
