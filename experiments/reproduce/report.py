"""REPORT.md of the CPU study (experiments/reproduce/run.py), the paper's figures beside ours: the
assembler. Each part's section is built by a module of its own, from the runs of that part (and
of the parts it reuses), with the verdict rule and words of verdicts.py:

    training_length.py   "Training length" (parts ordering and depth)
    ordering_part.py     1. loss ordering (Table 2), 4. magnitudes and gradients, 5. depth attention
    blocksize_part.py    2. block size (Figure 6)
    shapes_part.py       3. depth at equal parameters (Figure 7): part `depth`, deep against shallow
    ladder_part.py       6. the compute multiplier
    tuned_part.py        7. each arm at its own learning rate
    tuned_seeds_part.py  7b. the same, extended by seeds on demand to a verdict at a stated margin
    tasks_part.py        8. a downstream task through lm-eval
    study.py             what they share: the runs, paired effects and their intervals, tables, figures

This module puts them in order under the verdicts and the wall times, writes REPORT.md whole, and
splices one part's section into a REPORT.md kept as written where the other parts' runs are absent.
Whenever it holds a part's runs it also writes that part's per-seed record, results/<part>.json
(records.py), which outlives the runs. `--margins-from-printed` adds the margin verdicts to a
REPORT.md whose runs are elsewhere, from its printed intervals (verdicts.margins_from_printed).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # experiments/: plot_run, scaling
sys.path.insert(0, str(HERE))  # the section modules beside this one

import blocksize_part  # noqa: E402
import depth_part  # noqa: E402
import ladder_part  # noqa: E402
import ordering_part  # noqa: E402
import records  # noqa: E402
import shapes_part  # noqa: E402
import tasks_part  # noqa: E402
import training_length  # noqa: E402
import tuned_seeds_part  # noqa: E402
from study import (  # noqa: E402
    PAPER,
    PAPER_GAPS,
    PARTS,
    Effect,
    Run,
    finished,
    load_runs,
    mean_sd,
    paper_range,
    relative_gap,
    save,
)
from tasks_part import part_tasks  # noqa: E402
from tuned_part import part_tuned, verdict_runs  # noqa: E402
from verdicts import DEFINITIONS, MARGIN_DEFINITION, claim, count_words, margins_from_printed, verdict  # noqa: E402

from attnres.atomic import read_json  # noqa: E402
from attnres.results.summary import find_job_dirs  # noqa: E402

# -- the report ------------------------------------------------------------------------------------------
TUNED_TITLE = "7. Each arm at its own learning rate (a tuned comparison)"
TASKS_TITLE = tasks_part.TITLE


def tuned_section(out: Path, runs: Sequence[Run], figs: Path, kept: str = "") -> tuple[list[str], list[str]]:
    shared = relative_gap(runs, "deep", "block N=4") if finished(runs, "deep", "standard") else None
    paper = PAPER_GAPS["block"]
    return part_tuned(out, figs, shared, Effect, verdict, claim, paper_range(paper), paper, save, kept)


def tasks_section(out: Path, figs: Path) -> tuple[list[str], list[str]]:
    return part_tasks(out, figs, Effect, verdict, claim, save, mean_sd)


TUNED_ROW = ("| tuned | standard and Block N=4 at the deep shape: 2 x 5-point lr grid x 2 tuning seeds, then 5 seeds "
             "each at its best | {} |")
TASKS_ROW = "| tasks | standard and Block N=4 at experiment=synthetic_depth x 5 seeds, scored by lm-eval | {} |"


def splice_tuned(out: Path) -> Path:
    """Update REPORT.md's tuned section alone (for a machine that holds the tuned part's runs but not
    the other parts')."""
    text, claims = tuned_section(out, load_runs(out), HERE / "figures", kept=(HERE / "REPORT.md").read_text())
    return splice(TUNED_TITLE, text, claims, "with each at its own learning rate", "tuned",
                  TUNED_ROW.format(_wall(read_json(out / "state.json"), "tuned")), "runs/tuned")


def splice_tasks(out: Path) -> Path:
    """Update REPORT.md's downstream-task section alone, as splice_tuned does the tuned one."""
    text, claims = tasks_section(out, HERE / "figures")
    return splice(TASKS_TITLE, text, claims, "on a downstream task", "tasks",
                  TASKS_ROW.format(_wall(read_json(out / "state.json"), "tasks")), "runs/tasks")


