"""summary.png (attnres/results/summary_figure.py) of sweeps whose runs validated once, twice and
often: every configuration's validation is drawn where it can be seen (a point when there is one
validation), and no panel has a legend without the data it names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from attnres.results.summary import attach_verdicts, collect_rows, primary_metric
from attnres.results.summary_figure import summary_figure

BPB = {"standard": 2.0, "block": 1.9}


def _job(folder: Path, residual: str, seed: int, steps: list[int]) -> None:
    """A finished run folder: its config, metrics.json, and Val/bpb at `steps` in its events."""
    from torch.utils.tensorboard import SummaryWriter

    (folder / ".hydra").mkdir(parents=True)
    cfg = {"seed": seed, "num_blocks": 2, "model": {"n_layer": 2},
           "residual": {"_target_": f"attnres.{residual}", **({"num_blocks": 2} if residual == "block" else {})}}
    OmegaConf.save(OmegaConf.create(cfg), folder / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"residual": residual}}}}),
                   folder / ".hydra" / "hydra.yaml")
    (folder / ".hydra" / "overrides.yaml").write_text(f"- residual={residual}\n- seed={seed}\n")
    final = BPB[residual] + (0.03 if residual == "standard" else 0.05) * seed
    writer = SummaryWriter(str(folder))
    for i, step in enumerate(steps):
        writer.add_scalar("Val/bpb", final + 2.0 * (len(steps) - 1 - i) / len(steps), step)
    writer.close()
    (folder / "metrics.json").write_text(f'{{"status": "finished", "metrics": {{"val/bpb": {final}}}}}')


def sweep_figure(folder: Path, steps: list[int], seeds: int = 3):
    for residual in BPB:
        for seed in range(seeds):
            _job(folder / f"residual={residual},seed={seed}", residual, seed, steps)
    rows = collect_rows(folder)
    metric = primary_metric(rows)
    return summary_figure(attach_verdicts(rows, metric), rows, metric, folder.name)


def drawn(ax) -> list:
    """The artists of `ax` that show data: a line of two points or more, a marker, a filled area or
    a set of points (scatter, error bars)."""
    lines = [ln for ln in ax.lines if len(ln.get_xdata()) >= 2 and ln.get_linestyle() not in ("None", "")
             or ln.get_marker() not in (None, "None", "", " ")]
    return lines + [c for c in ax.collections if len(c.get_paths()) or len(c.get_offsets())]


CASES = {"one validation": [20], "two validations": [10, 20], "a long run": list(range(50, 1550, 50))}


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_every_configuration_is_drawn_and_no_legend_is_empty(tmp_path, steps):
    fig = sweep_figure(tmp_path / "sweep", steps)
    left, right = fig.axes
    assert drawn(left), "the differences panel is empty"
    if len(steps) == 1:  # a point per configuration, side by side, its seeds' range as a bar
        points = [ln for ln in right.lines if ln.get_marker() == "o"]
        assert len(points) == len(BPB) and len({float(ln.get_xdata()[0]) for ln in points}) == len(BPB)
        assert [t.get_text().split("\n")[0] for t in right.get_xticklabels()] == sorted(BPB)
        assert sum(len(c.get_segments()) for c in right.collections if hasattr(c, "get_segments")) == len(BPB)
        assert "step 20" in right.get_title()
    for config in BPB if len(steps) > 1 else ():  # each configuration's mean, where it can be seen
        mean = [ln for ln in right.lines if ln.get_label().startswith(f"{config} (")]
        assert len(mean) == 1 and mean[0] in drawn(right), f"{config}: no visible validation"
        assert list(mean[0].get_xdata()) == steps
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            assert drawn(ax), "a legend on an empty panel"
            named = {t.get_text() for t in legend.get_texts()}
            assert named <= {a.get_label() for a in drawn(ax)}, "the legend names lines that are not drawn"


def test_a_sweep_without_curves_says_so_without_a_legend(tmp_path):
    fig = sweep_figure(tmp_path / "sweep", [])
    right = fig.axes[1]
    assert right.get_legend() is None and not drawn(right)
    assert any("no val/bpb curves" in t.get_text() for t in right.texts)


def test_the_long_curve_is_a_line_with_its_band(tmp_path):
    fig = sweep_figure(tmp_path / "sweep", CASES["a long run"])
    right = fig.axes[1]
    assert all(ln.get_marker() in (None, "None", "") for ln in right.lines)  # 30 points: a plain line
    assert len([c for c in right.collections if len(c.get_paths())]) == 2  # a band per configuration
    values = np.concatenate([ln.get_ydata() for ln in right.lines])
    assert values.min() == pytest.approx(BPB["block"] + 0.05, abs=1e-6)  # the mean of seeds 0, 1, 2
