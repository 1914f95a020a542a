"""attnres-export and the exported model under a hostile user (issue "Trust, round three"): a run
continued and killed is not exported with another step's numbers; --overwrite replaces an earlier
export and nothing else; a full or read-only disk, a damaged config or metrics.json, a checkpoint
that does not fit its config and a damaged model.safetensors are each one line; a killed export is
cleaned up or restored by the next; the byte-level tokenizer pads; an empty prompt is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attnres[hf]'")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from attnres.export.main import export  # noqa: E402
from attnres.training.checkpoints import checkpoint_step  # noqa: E402
from tests import helpers  # noqa: E402
from tests.hf.shared import DATA, RUNS  # noqa: E402  (`runs`: tests/hf/conftest.py)
from tests.hf.test_export import export_cli, one_line  # noqa: E402

pytestmark = pytest.mark.slow


def files(folder: Path) -> dict[str, bytes]:
    """Every file below `folder`, by relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# -- item 1: a continued run that is killed ------------------------------------------------------
def test_a_continued_run_killed_midway_is_not_exported_with_the_old_numbers(runs, tmp_path):
    run = helpers.copy_run(runs / "block", tmp_path / "run")
    first = json.loads((run / "metrics.json").read_text())
    assert first["status"] == "finished" and first["steps"] == 10
    go_on = [*RUNS["block"], f"hydra.run.dir={run}", "resume=true", "trainer.max_steps=30",
             "trainer.val_check_interval=5", "callbacks=default", "~callbacks.depth_dashboard",
             ]  # checkpoints at each validation
    killed = helpers.run_cli(*go_on, "+callbacks.fault._target_=faultinject.KillAt", "+callbacks.fault.step=22",
                             cwd=tmp_path, env=helpers.faultinject_env())
    assert killed.returncode == -9, killed.stderr[-3000:]
    record = json.loads((run / "metrics.json").read_text())
    assert record["status"] == "running" and record["previous_status"] == "finished" and record["previous_steps"] == 10
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 20
    refused = one_line(export_cli(run, tmp_path / "hf", cwd=tmp_path))
    assert "did not end" in refused and "resume=true" in refused, refused
    assert not (tmp_path / "hf").exists()
    from attnres.results.summary import _job_row

    assert _job_row(run)["status"] == "unfinished"  # what a sweep summary (and so a verdict) reads
    finished = helpers.run_cli(*go_on, cwd=tmp_path)  # resume=true does not take it for finished
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "nothing to do" not in finished.stdout
    final = json.loads((run / "metrics.json").read_text())
    assert final["status"] == "finished" and final["steps"] == 30
    done = export_cli(run, tmp_path / "hf", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"exported {run / 'checkpoints' / 'last.ckpt'} (finished at step 30; "
                                  f"val/bpb {final['metrics']['val/bpb']:.4f}"), done.stdout
    # best.ckpt is labelled with its own score, not the last validation's
    info = export(run, tmp_path / "best", checkpoint="best")
    state = torch.load(run / "checkpoints" / "best.ckpt", weights_only=False, map_location="cpu")
    (score,) = [v["best_model_score"] for k, v in state["callbacks"].items() if "ModelCheckpoint" in k]
    assert info["metrics"] == {"val/loss (best)": pytest.approx(float(score))}