def splice(title: str, text: list[str], claims: list[str], old_claim: str, part: str, row: str, source: str,
           before: str = "## Not run at this scale") -> Path:
    """Replace one section of REPORT.md (or add it before the section `before`, or before "Not run at
    this scale" where that is absent), its claim line (found by `old_claim`) and its wall-time row,
    keeping the rest as it was written."""
    report = HERE / "REPORT.md"
    lines = [line for line in report.read_text().splitlines() if old_claim not in line]
    head = next(i for i, line in enumerate(lines) if line.startswith("## Verdicts ("))
    end = next(i for i in range(head + 2, len(lines)) if not lines[i].startswith("- "))
    lines[end:end] = claims
    claim_lines = [line for line in lines[head + 2:end + len(claims)] if line.startswith("- **")]
    lines[head] = f"## Verdicts ({count_words(claim_lines)})"
    rows = [i for i, line in enumerate(lines) if line.startswith(f"| {part} |")]
    if rows:
        lines[rows[0]] = row
    else:  # after the wall-time table's last row
        table = next(i for i, line in enumerate(lines) if line.startswith("| prepare |"))
        while lines[table + 1].startswith("| "):
            table += 1
        lines.insert(table + 1, row)
    section = [f"## {title}", "", f"*Added on {time.strftime('%Y-%m-%d')} from `{source}`; "
               "the sections above are as their runs wrote them.*", "", *text, ""]
    if f"## {title}" in lines:  # replaced where it stands, up to the next section
        start = lines.index(f"## {title}")
        stop = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
        lines[start:stop] = section
    else:
        at = lines.index(before if before in lines else "## Not run at this scale")
        lines[at:at] = section
    tmp = report.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(report)
    return report


DEPTH_ROW = ("| depth_tuned | standard, Block N=8, depth_scaled, block_static at 8, 24, 48 sublayers: a 3-point "
             "lr grid each at 8 and 24, carried from 24 to 48, then 3 or 4 seeds at each best | {} |")


def splice_depth_tuned(out: Path) -> Path:
    """Update REPORT.md's depth section alone (depth_part.py), as splice_tuned does the tuned one."""
    text, claims = depth_part.section(out, HERE / "figures", save, HERE / records.FOLDER)
    # "\x00": no claim line of its own to replace (the section answers questions, not a paper claim)
    return splice(depth_part.TITLE, text, claims, "\x00", "depth_tuned",
                  DEPTH_ROW.format(_wall(read_json(out / "state.json"), "depth_tuned")), "runs/depth_tuned")


TUNED_SEEDS_ROW = ("| tuned_seeds | standard and Block N=4 at the deep shape at part tuned's lrs, seeds on demand: 5, "
                   "then 3 a look, at most 17 | {} |")


def splice_tuned_seeds(out: Path) -> Path:
    """Update REPORT.md's section 7b alone (tuned_seeds_part.py), placed after section 7."""
    text, claims = tuned_seeds_part.section(out, HERE / "figures", HERE / records.FOLDER)
    return splice(tuned_seeds_part.TITLE, text, claims, "\x00", "tuned_seeds",
                  TUNED_SEEDS_ROW.format(_wall(read_json(out / "state.json"), "tuned_seeds")), "runs/tuned_seeds",
                  before=f"## {TASKS_TITLE}")


SPLICES: dict[str, Callable[[Path], Path]] = {"tuned": splice_tuned, "tuned_seeds": splice_tuned_seeds,
                                              "tasks": splice_tasks, "depth_tuned": splice_depth_tuned}
FOLDERS = (*PARTS, "tuned", "tuned_seeds", "tasks", "depth_tuned")  # every part's runs folder under the output folder


def update_report(out: Path, ran: Sequence[str]) -> tuple[Path, str]:
    """After parts `ran`: the whole report rebuilt when every part's runs are in `out`; otherwise
    (a machine that holds some parts' runs) the report is never rebuilt without the others'
    sections: the sections of the parts that ran and can be updated alone are spliced in, and the
    second value says what was kept."""
    save_records(out)
    absent = [name for name in FOLDERS if not has_runs(out / name)]
    if not absent:
        return write_report(out), ""
    done = [name for name in ran if name in SPLICES]
    report = HERE / "REPORT.md"
    for name in done:
        report = SPLICES[name](out)
    what = f"section(s) of part(s) {', '.join(done)} updated" if done else "nothing in it updated"
    return report, (f"REPORT.md kept as written: part(s) {', '.join(absent)} have no runs in {out}; {what}. "
                    "It is rebuilt whole only from a folder that holds every part's runs")


