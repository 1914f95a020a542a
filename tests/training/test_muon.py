"""optim=muon (attnres/training/optimizers.py): Muon takes exactly the hidden weight matrices and
AdamW everything else (embeddings, LM head, norms, biases, every residual-strategy parameter, the
pseudo-queries at their own rate); the pair steps as the two optimisers would apart; its state
continues bit for bit through a save and load, with the schedule on both; bad settings are one
line; and through the CLI a resumed Muon run equals an uninterrupted one, as AdamW's does."""

from __future__ import annotations

import copy
import io
from functools import partial

import pytest
import torch

from attnres import BlockAttentionResidual, HyperConnectionResidual
from attnres.model import Transformer
from attnres.training.lit import LitLanguageModel, parameter_groups
from attnres.training.optimizers import MuonWithAdamW, describe_optimizer
from tests.helpers import CONF, TINY, check_exact_resume, one_line_error, run_cli

MUON = {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05, "ns_steps": 5,
        "adjust_lr_fn": "match_rms_adamw"}
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def model(residual=None, tie: bool = False, bias: bool = True) -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=50, n_layer=2, n_head=2, n_embd=16, block_size=8, bias=bias,
                       tie_embeddings=tie, residual=residual)


def hidden_matrices(m: Transformer) -> set[int]:
    """The 2-D weights of the attention and MLP sublayers, by hand."""
    return {id(s.qkv.weight) if hasattr(s, "qkv") else id(s.up.weight) for s in m.sublayers} | \
        {id(s.proj.weight) if hasattr(s, "proj") else id(s.down.weight) for s in m.sublayers}


RESIDUALS = {
    "standard": None,
    "block-input-query": partial(BlockAttentionResidual, num_blocks=2, query="input"),  # a D x D query map
    "hc": partial(HyperConnectionResidual, expansion_rate=2),  # 2-D dynamic weights of the residual
}


@pytest.mark.parametrize("residual", RESIDUALS.values(), ids=RESIDUALS.keys())
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(residual):
    m = model(residual)
    groups = {g["name"]: g for g in parameter_groups(m, query_lr_scale=0.1, hidden_matrices=True)}
    assert {id(p) for p in groups["hidden_matrix"]["params"]} == hidden_matrices(m)
    assert [id(p) for p in groups["decay"]["params"]] == [id(m.head.weight)]  # untied LM head: AdamW, decayed
    residual_ids = {id(p) for p in m.residual.parameters()}
    others = {id(p) for name, g in groups.items() if name != "hidden_matrix" for p in g["params"]}
    assert residual_ids <= others and id(m.embed.weight) in others
    assert len(others) + len(hidden_matrices(m)) == len(list(m.parameters()))
    if "pseudo_query" in groups:
        assert groups["pseudo_query"]["lr_scale"] == 0.1 and groups["pseudo_query"]["weight_decay"] == 0.0
    # without Muon the groups are AdamW's as before: no hidden_matrix group
    assert "hidden_matrix" not in {g["name"] for g in parameter_groups(m, query_lr_scale=0.1)}

    optimizer = MuonWithAdamW(parameter_groups(m, 0.1, hidden_matrices=True), **ADAMW, muon=MUON)
    assert {id(p) for g in optimizer.muon.param_groups for p in g["params"]} == hidden_matrices(m)
    assert {id(p) for g in optimizer.adamw.param_groups for p in g["params"]} == others
    assert optimizer.param_groups == optimizer.muon.param_groups + optimizer.adamw.param_groups


def test_the_lightning_module_builds_it_with_both_rates_and_the_query_scale():
    m = model(RESIDUALS["block-input-query"], tie=True)
    module = LitLanguageModel(m, optimizer=partial(MuonWithAdamW, **ADAMW, muon=MUON), schedule=None,
                              query_lr_scale=0.25)
    optimizer = module.configure_optimizers()
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == {"hidden_matrix": 0.02, "no_decay": 3e-3, "pseudo_query": pytest.approx(3e-3 * 0.25)}
    assert "decay" not in lrs  # the LM head is the embedding (tied): nothing AdamW decays


