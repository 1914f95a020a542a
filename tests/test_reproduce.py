"""The CPU study (experiments/reproduce/): its shapes and budgets as STUDY_PLAN.md states them
(parameters counted on the meta device), the verdict rule of REPORT.md, a report built from no
runs, and run.py's refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from tests.helpers import REPO, cli_env

HERE = REPO / "experiments" / "reproduce"
sys.path.insert(0, str(HERE))
report = pytest.importorskip("report")  # experiments/reproduce/report.py
VOCAB = 1024
TOKENS_PER_STEP = 16 * 128


@pytest.fixture(scope="module")
def study():
    """shape -> (non-embedding parameters, all parameters, tokens) of experiment=repro_study."""
    GlobalHydra.instance().clear()
    found = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for shape in ("deep", "shallow", "w16", "w24", "w32"):
            cfg = compose("config", overrides=[f"hydra.searchpath=[file://{HERE / 'conf'}]", "experiment=repro_study",
                                               f"shape={shape}", "residual=block", "num_blocks=2"])
            assert (cfg.data.block_size, cfg.data.batch_size) == (128, 16)
            with torch.device("meta"):
                model = instantiate(cfg.model, vocab_size=VOCAB, residual=instantiate(cfg.residual))
            found[shape] = (model.num_parameters(exclude_embedding=True), model.num_parameters(),
                            cfg.trainer.max_steps * TOKENS_PER_STEP, cfg)
    GlobalHydra.instance().clear()
    return found


def test_the_study_trains_every_shape_on_at_least_20_tokens_per_parameter(study):
    for shape, (_, total, tokens, cfg) in study.items():
        assert tokens / total >= 20, (shape, tokens / total)
        assert cfg.optim.schedule.warmup_steps == round(0.05 * cfg.trainer.max_steps)  # 5% warm-up
        assert cfg.trainer.max_steps // cfg.trainer.val_check_interval == 10  # ten points on each curve


def test_deep_and_shallow_have_equal_non_embedding_parameters_and_the_ladder_one_ratio(study):
    deep, shallow = study["deep"], study["shallow"]
    assert (deep[3].model.n_layer, deep[3].model.n_embd, shallow[3].model.n_layer, shallow[3].model.n_embd) == \
        (8, 40, 2, 80)
    assert abs(deep[0] - shallow[0]) / deep[0] < 0.01  # Block's pseudo-queries differ, the matrices do not
    ratios = [tokens / total for _, total, tokens, _ in (study[s] for s in ("w16", "w24", "w32", "deep"))]
    assert max(ratios) / min(ratios) < 1.03, ratios  # the compute ladder: one tokens-per-parameter ratio
    assert [study[s][3].model.n_layer for s in ("w16", "w24", "w32")] == [8, 8, 8]


@pytest.mark.parametrize(("seeds", "paper", "word"), [
    ([-1.0, -1.2, -0.9, -1.1, -1.3], [-1.1, -1.5], "reproduced"),     # below zero, the paper's side
    ([-0.3, -0.25, -0.35, -0.3, -0.28], [-1.1, -1.5], "reproduced"),  # the side, not the size
    ([0.1, -0.1, 0.05, -0.05, 0.0], [-1.1, -1.5], "contradicted"),   # holds zero, excludes the paper's effect
    ([0.5, 0.6, 0.55, 0.45, 0.5], [-1.1, -1.5], "contradicted"),     # the other side
    ([0.5, -2.0, 0.3, -1.5, 0.2], [-1.1, -1.5], "not resolved"),     # holds both
    ([-0.5], [-1.1], "not resolved"),                                # one seed: no interval
])
def test_the_verdict_rule(seeds, paper, word):
    effect = report.Effect(dict(enumerate(seeds)))
    assert report.verdict(effect, paper) == word
    flipped = report.Effect({k: -v for k, v in effect.per_seed.items()})
    assert report.verdict(flipped, [-p for p in paper], lower=False) == word  # a claim that something grows


def test_a_report_from_no_runs_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "HERE", tmp_path)  # REPORT.md and figures/ go here, not into the repository
    written = report.write_report(tmp_path / "runs")
    text = written.read_text()
    assert written == tmp_path / "REPORT.md"
    assert "No runs yet: `python experiments/reproduce/run.py --parts ordering`." in text
    assert "No runs yet: `python experiments/reproduce/run.py --parts ladder`." in text
    assert "| ordering | standard, Block N=4, Full at the deep shape x 5 seeds | not run |" in text


def test_run_py_refuses_an_unknown_part_in_one_line():
    ran = subprocess.run([sys.executable, str(HERE / "run.py"), "--parts", "shapes"], env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2
    assert ran.stderr.strip() == ("run.py: unknown part shapes; choose from prepare, ordering, blocksize, depth, "
                                  "tuned, ladder")