def test_an_interrupted_run_says_which_step_its_numbers_are_from(runs, tmp_path):
    run = helpers.copy_run(runs / "block", tmp_path / "run")
    go_on = [*RUNS["block"], f"hydra.run.dir={run}", "resume=true", "trainer.max_steps=30",
             "trainer.val_check_interval=5", "+callbacks.fault._target_=faultinject.KillAt", "+callbacks.fault.step=17",
             "+callbacks.fault.sig=TERM"]
    stopped = helpers.run_cli(*go_on, cwd=tmp_path, env=helpers.faultinject_env())
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    record = json.loads((run / "metrics.json").read_text())
    assert (record["status"], record["steps"], record["validation_step"]) == ("interrupted", 17, 15)
    done = export_cli(run, tmp_path / "hf", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith(f"exported {run / 'checkpoints' / 'last.ckpt'} (interrupted at step 17; val/bpb "), first
    assert first.endswith("(its last validation, at step 15))"), first


# -- item 2: what --overwrite may replace ------------------------------------------------------
def test_overwrite_replaces_an_earlier_export_and_refuses_anything_else(runs, tmp_path):
    run = helpers.copy_run(runs / "block", tmp_path / "run")
    other = helpers.copy_run(runs / "full", tmp_path / "other")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    kept = {p: files(p) for p in (run, other, tmp_path / "mine")}
    cases = {
        run / "checkpoints": "lies inside the run folder",
        run / ".hydra": "lies inside the run folder",
        run / "hf": "lies inside the run folder",
        other: "is a run folder",
        other / "checkpoints": "lies inside the run folder",
        tmp_path / "mine": "is not an earlier export (it has no attnres config.json)",
        tmp_path: "holds the run",
    }
    (tmp_path / "afile").write_text("")
    cases[tmp_path / "afile" / "hf"] = "cannot be made: " + str(tmp_path / "afile") + " is a file"
    for out, said in cases.items():
        assert said in one_line(export_cli(run, out, "--overwrite", cwd=tmp_path)), out
    assert {p: files(p) for p in kept} == kept  # not one byte of any of them changed
    assert export_cli(run, tmp_path / "hf", cwd=tmp_path).returncode == 0
    (tmp_path / "hf" / "README.md").write_text("a note of my own")
    said = one_line(export_cli(run, tmp_path / "hf", "--overwrite", cwd=tmp_path))
    assert "it holds README.md, which no export writes" in said
    (tmp_path / "hf" / "README.md").unlink()
    again = export_cli(other, tmp_path / "hf", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["residual"]["_target_"].endswith("Full"
                                                                                                      "AttentionResidual")


# -- item 3: a disk that cannot take the export --------------------------------------------------
@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(runs, tmp_path, disk):
    where = tmp_path / "disk"
    with helpers.small_disk(where, "64k"):
        if disk == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        said = one_line(export_cli(runs / "block", where / "hf", cwd=tmp_path))
        assert ("the disk is full" if disk == "full" else "Read-only file system") in said, said
        assert "nothing was exported and nothing lost" in said
        assert os.listdir(where) == []


# -- items 7 and 9: damaged records -----------------------------------------------------------
def _config(run: Path) -> Path:
    return run / ".hydra" / "config.yaml"


DAMAGES = {
    "config-unparsable": (lambda run: _config(run).write_text("model: [unclosed\n  x: {"),
                          "config.yaml does not parse"),
    "config-empty": (lambda run: _config(run).write_text(""), "config.yaml holds no model section"),
    "metrics-empty": (lambda run: (run / "metrics.json").write_text(""), "metrics.json is empty or damaged"),
    "metrics-truncated": (lambda run: (run / "metrics.json").write_text('{"status": "fini'),
                          "metrics.json is empty or damaged"),
    "config-wider": (lambda run: _config(run).write_text(_config(run).read_text().replace("n_embd: 32", "n_embd: 64")),
                     "embed.weight is [256, 32] in the checkpoint, [256, 64] in the config"),
    "config-deeper": (lambda run: _config(run).write_text(_config(run).read_text().replace("n_layer: 2", "n_layer: 3")),
                      "key(s) missing from the checkpoint: sublayers.4."),
}


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_record_is_one_line_naming_what(runs, tmp_path, case):
    damage, said = DAMAGES[case]
    run = helpers.copy_run(runs / "block", tmp_path / "run")
    damage(run)
    line = one_line(export_cli(run, tmp_path / "hf", cwd=tmp_path))
    assert said in line, line
    assert not (tmp_path / "hf").exists()


# -- item 11: what a killed export left ---------------------------------------------------------
def test_the_next_export_cleans_up_after_a_killed_one(runs, tmp_path):
    out = tmp_path / "hf"
    export(runs / "block", out)
    pid = dead_pid()
    half = tmp_path / f".hf.export-{pid}.tmp"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    os.replace(out, tmp_path / f".hf.replaced-{pid}.tmp")  # killed between the two renames of --overwrite
    said = []
    with pytest.raises(Exception, match="exists; pass --overwrite"):
        export(runs / "full", out, say=said.append)  # the earlier export is back: without --overwrite, refused
    assert any(f"restored the earlier export {out}" in line for line in said), said
    assert any(f"removed {half}: a half-written export" in line for line in said), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert json.loads((out / "config.json").read_text())["residual"]["_target_"].endswith("BlockAttentionResidual")


# -- item 4: the positions a model was trained on, and a damaged model.safetensors ---------------
def test_a_checkpoint_and_its_export_alike_refuse_longer_contexts(runs, tmp_path):
    out = tmp_path / "hf"
    export(runs / "block", out)
    common = [*DATA, "data=stdlib", "trainer.accelerator=cpu", "mode=eval", "data.block_size=256"]
    lines = [helpers.one_line_error(helpers.run_cli(*common, f"ckpt_path={source}", f"hydra.run.dir=ev{k}",
                                                    cwd=tmp_path))
             for k, source in enumerate((runs / "block" / "checkpoints" / "last.ckpt", out))]
    for line, source in zip(lines, ("last.ckpt", "hf"), strict=True):
        assert "data.block_size=256 is longer than the 128 positions" in line and source in line, line
    short = [helpers.run_cli(*common[:-1], "data.block_size=64", f"ckpt_path={source}", f"hydra.run.dir=ok{k}",
                             cwd=tmp_path) for k, source in enumerate((runs / "block" / "checkpoints" / "last.ckpt",
                                                                       out))]
    assert [r.returncode for r in short] == [0, 0], short[0].stderr[-2000:] + short[1].stderr[-2000:]
    scores = [json.loads((tmp_path / f"ok{k}" / "eval.json").read_text())["metrics"]["val/loss"] for k in (0, 1)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-6)
    assert "Loading weights" not in short[1].stderr + short[1].stdout
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:2000])
    line = helpers.one_line_error(helpers.run_cli(*common[:-1], f"ckpt_path={damaged}", "hydra.run.dir=bad",
                                                  cwd=tmp_path))
    assert f"{damaged / 'model.safetensors'} is damaged" in line, line
    for config, said in (("{\"model_type\": \"attnres\"", "config.json is empty or damaged"),
                         ('{"model_type": "gpt2"}', "holds a gpt2 Hugging Face model, not an attnres one")):
        (damaged / "config.json").write_text(config)
        line = helpers.one_line_error(helpers.run_cli(*common[:-1], f"ckpt_path={damaged}", "hydra.run.dir=bad",
                                                      cwd=tmp_path))
        assert said in line, line


# -- item 10: the exported model and tokenizer as a transformers user holds them ------------------
def test_the_byte_level_tokenizer_pads_and_still_round_trips_bytes(runs, tmp_path):
    export(runs / "block", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.pad_token_id == 0
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"] == [[97, 98, 0, 0], [97, 98, 99, 100]]
    assert batch["attention_mask"] == [[1, 1, 0, 0], [1, 1, 1, 1]]
    tok.padding_side = "left"
    assert tok(["ab", "abcd"], padding=True)["input_ids"][0] == [0, 0, 97, 98]
    text = "Ā\x00 Āy"  # the pad token's own character, and a NUL byte, are still their bytes
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["pad_token_id"] == 0


def test_an_empty_prompt_is_a_clear_error(runs, tmp_path):
    export(runs / "block", tmp_path / "hf")
    model, tok = AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(tmp_path / "hf")
    empty = tok("", return_tensors="pt")
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(**empty, max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(empty["input_ids"], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        model(empty["input_ids"])
    assert model.generate(**tok("d", return_tensors="pt"), max_new_tokens=2, do_sample=False).shape == (1, 3)
