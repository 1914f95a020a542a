"""The depth study (issue 51): conf/experiment/depth_study.yaml composes at both scales with the
shapes, blocks and budget its comment states, a tiny version runs on this CPU (slow), and the
reproduction's section (experiments/reproduce/depth_part.py) reads a tuned sweep folder: built here
from synthetic runs, and with no runs at all."""

from __future__ import annotations

import json
import math
import re
import statistics
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from scipy import stats

from attnres.results import tuning
from tests.helpers import CONF, REPO, run_cli

sys.path.insert(0, str(REPO / "experiments" / "reproduce"))
depth_part = pytest.importorskip("depth_part")  # experiments/reproduce/depth_part.py
PRESET = CONF / "experiment" / "depth_study.yaml"
ARMS = ("standard", "block", "depth_scaled", "block_static")


@pytest.fixture(scope="module")
def jobs():
    """scale -> [(depth, residual, composed config)] of the preset's built-in sweep."""
    GlobalHydra.instance().clear()
    found = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for scale in ("cpu", "gpu"):
            head = compose("config", overrides=["experiment=depth_study", f"scale={scale}"], return_hydra_config=True)
            params = head.hydra.sweeper.params
            assert head.hydra.sweeper._target_.endswith("TunedSweeper") and head.hydra.sweeper.grid.points == 3
            assert "seed" not in params and head.seeds.on_demand and (head.seeds.start, head.seeds.max) == (3, 4)
            found[scale] = [(d, r, compose("config", overrides=["experiment=depth_study", f"scale={scale}",
                                                                f"depth={d}", f"residual={r}"]))
                            for d in params.depth.split(",") for r in params.residual.split(",")]
    GlobalHydra.instance().clear()
    return found


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_every_job_has_its_depth_the_papers_n_and_one_width(jobs, scale):
    assert sorted({r for _, r, _ in jobs[scale]}) == sorted(ARMS)
    widths = set()
    for depth, residual, cfg in jobs[scale]:
        L = 2 * cfg.model.n_layer
        assert f"L{L}" == depth and L in (8, 24, 48)
        with torch.device("meta"):
            model = instantiate(cfg.model, vocab_size=256, residual=instantiate(cfg.residual))
        if residual in ("block", "block_static"):
            assert model.residual.num_blocks == 8  # the paper's N at every depth
        if residual == "depth_scaled":
            assert model.residual.branch_multiplier == pytest.approx(4 / cfg.model.n_layer)
        widths.add(cfg.model.n_embd)
    assert len(widths) == 1