def save_records(out: Path) -> list[Path]:
    """results/<part>.json of each part whose runs are in `out` (depth_tuned writes its own)."""
    by_part: dict[str, list[dict]] = {}
    for run in load_runs(out):
        by_part.setdefault(run.part, []).append({
            "shape": run.shape, "strategy": run.strategy, "seed": run.seed, "status": run.status,
            "val/loss": run.loss, "val/bpb": run.bpb, "tokens_per_sec_after_warmup": run.tokens_per_sec,
            "tokens_seen": run.tokens, "parameters": run.parameters, "non_embedding_parameters": run.non_embedding,
            "job": run.path.name})
    if has_runs(out / "tuned"):
        by_part["tuned"] = verdict_runs(out)
    if has_runs(out / "tasks"):
        by_part["tasks"] = tasks_part.record_runs(out)
    return [records.write_record(HERE / records.FOLDER, part, runs, f"runs/{part}")
            for part, runs in by_part.items() if runs]


#: the seeds behind every printed comparison of sections 1 to 3, 7 and 8 (seeds 0 to 4)
PRINTED_SEEDS = 5


def add_margins_from_printed() -> tuple[Path, int]:
    """REPORT.md with the margin verdicts beside its printed comparisons (verdicts.margins_from_printed),
    for a machine without the runs; returns it and the number of verdicts added."""
    report = HERE / "REPORT.md"
    text, found = margins_from_printed(report.read_text(), PRINTED_SEEDS)
    if found:
        tmp = report.with_suffix(".md.tmp")
        tmp.write_text(text)
        tmp.replace(report)
    return report, len(found)


class NoRunsError(Exception):
    """A rebuild asked of a folder that holds none of the parts' runs asked for (nothing is written)."""


def has_runs(folder: Path) -> bool:
    return folder.is_dir() and bool(find_job_dirs(folder))


def rebuild(out: Path, parts: Sequence[str] = FOLDERS) -> tuple[Path, str]:
    """`run.py --report-only` (and this module's command): REPORT.md from the runs in `out`, as
    update_report does after parts `parts` ran; a folder without any of their runs is refused
    (NoRunsError) before anything is written, so the report and figures measured elsewhere stay."""
    present = [name for name in parts if has_runs(out / name)]
    if not present:
        raise NoRunsError(f"{out} holds no runs of part(s) {', '.join(p for p in parts if p in FOLDERS)}: nothing "
                          "to rebuild REPORT.md from (it and its figures are kept as written); pass the output "
                          "folder of a run.py that ran them (--out)")
    return update_report(out, present)


def _wall(state: dict, part: str) -> str:
    entry = state.get(part)
    if not entry:
        return "not run"
    done = "complete" if entry.get("complete") else "incomplete"
    return f"{entry['wall_s'] / 60:.1f} min ({done}, {entry['invocations']} invocation(s))"


