"""experiments/gpu_check.sh's collection: after each stage, that stage's own file under DIR (from
what the stage left in its scratch folder, however far it got), its status in DIR/stages.json,
and DIR/summary.md rewritten. A stage cut short by its time limit still gets its file, holding
what finished.

    python experiments/gpu_check_collect.py STAGE --out DIR --scratch S --rc RC --seconds S --limit L

The files (docs/gpu.md says what each field means): a_tests.json, b_bench.json, c_runner.json,
d_summary.md (the sweep's own summary.md), e_kernels.json; stages.json and summary.md for all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu_check_env import write_json  # this folder, as for any script run from it

FILES = {"a": "a_tests.json", "b": "b_bench.json", "c": "c_runner.json", "d": "d_summary.md", "e": "e_kernels.json"}
TITLES = {"a": "GPU-marked tests and the Triton kernel tests",
          "b": "bench_residuals.py, compiled then eager; bench_decode.py",
          "c": "the runner: standard, Block N=8, Full; eager and compile=true", "d": "a sweep sharing the GPU",
          "e": "kernel_resources.py, and the kernels as the device loaded them"}
STRATEGIES = ("standard", "block", "full")
MODES = {"eager": False, "compiled": True}  # bench mode -> the runner's compile=
TIMED_OUT = (124, 137)


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def outcome(rc: int | None) -> str:
    if rc is None or rc == -1:
        return "not run" if rc is None else "not run (no time left)"
    return "ok" if rc == 0 else "timed out" if rc in TIMED_OUT else f"failed (exit {rc})"


def subs(folder: Path) -> dict[str, dict]:
    """The sub-commands of a stage, as gpu_check.sh's `sub` recorded them: NAME.rc holds
    'exit-status seconds limit' and NAME.cmd the command."""
    out = {}
    for rc_file in sorted(folder.glob("*.rc")):
        rc, seconds, limit = (rc_file.read_text().split() + ["", "", ""])[:3]
        cmd = rc_file.with_suffix(".cmd")
        out[rc_file.stem] = {"status": outcome(int(rc)), "rc": int(rc), "seconds": int(seconds), "limit_s": int(limit),
                             "command": cmd.read_text().strip() if cmd.exists() else None}
    return out


def ratio(x: float | None, base: float | None) -> float | None:
    return round(x / base, 4) if x is not None and base else None


# == (a) ===========================================================================================
def junit(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"report": None}
    cases = ET.parse(path).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, times = [], []
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        times.append((float(case.get("time") or 0.0), name))
        kinds = [child.tag for child in case]
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "errors"] += 1
            node = case.find("failure") if "failure" in kinds else case.find("error")
            failures.append({"test": name, "message": (node.get("message") or "").splitlines()[0][:300]
                             if node is not None and node.get("message") else ""})
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"tests": sum(counts.values()), **counts, "failures": failures[:20],
            "slowest": [{"test": n, "s": round(t, 2)} for t, n in sorted(times, reverse=True)[:5]]}


def collect_a(scratch: Path) -> dict:
    runs = subs(scratch)
    out = {"invocations": {name: {**info, **junit(scratch / f"{name}.xml")} for name, info in runs.items()}}
    keys = ("tests", "passed", "failed", "errors", "skipped")
    out["totals"] = {k: sum(inv.get(k) or 0 for inv in out["invocations"].values()) for k in keys}
    return out


# == (b) ===========================================================================================
def collect_b(scratch: Path) -> dict:
    out: dict[str, Any] = {"invocations": subs(scratch), "modes": {}}
    for mode in MODES:
        raw = read(scratch / f"{mode}.json")
        if not raw:
            continue
        out.setdefault("info", raw.get("info"))
        for key in ("op", "saved_for_backward_bytes", "depth_traffic"):
            out.setdefault(key, raw.get(key))
        shape = raw["info"]["shape"]
        rows = raw.get(mode, {})
        base = rows.get("standard", {})
        table = {}
        for name, r in rows.items():
            table[name] = {
                "train_step_s": r["train_step_s"], "prefill_s": r["prefill_s"],
                "first_call_s": r["train_first_call_s"],  # compilation included under torch.compile
                "tokens_per_s": shape["batch"] * shape["seq_len"] / r["train_step_s"],
                "peak_train_bytes": r["peak_train_bytes"], "peak_prefill_bytes": r["peak_prefill_bytes"],
                "vs_standard": {k: ratio(r.get(k), base.get(k))
                                for k in ("train_step_s", "prefill_s", "peak_train_bytes", "peak_prefill_bytes")},
            }
        out["modes"][mode] = table
    decode = read(scratch / "decode.json")  # bench_decode.py: per shape and route, each strategy's ratios
    if decode:
        out["decode"] = {"info": decode.get("info"), "shapes": {
            name: {"shape": res["shape"], "routes": {route: {n: {k: v for k, v in row.items() if k != "samples"}
                                                             for n, row in rows.items()}
                                                     for route, rows in res["routes"].items()}}
            for name, res in decode.get("shapes", {}).items()}}
    return out


# == (c) ===========================================================================================
def events(run: Path) -> dict[str, list[tuple[int, float]]]:
    """perf/* scalars from the run's TensorBoard events: (step, value) each."""
    files = sorted(run.glob("events.out.tfevents.*"))
    if not files:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags().get("scalars", []) if t.startswith("perf/")]
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}


def steady(series: list[tuple[int, float]], skip: int) -> float | None:
    """Median over the logged steps after the first `skip`: leaves out the first step (which
    compiles under compile=true) and the warm-up; metrics.json's tokens_per_sec averages them in."""
    values = [v for step, v in series if step >= skip]
    return statistics.median(values) if values else None


def collect_run(run: Path, skip: int) -> dict:
    metrics = read(run / "metrics.json")
    series = events(run)
    log = run / "attnres.log"
    warnings = [ln.split(" - ", 1)[-1][:300] for ln in (log.read_text().splitlines() if log.exists() else [])
                if "[WARNING]" in ln or "[ERROR]" in ln]
    first = series.get("perf/tokens_per_sec", [(0, 0.0)])[0]
    tps, mean = steady(series.get("perf/tokens_per_sec", []), skip), metrics.get("tokens_per_sec")
    seen, steps = metrics.get("tokens_seen"), metrics.get("steps")
    # training time beyond `steps` steady steps: the first steps' compilation and warm-up
    extra = seen / mean - seen / tps if tps and mean and seen and steps else None
    return {
        "status": metrics.get("status", "no metrics.json"), "steps": metrics.get("steps"),
        "tokens_per_sec_metrics_json": metrics.get("tokens_per_sec"), "mfu_metrics_json": metrics.get("mfu"),
        "tokens_per_sec_steady": tps, "train_s_beyond_steady": round(extra, 2) if extra is not None else None,
        "mfu_steady": steady(series.get("perf/mfu", []), skip),
        "first_step_tokens_per_sec": first[1] if first[0] == 0 else None,
        "peak_memory_bytes": metrics.get("peak_memory_bytes"), "wall_time_s": metrics.get("wall_time_s"),
        "val_loss": metrics.get("metrics", {}).get("val/loss"), "warnings": warnings[:8],
    }


def collect_c(scratch: Path, bench: dict) -> dict:
    setup = read(scratch / "setup.json")  # the runs' shape and steps, written by gpu_check.sh
    skip = setup.get("skip_steps", 10)
    out: dict[str, Any] = {"setup": setup, "invocations": subs(scratch), "runs": {}}
    for mode in MODES:
        for name in STRATEGIES:
            run = scratch / "runs" / f"{name}-{mode}"
            if run.exists():
                out["runs"].setdefault(mode, {})[name] = collect_run(run, skip)
    info = bench.get("info") or {}
    shape = info.get("shape")
    same = shape is not None and all(shape.get(k) == setup.get("shape", {}).get(k) for k in shape)
    # AttnRes strategies compare with (b) only where both ran the same depth-attention implementation
    # (--dry: (b) interprets the Triton kernels, the runner takes the C++ kernel)
    same_kernel = info.get("kernel_resolved") == setup.get("kernel_resolved")
    out["bench_shape_matches"], out["bench_kernel_matches"] = same, same_kernel
    for mode, runs in out["runs"].items():
        base = runs.get("standard", {})
        for name, r in runs.items():
            r["vs_standard"] = {"tokens_per_sec": ratio(r["tokens_per_sec_steady"], base.get("tokens_per_sec_steady")),
                                "peak_memory": ratio(r["peak_memory_bytes"], base.get("peak_memory_bytes"))}
            comparable = same and (same_kernel or name == "standard")
            bare = bench.get("modes", {}).get(mode, {}).get(name, {}).get("tokens_per_s") if comparable else None
            # the runner's own cost over the bare train step of (b): hooks, logging, the non-finite guard's
            # host synchronisations, and bf16-mixed (fp32 weights) where (b) keeps the weights in bf16
            r["over_bare_step"] = {"bare_tokens_per_sec": bare, "steady": ratio(r["tokens_per_sec_steady"], bare),
                                   "metrics_json": ratio(r["tokens_per_sec_metrics_json"], bare)}
    return out


# == (d) ===========================================================================================
def collect_d(scratch: Path, out_dir: Path) -> dict:
    sweep = scratch / "sweep"
    target = out_dir / FILES["d"]
    rows = []
    if (sweep / "summary.csv").exists():
        import csv

        rows = list(csv.DictReader((sweep / "summary.csv").open()))
    if (sweep / "summary.md").exists():
        shutil.copyfile(sweep / "summary.md", target)
    else:
        log = scratch / "stage.log"
        tail = log.read_text().splitlines()[-20:] if log.exists() else []
        target.write_text("# No sweep summary\n\nThe sweep wrote no summary.md; its log ends:\n\n```text\n"
                          + "\n".join(tail) + "\n```\n")
    return {"invocations": subs(scratch), "jobs": len(rows),
            "finished": sum(r.get("status") == "finished" for r in rows),
            "slots": sorted({r.get("slot") for r in rows if r.get("slot")})}


# == (e) ===========================================================================================
COLUMNS = ("kernel", "srcs", "K", "prefix", "BLOCK_M", "BLOCK_D", "warps", "regs", "spill_bytes", "smem_bytes",
           "warps_per_sm", "loop_instr", "issue_over_floor", "compile_s")


def parse_resources(text: str) -> dict:
    rows, header = [], None
    for line in text.splitlines():
        if line.startswith("triton "):
            header = line
        words = line.split()
        if len(words) == len(COLUMNS) and words[0] in ("_fwd_kernel", "_bwd_kernel", "_inv_rms_kernel"):
            row = dict(zip(COLUMNS, words, strict=True))
            for k in ("srcs", "K", "BLOCK_M", "BLOCK_D", "warps", "regs", "spill_bytes", "smem_bytes", "warps_per_sm"):
                row[k] = int(row[k])
            rows.append(row)
    return {"header": header, "variants": rows, "max_regs": max((r["regs"] for r in rows), default=None),
            "spilling": sum(r["spill_bytes"] > 0 for r in rows),
            "min_warps_per_sm": min((r["warps_per_sm"] for r in rows), default=None)}


def by_kernel(rows: list[dict], regs: str, warps: str) -> dict:
    out: dict[str, dict] = {}
    for r in rows:
        k = out.setdefault(r["kernel"], {"variants": 0, "regs": [], "warps_per_sm": []})
        k["variants"] += 1
        k["regs"].append(r[regs])
        if r.get(warps) is not None:
            k["warps_per_sm"].append(r[warps])
    return {name: {"variants": k["variants"], "regs": [min(k["regs"]), max(k["regs"])],
                   "warps_per_sm": [min(k["warps_per_sm"]), max(k["warps_per_sm"])] if k["warps_per_sm"] else None}
            for name, k in out.items()}


def collect_e(scratch: Path) -> dict:
    text = (scratch / "kernel_resources.txt").read_text() if (scratch / "kernel_resources.txt").exists() else ""
    compiled = parse_resources(text)
    device = read(scratch / "device.json") or None
    out = {"invocations": subs(scratch), "compiled_for_target": compiled, "on_device": device}
    if device and device.get("kernels"):
        out["comparison"] = {"compiled_for_target": by_kernel(compiled["variants"], "regs", "warps_per_sm"),
                             "on_device": by_kernel([r for r in device["kernels"] if "error" not in r], "n_regs",
                                                    "warps_per_sm")}
    return out


# == stages.json and summary.md ====================================================================
def headline(stage: str, data: dict) -> str:
    if stage == "a":
        t = data.get("totals", {})
        return f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('errors', 0)} errors, " \
               f"{t.get('skipped', 0)} skipped"
    if stage == "b":
        parts = []
        for mode, table in data.get("modes", {}).items():
            cells = [f"{n} {r['vs_standard']['train_step_s']:.2f}x" for n, r in table.items()
                     if n != "standard" and r["vs_standard"]["train_step_s"] is not None]
            std = table.get("standard", {}).get("train_step_s")
            parts.append(f"{mode}: standard {std * 1e3:.1f} ms/step" + (", " + ", ".join(cells) if cells else "")
                         if std else f"{mode}: no standard row")
        for name, res in (data.get("decode") or {}).get("shapes", {}).items():
            rows = res["routes"].get("steps", {})
            cells = [f"{n} {r['vs_standard']['token_s'][0]:.2f}x" for n, r in rows.items()
                     if n != "standard" and "vs_standard" in r]
            if cells:
                parts.append(f"decode {name}: " + ", ".join(cells) + " per token")
        return "; ".join(parts) or "no figures"
    if stage == "c":
        parts = []
        for mode, runs in data.get("runs", {}).items():
            for name, r in runs.items():
                tps, mfu = r.get("tokens_per_sec_steady"), r.get("mfu_steady")
                over = (r.get("over_bare_step") or {}).get("steady")
                parts.append(f"{name}/{mode} {r['status']}" + (f" {tps:,.0f} tok/s" if tps else "")
                             + (f" MFU {mfu:.1%}" if mfu else "") + (f" {over:.2f}x bare" if over else ""))
        return "; ".join(parts) or "no runs"
    if stage == "d":
        return f"{data.get('finished', 0)} of {data.get('jobs', 0)} jobs finished on slots " \
               f"{', '.join(data.get('slots', [])) or '-'}"
    if stage == "e":
        c = data.get("compiled_for_target", {})
        if not c.get("variants"):
            return "no kernel_resources.py table"
        loaded = (data.get("on_device") or {}).get("kernels", [])
        return f"{len(c['variants'])} variants compiled for the target, max {c['max_regs']} regs, {c['spilling']} " \
               f"spilling; {len(loaded)} loaded on the device"
    return ""


def summary(out_dir: Path, state: dict) -> None:
    env = state.get("env", {})
    where = env.get("gpu") or "CPU"
    lines = [f"# GPU check: {where}" + (" (dry run on the CPU)" if env.get("dry") else ""), "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, Python {env.get('python')}, "
             f"started {state.get('started')}", "",
             "| stage | what | status | s | limit s | file | headline |", "|---|---|---|---|---|---|---|"]
    for stage in "abcde":
        s = state["stages"].get(stage)
        if s is None:
            continue
        lines.append(f"| {stage} | {TITLES[stage]} | {s['status']} | {s['seconds']} | {s['limit_s']} | "
                     f"{FILES[stage]} | {s.get('headline', '').replace('|', '/')} |")
    path = out_dir / "summary.md"
    tmp = path.with_name(".summary.md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=sorted(FILES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scratch", type=Path, required=True, help="the scratch folder of all stages")
    p.add_argument("--rc", type=int, default=None, help="the stage's exit status (none: not run)")
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--limit", type=int, default=0)
    args = p.parse_args(argv)
    folder = args.scratch / args.stage
    if args.stage == "a":
        data = collect_a(folder)
    elif args.stage == "b":
        data = collect_b(folder)
    elif args.stage == "c":
        data = collect_c(folder, read(args.out / FILES["b"]))
    elif args.stage == "d":
        data = collect_d(folder, args.out)
    else:
        data = collect_e(folder)
    status = outcome(args.rc)
    if args.rc == 0 and any(s["rc"] != 0 for s in data.get("invocations", {}).values()):
        status = "failed (a step failed)"
    data["stage"] = {"status": status, "seconds": args.seconds, "limit_s": args.limit}
    if args.stage != "d":
        write_json(args.out / FILES[args.stage], data)
    state = read(args.out / "stages.json") or {"env": {}, "stages": {}}
    state["stages"][args.stage] = {**data["stage"], "headline": headline(args.stage, data),
                                   **({"sweep": {k: data[k] for k in ("jobs", "finished", "slots")}}
                                      if args.stage == "d" else {})}
    write_json(args.out / "stages.json", state)
    summary(args.out, state)
    print(f"gpu_check.sh: ({args.stage}) {status} in {args.seconds} s: {state['stages'][args.stage]['headline']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