def test_the_comment_states_the_cpu_tokens_per_parameter_and_the_gpu_tokens(jobs):
    text = PRESET.read_text()
    tokens = {}
    for scale in ("cpu", "gpu"):
        cfg = jobs[scale][0][2]
        tokens[scale] = cfg.trainer.max_steps * cfg.data.batch_size * cfg.data.block_size
    stated = re.search(r"non-embedding parameter \(12 D\^2 n_layer\):\n"
                       r"# ([\d.]+) at 4 layers, ([\d.]+) at 12, ([\d.]+) at 24", text)
    assert stated, "the preset's comment states the tokens per parameter"
    D = jobs["cpu"][0][2].model.n_embd
    for layers, value in zip((4, 12, 24), stated.groups(), strict=True):
        assert float(value) == pytest.approx(tokens["cpu"] / (12 * D * D * layers), rel=0.02)
    assert f"{tokens['cpu'] / 1e6:.2f}M tokens a run" in text
    assert tokens["gpu"] == pytest.approx(20 * 12 * 512**2 * 24, rel=0.01) and "1.5G tokens a run" in text


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_cfg_job_composes_at_both_scales(tmp_path, scale):
    result = run_cli("--cfg", "job", "experiment=depth_study", f"scale={scale}", "depth=L48", "residual=block",
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "n_layer: 24" in result.stdout and f"n_embd: {40 if scale == 'cpu' else 512}" in result.stdout


@pytest.mark.slow
def test_a_tiny_study_finishes_on_cpu_and_the_section_reads_it(tmp_path):
    result = run_cli("-m", "experiment=depth_study", "depth=L8,L24", "residual=standard,depth_scaled",
                     "seeds.on_demand=false", "seed=0,1",
                     "shapes.cpu.steps=3", "shapes.cpu.val_every=3", "shapes.cpu.warmup=1",
                     "hydra.sweeper.grid.points=1", "hydra.sweeper.grid.max_extend=0",
                     "hydra.sweeper.tuning_seeds=[1000]", "data.max_files=40", "data.val_batches=1", "logger=none",
                     "callbacks=none", f"hydra.sweep.dir={tmp_path / 'runs' / depth_part.FOLDER}",
                     cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    # the part's 48-sublayer sweep: each arm at its 24-sublayer choice, through the real given sweeper
    carried = depth_part.carried_overrides(tmp_path / "runs")
    assert carried == ("hydra.sweeper.given={standard:{optim.optimizer.lr:0.012},"
                       "depth_scaled:{optim.optimizer.lr:0.012}}",)
    result = run_cli("-m", "experiment=depth_study", "depth=L48", "residual=standard,depth_scaled",
                     "hydra.sweeper.method=given", *carried, "seeds.on_demand=false", "seed=0,1",
                     "shapes.cpu.steps=3", "shapes.cpu.val_every=3", "shapes.cpu.warmup=1",
                     "data.max_files=40", "data.val_batches=1", "logger=none", "callbacks=none",
                     f"hydra.sweep.dir={tmp_path / 'runs' / depth_part.CARRIED}", cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no search (hydra.sweeper.method=given)" in result.stdout + result.stderr
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs")
    rows = [line for line in text if line.split(" | ")[0] in ("| 8", "| 24", "| 48")]
    assert len(rows) == 3 and all("| depth_scaled |" in row and "| 0, 1 |" in row for row in rows)
    assert "| 8 | " in rows[0] and "+0.00% [+0.00, +0.00]" in rows[0]  # m = 1 at the base depth: the same runs
    assert "| 0.012, carried from 24 (0.012) |" in rows[2]
    assert (tmp_path / "figs" / "depth_tuned.png").is_file()


# -- the section, from synthetic run folders --------------------------------------------------------------
def _fake_sweep(out, losses, lrs, tokens=1_638_400, folder=depth_part.FOLDER, load=None):
    """out/depth_tuned (or `folder`) as a tuned sweep writes it: losses[(residual, L)] = {seed: val/loss};
    load[seed] = (wall seconds, mean 1-minute load on 2 cores) as metrics.json records them."""
    sweep = out / folder
    arms, groups = [], []
    for (residual, L), per_seed in losses.items():
        label = f"{residual} depth=L{L}"
        jobs = {}
        for seed, loss in per_seed.items():
            job = f"depth=L{L},residual={residual},seed={seed}"
            (sweep / job).mkdir(parents=True)
            (sweep / job / "metrics.json").write_text(json.dumps({
                "status": "finished", "metrics": {"val/loss": loss}, "tokens_seen": tokens,
                "non_embedding_parameters": 19_200 * L // 2,
                **({"wall_time_s": load[seed][0], "machine_load": {"mean_1min": load[seed][1], "cpu_count": 2}}
                   if load else {})}))
            jobs[str(seed)] = job
        overrides = [f"depth=L{L}", f"residual={residual}", "experiment=depth_study"]
        arms.append({"label": label, "group": label, "overrides": overrides, "jobs": jobs})
        groups.append({"label": label, "chosen_values": {"optim.optimizer.lr": lrs[residual, L]},
                       "edge": "up" if residual == "block_static" else None})
    tuning.write_state(sweep, {"arms": arms, "groups": groups, "stage": "verdict"})


def test_the_section_from_no_runs_says_what_to_run(tmp_path):
    text, claims = depth_part.section(tmp_path / "runs", tmp_path / "figs")
    assert text == ["Not run yet: `python experiments/reproduce/run.py --parts depth_tuned`."] and claims == []


def test_the_section_pairs_each_arm_with_the_standard_at_each_depth(tmp_path):
    std = {0: 3.00, 1: 3.02, 2: 2.98}
    losses = {("standard", 8): std, ("block", 8): {0: 3.00, 1: 3.03, 2: 2.97},
              ("depth_scaled", 8): dict(std), ("block_static", 8): {0: 3.01, 1: 3.02, 2: 2.99},
              ("standard", 48): std, ("block", 48): {0: 2.90, 1: 2.91, 2: 2.87},
              ("depth_scaled", 48): {0: 3.00, 1: 3.01, 2: 2.99}, ("block_static", 48): {0: 2.99, 1: 3.03, 2: 2.97}}
    lrs = {k: 0.012 if k[0] != "block" else 0.024 for k in losses}
    _fake_sweep(tmp_path / "runs", losses, lrs)
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs")
    table = {(int(r.split(" | ")[0][2:]), r.split(" | ")[2]): r for r in text if re.match(r"\| (8|48) \|", r)}
    assert set(table) == {(L, a) for L in (8, 48) for a in ("block", "depth_scaled", "block_static")}
    for (L, arm), row in table.items():
        d = [100 * (losses[arm, L][s] - std[s]) / std[s] for s in (0, 1, 2)]
        mean = statistics.fmean(d)
        if statistics.stdev(d) > 0:  # a Bonferroni interval over the 3 arms of a depth, by hand
            half = stats.t.ppf(1 - 0.05 / 6, 2) * statistics.stdev(d) / math.sqrt(3)
            assert f"{mean:+.2f}% [{mean - half:+.2f}, {mean + half:+.2f}]" in row, row
        assert row.endswith("| 0, 1, 2 |")
        assert f"| {1_638_400 / (19_200 * L // 2):.2g} |" in row  # tokens per non-embedding parameter
    assert "0.024 (0.012)" in table[48, "block"] and "on the grid's edge" in table[48, "block_static"]
    assert "| better by at least the margin |" in table[48, "block"]  # -3.3% with a tight interval
    assert "| +0.00% [+0.00, +0.00] | equivalent within the margin |" in table[8, "depth_scaled"]
    answers = "\n".join(text)
    assert "Does the tuned gain grow with depth here? yes: the gap moves by -" in answers
    assert "from 8 to 48 sublayers, in the arm's favour" in answers
    assert "Does depth_scaled (" in answers and "it does not show it" in answers
    sd = {arm: statistics.stdev(losses[arm, 48].values()) for arm in ("standard", "block", "block_static",
                                                                       "depth_scaled")}
    assert (f"How noisy is it at 48 sublayers? The spread of val/loss across the verdict seeds (sd): standard "
            f"{sd['standard']:.3f}, block {sd['block']:.3f}, block_static {sd['block_static']:.3f}, depth_scaled "
            f"{sd['depth_scaled']:.3f};") in answers
    assert (tmp_path / "figs" / "depth_tuned.png").is_file()


def test_without_a_block_gain_the_controls_have_nothing_to_match(tmp_path):
    std = {0: 3.00, 1: 3.02, 2: 2.98}
    noisy = {0: 3.05, 1: 2.97, 2: 3.00}  # Block level with the standard: not resolved
    losses = {(arm, L): (std if arm == "standard" else noisy) for arm in ("standard", "block", "block_static")
              for L in (8, 48)}
    _fake_sweep(tmp_path / "runs", losses, {k: 0.012 for k in losses})
    answers = "\n".join(depth_part.section(tmp_path / "runs", tmp_path / "figs")[0])
    assert ("Does block_static (learned static mix (routing that ignores the input)) get it too? At 48 sublayers it "
            "is +0.23% [") in answers  # (+1.67 - 1.66 + 0.67) / 3
    assert "(not resolved): Block has no resolved gain at 48 sublayers for it to match." in answers


def test_a_gap_with_one_pair_gives_no_interval_and_no_winner(tmp_path):
    _fake_sweep(tmp_path / "runs", {("standard", 8): {0: 3.0}, ("block", 8): {0: 2.5}},
                {("standard", 8): 0.012, ("block", 8): 0.012})
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs")
    row = next(r for r in text if r.startswith("| 8 |"))
    assert "(one seed, no interval)" in row and "| not resolved: 1 seed" in row
    assert "Not answered yet: Block needs runs at two depths." in "\n".join(text)


def test_the_part_splices_its_section_into_the_report_and_keeps_the_rest(tmp_path, monkeypatch):
    import shutil

    report = pytest.importorskip("report")  # experiments/reproduce/report.py
    shutil.copy(report.HERE / "REPORT.md", tmp_path / "REPORT.md")
    before = (tmp_path / "REPORT.md").read_text()
    monkeypatch.setattr(report, "HERE", tmp_path)
    for _ in range(2):  # twice: replaced where it stands, never added again
        written, kept = report.update_report(tmp_path / "runs", ["depth_tuned"])
    text = written.read_text()
    assert written == tmp_path / "REPORT.md" and "section(s) of part(s) depth_tuned updated" in kept
    assert text.count(f"## {depth_part.TITLE}") == 1 and text.count("| depth_tuned |") == 1
    assert "Not run yet: `python experiments/reproduce/run.py --parts depth_tuned`." in text
    assert text.index(f"## {depth_part.TITLE}") < text.index("## Not run at this scale")
    head = before.split("## Not run at this scale")[0]
    assert text.startswith(head.split("| tasks |")[0])  # the verdicts and the rows above kept as written


def test_the_section_is_kept_as_a_record_and_rebuilt_from_it_without_the_runs(tmp_path):
    import shutil

    std = {0: 3.00, 1: 3.02, 2: 2.98}
    losses = {("standard", 8): std, ("block", 8): {0: 2.95, 1: 2.99, 2: 2.94},
              ("standard", 24): std, ("block", 24): {0: 2.90, 1: 2.93, 2: 2.89}}
    _fake_sweep(tmp_path / "runs", losses, {k: 0.012 for k in losses})
    kept = tmp_path / "results"
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs", record=kept)
    saved = json.loads((kept / "depth_tuned.json").read_text())
    assert {(r["residual"], r["depth"], r["seed"]) for r in saved["runs"] if r["stage"] == "verdict"} == \
        {(a, f"L{L}", s) for (a, L) in losses for s in (0, 1, 2)}
    shutil.rmtree(tmp_path / "runs")  # another machine: the record alone
    again, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs2", record=kept)
    rows = [r for r in text if r.startswith("| 8 |") or r.startswith("| 24 |")]
    assert rows and rows == [r for r in again if r.startswith("| 8 |") or r.startswith("| 24 |")]
    assert "Built from results/depth_tuned.json" in again[0] and "Built from" not in text[0]
    assert depth_part.section(tmp_path / "runs", tmp_path / "figs3")[0][0].startswith("Not run yet")  # no record given


def test_seeds_on_demand_give_the_designs_repeated_interval(tmp_path):
    from attnres.results import sequential

    std = {0: 3.00, 1: 3.02, 2: 2.98, 3: 3.01}
    block = {0: 2.95, 1: 2.99, 2: 2.94, 3: 2.97}
    _fake_sweep(tmp_path / "runs", {("standard", 8): std, ("block", 8): block}, {("standard", 8): 0.012,
                                                                                 ("block", 8): 0.012})
    design = {"design": {"first": 0, "start": 3, "batch": 1, "max": 4, "alpha": 0.05}, "looks": [[0, 1, 2], [3]],
              "final": True}
    (tmp_path / "runs" / depth_part.FOLDER / sequential.RECORD).write_text(json.dumps(design))
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs")
    d = {s: 100 * (block[s] - std[s]) / std[s] for s in std}
    low, high = sequential.repeated_interval(d, design["looks"], 4, 0.05, True)
    row = next(r for r in text if r.startswith("| 8 |"))
    assert f"[{low:+.2f}, {high:+.2f}]" in row, row
    plain = stats.t.ppf(0.975, 3) * statistics.stdev(d.values()) / math.sqrt(4)
    assert high - low > 2 * plain  # wider than the fixed-n interval a naive look would print
    assert "repeated interval" in text[0] and "looks at 8 sublayers: 0, 1, 2; 3)" in text[0]


# -- the 48-sublayer sweep, at each arm's 24-sublayer choice -------------------------------------------------
def test_the_deepest_sweep_is_given_each_arms_choice_one_depth_shallower(tmp_path):
    lrs = {("standard", 8): 0.012, ("block", 8): 0.012, ("standard", 24): 0.006, ("block", 24): 0.024}
    _fake_sweep(tmp_path, {k: {0: 3.0} for k in lrs}, lrs)
    assert depth_part.carried_overrides(tmp_path) == \
        ("hydra.sweeper.given={standard:{optim.optimizer.lr:0.006},block:{optim.optimizer.lr:0.024}}",)


def test_the_deepest_sweep_waits_for_every_arms_choice(tmp_path):
    with pytest.raises(ValueError, match=r"has not chosen any yet: run the part again to finish its search first"):
        depth_part.carried_overrides(tmp_path)  # no sweep at all
    lrs = {("standard", 24): 0.012, ("block", 24): None, ("block_static", 24): None, ("standard", 8): 0.012}
    _fake_sweep(tmp_path, {k: {0: 3.0} for k in lrs}, lrs)
    with pytest.raises(ValueError, match=r"has not chosen those of block, block_static yet"):
        depth_part.carried_overrides(tmp_path)


def test_the_section_reads_both_sweeps_and_says_what_was_carried(tmp_path):
    from attnres.results import sequential

    std = {0: 3.00, 1: 3.02, 2: 2.98}
    shallow = {("standard", 8): std, ("block", 8): {0: 2.99, 1: 3.01, 2: 2.97},
               ("standard", 24): std, ("block", 24): {0: 2.96, 1: 2.98, 2: 2.95}}
    _fake_sweep(tmp_path / "runs", shallow, {("standard", 8): 0.012, ("block", 8): 0.012,
                                             ("standard", 24): 0.012, ("block", 24): 0.006})
    deep = {("standard", 48): std, ("block", 48): {0: 2.90, 1: 2.92, 2: 2.91, 3: 2.9}}
    deep["standard", 48] = {**std, 3: 3.0}
    _fake_sweep(tmp_path / "runs", deep, {("standard", 48): 0.012, ("block", 48): 0.006},
                folder=depth_part.CARRIED)
    design = {"design": {"first": 0, "start": 3, "batch": 1, "max": 4, "alpha": 0.05}, "looks": [[0, 1, 2], [3]],
              "final": True}
    (tmp_path / "runs" / depth_part.CARRIED / sequential.RECORD).write_text(json.dumps(design))
    kept = tmp_path / "results"
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs", record=kept)
    rows = {int(r.split(" | ")[0][2:]): r for r in text if re.match(r"\| (8|24|48) \|", r)}
    assert set(rows) == {8, 24, 48}
    assert "| 0.006, carried from 24 (0.012) |" in rows[48] and "carried" not in rows[24]
    assert rows[48].endswith("| 0, 1, 2, 3 |") and rows[24].endswith("| 0, 1, 2 |")
    d = {s: 100 * (deep["block", 48][s] - deep["standard", 48][s]) / deep["standard", 48][s] for s in range(4)}
    low, high = sequential.repeated_interval(d, design["looks"], 4, 0.05, True)  # the 48 sweep's own design
    assert f"[{low:+.2f}, {high:+.2f}]" in rows[48]
    assert "[" in rows[24] and f"[{low:+.2f}" not in rows[24]
    assert "At 48 sublayers there was no search: each arm ran at the lr it chose at 24" in text[0]
    assert "standard 0.012 at both; block 0.012 -> 0.006." in text[0]
    assert "looks at 48 sublayers: 0, 1, 2; 3)" in text[0]
    saved = json.loads((kept / "depth_tuned.json").read_text())
    assert {r["sweep"] for r in saved["runs"]} == {depth_part.FOLDER, depth_part.CARRIED}
    assert saved["extra"]["seeds"][depth_part.CARRIED] == design
    import shutil

    shutil.rmtree(tmp_path / "runs")  # another machine: the record alone gives the same rows
    again, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs2", record=kept)
    assert [r for r in again if re.match(r"\| (8|24|48) \|", r)] == [rows[8], rows[24], rows[48]]


@pytest.mark.parametrize(("part", "says"), [
    ({"wall_s": 5 * 3600.0, "complete": False},
     "The part's budget of 4 hours was spent (5.00 h of wall time) before every run finished"),
    ({"wall_s": 3600.0, "complete": False}, "Not finished: 1.00 h of its 4-hour budget spent so far; `python "
                                            "experiments/reproduce/run.py --parts depth_tuned` continues it."),
    ({"wall_s": 3.5 * 3600, "complete": True}, "Wall time: 3.50 h of this 2-core machine (budget 4 h)."),
    ({"wall_s": 5 * 3600.0, "complete": True}, "Wall time: 5.00 h, past the part's budget of 4 hours of wall time: "
                                               "it was continued with run.py's `--over-budget`."),
], ids=["spent", "going", "done", "past"])
def test_the_section_says_where_the_parts_budget_stands(tmp_path, part, says):
    std = {0: 3.00, 1: 3.02, 2: 2.98}
    _fake_sweep(tmp_path / "runs", {("standard", 8): std, ("block", 8): std}, {("standard", 8): 0.012,
                                                                            ("block", 8): 0.012})
    (tmp_path / "runs" / "state.json").write_text(json.dumps({"depth_tuned": part}))
    kept = tmp_path / "results"
    text, _ = depth_part.section(tmp_path / "runs", tmp_path / "figs", record=kept)
    assert says in text[0]
    import shutil

    shutil.rmtree(tmp_path / "runs")  # the record keeps the clock too
    assert says in depth_part.section(tmp_path / "runs", tmp_path / "figs", record=kept)[0][0]


def test_a_part_past_its_budget_says_how_much_of_the_machine_its_runs_had(tmp_path):
    """Seeds 0 and 1 trained alone (load 2 on 2 cores), seed 2 beside other work (load 4: half a core):
    the section counts it, and the machine's hours the part used, from the runs and from the record."""
    std = {0: 3.00, 1: 3.02, 2: 2.98}
    load = {0: (1800.0, 2.0), 1: (1800.0, 2.2), 2: (3600.0, 4.0)}
    _fake_sweep(tmp_path / "runs", {("standard", 8): std, ("block", 8): std},
                {("standard", 8): 0.012, ("block", 8): 0.012}, load=load)
    (tmp_path / "runs" / "state.json").write_text(json.dumps({"depth_tuned": {"wall_s": 5 * 3600.0,
                                                                              "complete": True}}))
    share = (2 * (1800 + 1800 * min(1, 2 / 2.2) + 3600 * 0.5)) / (2 * 7200)  # run-hours weighted by core share
    says = ("past the part's budget of 4 hours of wall time: it was continued with run.py's `--over-budget` because "
            "other work shared the machine for part of it: 2 of its 6 runs (2.0 of 4.0 run-hours) trained at a "
            "mean 1-minute load above 1.5 times the cores, beside other work; counting each run at the share of a "
            f"core it had (cores / load, at most 1), the part used about {5 * share:.1f} h of the machine.")
    kept = tmp_path / "results"
    assert says in depth_part.section(tmp_path / "runs", tmp_path / "figs", record=kept)[0][0]
    import shutil

    shutil.rmtree(tmp_path / "runs")  # the record keeps each run's load
    assert says in depth_part.section(tmp_path / "runs", tmp_path / "figs", record=kept)[0][0]
    assert depth_part.machine_share([{"wall_time_s": 60.0}]) is None  # older runs: no load recorded