def write_report(out: Path) -> Path:
    figs = HERE / "figures"
    for old in figs.glob("*.png"):  # every figure is drawn anew: none is left from runs no longer there
        old.unlink()
    state = read_json(out / "state.json")
    runs = load_runs(out)
    sections: list[tuple[str, Callable[[], tuple[list[str], list[str]]]]] = [
        ("1. Loss ordering (Table 2)", lambda: ordering_part.part_ordering(runs)),
        ("2. Block size (Figure 6)", lambda: blocksize_part.part_blocksize(runs, figs)),
        ("3. Depth at equal parameters (Figure 7)", lambda: shapes_part.part_depth(runs)),
        ("4. Magnitudes and gradients across depth (Figure 5b, 5c)", lambda: ordering_part.part_dynamics(runs, figs)),
        ("5. Depth attention (Figure 8)", lambda: ordering_part.part_heatmaps(runs, figs)),
        ("6. The compute multiplier (Table 2's fits)", lambda: ladder_part.part_ladder(out, runs, figs)),
        (TUNED_TITLE, lambda: tuned_section(out, runs, figs)),
        (tuned_seeds_part.TITLE, lambda: tuned_seeds_part.section(out, figs, HERE / records.FOLDER)),
        (TASKS_TITLE, lambda: tasks_section(out, figs)),
        (depth_part.TITLE, lambda: depth_part.section(out, figs, save, HERE / records.FOLDER)),
    ]
    body, claims = [], []
    for title, build in sections:
        text, found = build()
        body += [f"## {title}", "", *text, ""]
        claims += found
    where = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    lines = [
        "# The Attention Residuals paper at CPU scale", "",
        f"Which claims of {PAPER} does a 2-core CPU resolve? Generated by `python experiments/reproduce/run.py` "
        f"on {time.strftime('%Y-%m-%d')} from the runs in `{where}`; run it again to resume or rebuild "
        "(`--report-only`). The paper's numbers are as transcribed from its tables and figures (the PDF "
        "was read through two secondary transcriptions that agree).", "",
        "**Setup.** The Python standard library's source, tokenized with a 1,024-token byte-level BPE "
        "(`attnres-prepare stdlib ... --vocab-size 1024`; 11.6M training tokens, 65,536 validation tokens "
        "scored, the same for every run); sequences of 128 tokens, 16 a step; AdamW at 3e-3, 5% warm-up, "
        "cosine to 0.1x, pseudo-queries at 0.1x the learning rate; 5 seeds (0 to 4) per configuration "
        "(3 on the ladder's lower rungs), "
        "paired by seed. Shapes: deep 8 x 40 and shallow 2 x 80 (153.6k non-embedding parameters each), "
        "2,400 steps (4.9M tokens: 25 and 21 tokens per parameter, embedding included); a ladder of widths "
        "16 to 40 at 8 layers. The paper: Mixture-of-Experts models of 194M to 528M activated parameters, "
        "38.7B to 119B tokens, 8,192-token context. What holds here may not hold there, and the reverse.", "",
        DEFINITIONS, "", MARGIN_DEFINITION,
        "",
        f"## Verdicts ({count_words(claims)})", "", *claims, "",
        "## Wall time (2 jobs at a time on the 2 cores, one thread each)", "",
        "| part | runs | wall time |", "|---|---|---|",
        f"| prepare | tokenize the stdlib (once) | {_wall(state, 'prepare')} |",
        f"| ordering | standard, Block N=4, Full at the deep shape x 5 seeds | {_wall(state, 'ordering')} |",
        f"| blocksize | Block N=8 and N=2 at the deep shape x 5 seeds | {_wall(state, 'blocksize')} |",
        f"| depth | standard and Block N=2 at the shallow shape x 5 seeds | {_wall(state, 'depth')} |",
        f"| ladder | standard and Block N=8 at widths 16, 24, 32 x 3 seeds | {_wall(state, 'ladder')} |",
        TUNED_ROW.format(_wall(state, "tuned")), TUNED_SEEDS_ROW.format(_wall(state, "tuned_seeds")),
        TASKS_ROW.format(_wall(state, "tasks")),
        DEPTH_ROW.format(_wall(state, "depth_tuned")), "",
        "## Training length", "", *training_length.part_length(runs, figs), "",
        *body,
        "## Not run at this scale", "",
        "Table 4's ablations (the 436M model): the paper's rows are in conf/experiment/paper_ablations.yaml, "
        "which runs them at the paper's shape on GPUs (`attnres-run -m experiment=paper_ablations`) or at a "
        "tiny shape on a CPU (`scale=cpu`, a check that every row runs, not a measurement). This study "
        "spends its CPU budget on the claims above; it makes no claim about Table 4.", "",
    ]
    report = HERE / "REPORT.md"
    tmp = report.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(report)
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "runs",
                        help="the runs' folder (default experiments/reproduce/runs); REPORT.md and figures/ stay "
                             "beside this file")
    parser.add_argument("--only-tuned", action="store_true",
                        help="update only the tuned section (the other parts' runs need not be here)")
    parser.add_argument("--only-tasks", action="store_true",
                        help="update only the downstream-task section (the other parts' runs need not be here)")
    parser.add_argument("--margins-from-printed", action="store_true",
                        help="add the margin verdicts to REPORT.md from its printed intervals (no runs needed)")
    args = parser.parse_args()
    out = args.out.resolve()
    if args.margins_from_printed:
        written, added = add_margins_from_printed()
        print(f"{written} ({added} margin verdicts added)")
    elif args.only_tuned or args.only_tasks:
        save_records(out)
        for splice_part in [splice_tuned] * args.only_tuned + [splice_tasks] * args.only_tasks:
            print(splice_part(out))
    else:
        try:
            written, kept = rebuild(out)
        except NoRunsError as err:
            print(f"report.py: {err}", file=sys.stderr)
            sys.exit(2)
        print(f"{written}" + (f" ({kept})" if kept else ""))