def _grads(m: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_one_step_is_muon_and_adamw_apart():
    """The pair equals torch.optim.Muon on the hidden groups and AdamW on the others, stepped alone."""
    a = model(RESIDUALS["block-input-query"])
    b = copy.deepcopy(a)
    joint = MuonWithAdamW(parameter_groups(a, 0.1, hidden_matrices=True), **ADAMW, muon=MUON)
    groups = parameter_groups(b, 0.1, hidden_matrices=True)
    apart = [torch.optim.Muon([g for g in groups if g["name"] == "hidden_matrix"], **MUON),
             torch.optim.AdamW([g for g in groups if g["name"] != "hidden_matrix"], **ADAMW)]
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        joint.step()
        for optimizer in apart:
            optimizer.step()
    moved = [not torch.equal(p, q) for p, q in zip(a.parameters(), model(RESIDUALS["block-input-query"]).parameters(),
                                                    strict=True)]
    assert all(moved), "a parameter did not move"
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def _train(m, optimizer, scheduler, steps: range) -> None:
    for step in steps:
        _grads(m, step)
        optimizer.step()
        scheduler.step()


def _pair(m):
    optimizer = MuonWithAdamW(parameter_groups(m, 0.1, hidden_matrices=True), **ADAMW, muon=MUON)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def test_state_continues_bit_for_bit_with_the_schedule_on_both():
    whole = model()
    optimizer, scheduler = _pair(whole)
    _train(whole, optimizer, scheduler, range(6))

    split = model()
    optimizer, scheduler = _pair(split)
    _train(split, optimizer, scheduler, range(3))
    buffer = io.BytesIO()  # as a checkpoint holds it, and Lightning loads it (weights_only)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "weights": split.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = model()
    resumed.load_state_dict(saved["weights"])
    optimizer, scheduler = _pair(resumed)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    # the loaded groups are the ones both optimisers step with, so the schedule reaches both
    assert optimizer.param_groups[0] is optimizer.muon.param_groups[0]
    assert optimizer.param_groups[-1] is optimizer.adamw.param_groups[-1]
    _train(resumed, optimizer, scheduler, range(3, 6))
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(MUON["lr"] / 7)
    assert optimizer.adamw.param_groups[0]["lr"] == pytest.approx(ADAMW["lr"] / 7)
    for (name, p), q in zip(whole.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs between the resumed and the uninterrupted optimiser"


def test_states_written_back_stay_with_their_optimiser_and_other_states_are_refused():
    m = model()
    optimizer, scheduler = _pair(m)
    _train(m, optimizer, scheduler, range(1))
    for p, state in list(optimizer.state.items()):  # what Lightning does to move states to a device
        optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    assert len(optimizer.state) == len(optimizer.muon.state) + len(optimizer.adamw.state) == len(list(m.parameters()))
    optimizer.state_dict()  # every state still belongs to a parameter of its own optimiser
    with pytest.raises(ValueError, match="saved by another optimiser"):
        optimizer.load_state_dict(torch.optim.AdamW(m.parameters()).state_dict())


def test_the_start_line_names_both_rates():
    assert describe_optimizer({"_target_": "torch.optim.AdamW", "lr": 3e-3}) == "lr 0.003"
    words = describe_optimizer({"_target_": "attnres.training.optimizers.MuonWithAdamW", "lr": 3e-3,
                                "muon": {"lr": 0.02}})
    assert words.startswith("Muon lr 0.02 on hidden matrices, AdamW lr 0.003 on embeddings")


@pytest.mark.parametrize(("override", "words"), [
    ("optim.optimizer.muon.adjust_lr_fn=keller", "choose one of: match_rms_adamw, original"),
    ("optim.optimizer.muon.momentum=1.5", "optim.optimizer.muon.momentum=1.5 is out of range"),
    ("optim.optimizer.betas=[1.5,0.9]", "must be two numbers in [0, 1)"),
])
def test_bad_muon_settings_are_one_line(override, words, capsys):
    from attnres.config.command import check_command_line
    from attnres.config.errors import user_errors

    with pytest.raises(SystemExit) as stop, user_errors():
        check_command_line(["optim=muon", override], CONF)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnres-run: error:") and "\n" not in err and words in err


@pytest.mark.slow
def test_muon_resume_equals_uninterrupted(tmp_path):
    """tests/training/test_checkpoints.py's exact-resume test, under optim=muon."""
    common = [*TINY, "optim=muon", "residual=block", "num_blocks=2", "trainer.val_check_interval=4",
              "optim.total_steps=8", "optim.schedule.warmup_steps=2"]
    whole = check_exact_resume(tmp_path, common)
    assert "Muon lr 0.03 on hidden matrices, AdamW lr 0.003" in whole.stdout + whole.stderr  # the start line
    saved = torch.load(tmp_path / "split/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    assert set(saved["optimizer_states"][0]) == {"muon", "adamw"} and saved["optimizer_states"][0]["muon"]["state"]


@pytest.mark.slow
def test_an_adamw_checkpoint_does_not_continue_under_muon(tmp_path):
    trained = run_cli(*TINY, "trainer.max_steps=2", "hydra.run.dir=R", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    line = one_line_error(run_cli(*TINY, "optim=muon", "trainer.max_steps=4", "hydra.run.dir=R", "resume=true",
                                  cwd=tmp_path))
    assert "optim.optimizer" in line


def test_plain_parameters_split_by_shape_as_torch_s_own_example():
    m = model()
    optimizer = MuonWithAdamW(m.parameters(), **ADAMW, muon=MUON)
    assert all(p.ndim == 2 for g in optimizer.muon.param_groups for p in g["params"])
    assert all(p.ndim != 2 for g in optimizer.adamw.param_groups for p in g["params"])
