"""Part `tuned` of the CPU study (experiments/reproduce/run.py --parts tuned): does Block AttnRes
(N=4) still beat the standard residual when each arm runs at its own learning rate?

The paper tuned its hyperparameters for the baseline only; so do the other parts here (AdamW at
3e-3 for every arm). This part is one `attnres-run -m tune=lr` sweep at the deep shape: each arm's lr
on a 5-point log grid (factor 2 around 3e-3, grown at an edge) over tuning seeds 1000 and 1001,
then each arm at its own best on verdict seeds 0 to 4 (docs/sweeps.md#tuned-comparisons). The
section compares the tuned gap with the shared-lr gap of part `ordering` (same shape, seeds,
steps), as a share of the baseline's loss like the other parts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verdicts import NOT_RESOLVED, MarginVerdict, margin_note

from attnres.atomic import read_json
from attnres.results import tuning
from attnres.results.tuned_summary import choice_line, write_tuned_summary

FOLDER = "tuned"
BLOCK, STANDARD = "block", "standard"
#: the ordering part's claim line in a report, for the shared-lr gap when its runs are not here
ORDERING_CLAIM = re.compile(r"Block AttnRes \(N = 4, S = 4\) has a lower loss than the standard residual .*?"
                            r"ours: ([-+][0-9.]+)% \[([-+][0-9.]+), ([-+][0-9.]+)\], deep shape")


def part_tuned(out: Path, figs: Path, shared: Any, effect_cls: Any, verdict: Callable[..., str],
               claim: Callable[[str, str], str], paper_range: str, table2: Sequence[float],
               save: Callable[[Any, Path], str], kept_report: str = "") -> tuple[list[str], list[str]]:
    """The section's text and its claim lines. `shared`: the ordering part's Effect of block N=4
    against standard (None when its runs are not here: then the gap is read from `kept_report`)."""
    sweep = out / FOLDER
    state = tuning.read_state(sweep)
    if not state.get("arms"):
        return ["Not run yet: `python experiments/reproduce/run.py --parts tuned`."], []
    rows, lines = write_tuned_summary(sweep, title="tuned (the study's part)")
    groups = {g["label"]: g for g in state.get("groups", [])}
    loss = {(r["arm"], r["seed"]): r.get("val/loss") for r in rows if r["stage"] == "tuned"
            and r.get("status") == "finished" and isinstance(r.get("val/loss"), float)}
    seeds = sorted({s for arm, s in loss if arm == BLOCK} & {s for arm, s in loss if arm == STANDARD})
    effect = effect_cls({s: 100 * (loss[BLOCK, s] - loss[STANDARD, s]) / loss[STANDARD, s] for s in seeds})
    word = verdict(effect, table2) if seeds else NOT_RESOLVED
    margin = margin_note(("loss", MarginVerdict.from_effect(effect))) if seeds else ""
    lr = {name: (g.get("chosen_values") or {}).get("optim.optimizer.lr") for name, g in groups.items()}
    edges = [name for name, g in groups.items() if g.get("edge")]
    if shared is not None and shared.per_seed:
        beside = f"{shared.text()} at the shared lr 3e-3 (part ordering, the same seeds)"
    else:
        found = ORDERING_CLAIM.search(kept_report)
        beside = (f"{float(found[1]):+.2f}% [{float(found[2]):+.2f}, {float(found[3]):+.2f}] at the shared lr 3e-3 "
                  "(part ordering, as its section reports it; its runs are not on this machine)" if found
                  else "no shared-lr runs (part ordering) to compare")
    fig_path = None
    try:
        from attnres.results.tuning_figure import search_figure

        fig_path = save(search_figure(state, "tuned, deep shape"), figs / "tuned_search.png")
    except Exception as err:  # the numbers stand without the figure
        print(f"report: the tuned search figure was not drawn ({type(err).__name__}: {err})")
    stage = state.get("stage")
    finished = sum(1 for r in rows if r.get("status") == "finished")
    text = [
        f"Each arm at its own learning rate (stage: {stage}; {finished} of {len(rows)} verdict runs finished). "
        "The search, the same for both arms: a 5-point log grid of the AdamW lr, a factor of 2 apart around "
        "3e-3, grown where an arm's best lay on an edge (at most 3 points a side), each point on tuning seeds "
        "1000 and 1001, chosen on the lowest mean val/loss; then each arm at its choice on seeds 0 to 4, which "
        "the search never read. Everything else as part ordering (deep shape, 2,400 steps).", "",
        *[f"- {choice_line(g, state)}" for g in state.get("groups", [])],
        f"- search budget: {tuning.budget_check(state.get('groups', []))[1]}",
        "",
        f"Block N=4 minus standard, each at its own lr, as a share of the standard's val/loss, paired by seed: "
        f"**{effect.text() if seeds else 'no pairs yet'}** ({len(seeds)} seeds); beside it, {beside}. "
        f"The paper (Table 2, tuned for the baseline only): {paper_range}.{margin}", "",
    ]
    if fig_path:
        text += [f"![the search]({fig_path})", ""]
    text += [
        "Where this does not hold: only the learning rate was tuned (warm-up, weight decay and the "
        "pseudo-queries' lr scale stay at the shared values; `tune=optuna` searches them), on two tuning "
        "seeds, at one shape and one length; a grid a factor of 2 apart places each arm's optimum within a "
        "factor of about 1.4, and the arms' curves are flat near it, so a gap smaller than that resolution's "
        "effect on the loss is not resolved by the choice.",
    ]
    if edges:
        text += ["", f"**Caution**: {', '.join(edges)} chose a value on the edge of its grown grid; the tuned "
                     "optimum may lie beyond it."]
    lrs = ", ".join(f"{name} {tuning.format_value(v)}" for name, v in lr.items() if v is not None)
    what = "Block AttnRes (N = 4) has a lower loss than the standard residual with each at its own learning rate"
    claims = [claim(word, f"{what} (paper: tuned for the baseline only, Table 2: {paper_range} of the baseline's "
                          f"loss; ours: {effect.text()}, deep shape, lr {lrs or 'not chosen'}; shared lr: "
                          f"{beside.split(' at the')[0]})") + margin] if seeds else []
    return text, claims


def verdict_runs(out: Path, folder: str = FOLDER) -> list[dict[str, Any]]:
    """The verdict seeds' runs of each arm (records.py) of the tuned sweep `out / folder`: arm, stage
    (`tuned`: at its chosen values; `configured`: at the shared ones, where the sweep ran them), chosen
    values, seed, status, metrics."""
    sweep = out / folder
    state = tuning.read_state(sweep)
    groups = {g["label"]: g for g in state.get("groups", [])}
    found = []
    for arm in state.get("arms", []):
        chosen = (groups.get(arm.get("group", arm["label"])) or {}).get("chosen_values") or {}
        for stage, field in (("tuned", "jobs"), ("configured", "untuned_jobs")):
            for seed, job in (arm.get(field) or {}).items():
                metrics = read_json(sweep / job / "metrics.json")
                found.append({"arm": arm["label"], "stage": stage, "chosen": chosen, "seed": int(seed), "job": job,
                              "status": metrics.get("status", "unfinished"), **metrics.get("metrics", {})})
    return found
