"""attnres-export on real runs: for each of the six strategies the exported folder gives the
checkpoint's logits and `attnres-run mode=sample sample.temperature=0`'s tokens; a BPE run ships its
tokenizer; mode=eval and mode=sample read an exported folder; refusals are one line, exit 2, and
leave nothing behind."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attnres[hf]'")
pytest.importorskip("safetensors", reason="needs the hf extra: pip install 'attnres[hf]'")

from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import attnres.hf  # noqa: E402, F401  (registers the Auto classes)
from attnres.export.main import export, is_running  # noqa: E402
from attnres.training.faults import RunLock  # noqa: E402
from tests import helpers  # noqa: E402
from tests.hf.shared import DATA, NEW, PROMPT, SAMPLE, STRATEGIES  # noqa: E402  (`runs`: tests/hf/conftest.py)

pytestmark = pytest.mark.slow

def checkpoint_model(run: Path) -> torch.nn.Module:
    """The Transformer the runner builds for `run`, with its last checkpoint's weights."""
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    state = helpers.weights(run / "checkpoints" / "last.ckpt")
    model = instantiate(cfg.model, vocab_size=state["model.embed.weight"].shape[0], residual=instantiate(cfg.residual))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model.eval()


def greedy(out: Path, prompt: str, new: int) -> str:
    model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    ids = tok(prompt, return_tensors="pt")
    return tok.decode(model.generate(**ids, max_new_tokens=new, do_sample=False)[0], skip_special_tokens=True)


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_export_gives_the_checkpoints_logits_and_greedy_samples(runs, tmp_path, name):
    out = tmp_path / "hf"
    info = export(runs / name, out)
    assert info["status"] == "finished" and info["step"] == 10
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    reference = checkpoint_model(runs / name)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.float32
    state = loaded.transformer.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    if name != "standard":
        assert any(v.abs().max() > 0 for k, v in state.items() if k.startswith("residual.")), "nothing learned"
    # tied embeddings: stored once, one tensor again after loading
    assert "model.transformer.head.weight" not in load_file(out / "model.safetensors")
    assert loaded.transformer.head.weight is loaded.transformer.embed.weight
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, reference(idx)["logits"], rtol=0, atol=1e-5)
    sampled = json.loads((runs / f"sample-{name}" / "samples.json").read_text())["samples"][0]
    assert greedy(out, PROMPT, NEW) == sampled
    assert len(sampled.encode("utf-8", errors="replace")) >= len(PROMPT)


def test_a_byte_level_export_round_trips_text(runs, tmp_path):
    export(runs / "block", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return 'héllo 🙂'\n"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["residual"]["num_blocks"] == 2


def test_eval_and_sample_read_an_exported_folder(runs, tmp_path):
    out = tmp_path / "hf"
    export(runs / "hc", out)
    common = [*DATA, "data=stdlib", "trainer.accelerator=cpu"]
    for args, folder in (([f"ckpt_path={runs / 'hc' / 'checkpoints' / 'last.ckpt'}"], "ev-ckpt"),
                         ([f"ckpt_path={out}"], "ev-hf")):
        ran = helpers.run_cli(*common, "mode=eval", *args, f"hydra.run.dir={folder}", cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr[-3000:]
    scored = [json.loads((tmp_path / f / "eval.json").read_text())["metrics"] for f in ("ev-ckpt", "ev-hf")]
    assert scored[0]["val/loss"] == pytest.approx(scored[1]["val/loss"], rel=1e-6)
    ran = helpers.run_cli(*SAMPLE, f"ckpt_path={out}", "hydra.run.dir=sa-hf", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (json.loads((tmp_path / "sa-hf" / "samples.json").read_text())["samples"]
            == json.loads((runs / "sample-hc" / "samples.json").read_text())["samples"])
    train = helpers.run_cli(*common, f"ckpt_path={out}", "trainer.max_steps=2", "hydra.run.dir=tr", cwd=tmp_path)
    assert "not a file" in helpers.one_line_error(train)  # training continues from a .ckpt only


def test_a_bpe_run_ships_its_tokenizer(tmp_path):
    from attnres.data import prepare

    src = tmp_path / "src"
    src.mkdir()
    for k in range(6):
        (src / f"f{k}.txt").write_text("".join(f"def f{k}_{j}(x):\n    return x * {j} + {k}\n" for j in range(150)))
    prepare.prepare(str(src), str(tmp_path / "tok"), vocab_size=300, workers=1, val_fraction=0.3, progress=False)
    data = ["data=tokens", f"data.path={tmp_path / 'tok'}", "data.block_size=32", "data.batch_size=4",
            "data.val_tokens=128", "trainer.accelerator=cpu"]
    ran = helpers.run_cli(*data, *helpers.TINY_MODEL, "residual=full", "callbacks=none", "logger=none",
                          "trainer.enable_progress_bar=false", "trainer.max_steps=8", "hydra.run.dir=run",
                          cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = tmp_path / "hf"
    info = export(tmp_path / "run", out)
    assert info["tokenizer"] == str(tmp_path / "tok" / "tokenizer.json")
    from tokenizers import Tokenizer

    own = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f3_7(x):\n    return x * 7 + 3\n"
    assert tok(text)["input_ids"] == own.encode(text).ids
    eot = own.token_to_id("<|endoftext|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eot
    sample = helpers.run_cli(*data, "mode=sample", "sample.temperature=0", "sample.prompt=def",
                             "sample.max_new_tokens=16", f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
                             "hydra.run.dir=sa", cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr[-3000:]
    sampled = json.loads((tmp_path / "sa" / "samples.json").read_text())["samples"][0]
    hf = greedy(out, "def", 16)  # stops at <|endoftext|>, which mode=sample writes past (and does not print)
    assert sampled.startswith(hf) and len(hf) > len("def")
    reference = checkpoint_model(tmp_path / "run")
    idx = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(idx).logits, reference(idx)["logits"],
                                   rtol=0, atol=1e-5)


# -- the command line and its refusals ----------------------------------------------------------
def export_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnres.export.main", *map(str, args)], cwd=cwd,
                          env=helpers.cli_env(), capture_output=True, text=True, timeout=300)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and result.stdout == "", result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnres-export: error: "), result.stderr
    return lines[0]


def test_the_command_line_exports_and_replaces_only_when_told(runs, tmp_path):
    out = tmp_path / "models" / "hf"
    first = export_cli(runs / "block", out, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith(f"exported {runs / 'block' / 'checkpoints' / 'last.ckpt'} (finished at step 10")
    assert f'AutoModelForCausalLM.from_pretrained("{out}")' in first.stdout
    assert "Traceback" not in first.stderr and "Writing model shards" not in first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "exists; pass --overwrite" in one_line(export_cli(runs / "full", out, cwd=tmp_path))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    again = export_cli(runs / "full", out, "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["residual"]["_target_"] == "attnres.FullAttentionResidual"
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no temporary folder left


def _failed(run: Path) -> None:
    summary = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").write_text(json.dumps({**summary, "status": "failed", "error": "non-finite loss at step 3"}))


def _damaged(run: Path) -> None:
    ckpt = run / "checkpoints" / "last.ckpt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))


REFUSALS = {
    "failed": (_failed, "failed (non-finite loss at step 3)"),
    "never-ended": (lambda run: (run / "metrics.json").unlink(), "never ended (no metrics.json)"),
    "no-checkpoint": (lambda run: (run / "checkpoints" / "last.ckpt").unlink(), "has no checkpoints/last.ckpt"),
    "damaged": (_damaged, "is damaged"),
    "not-a-run": (lambda run: shutil.rmtree(run / ".hydra"), "is not a run folder"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_run_that_cannot_be_exported_is_refused_in_one_line(runs, tmp_path, case):
    spoil, expected = REFUSALS[case]
    run = tmp_path / "run"
    shutil.copytree(runs / "standard", run)
    spoil(run)
    assert expected in one_line(export_cli(run, tmp_path / "out" / "hf", cwd=tmp_path))
    assert not (tmp_path / "out").exists()


def test_a_running_run_is_refused(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "standard", run)
    with RunLock(run):  # as attnres-run holds it for the life of a run
        assert "is still running" in one_line(export_cli(run, tmp_path / "hf", cwd=tmp_path))
    assert not (tmp_path / "hf").exists()
    assert not is_running(run)  # the lock is free again


# -- docs/huggingface.md, as a reader follows it -------------------------------------------------
def page_blocks() -> list[tuple[str, list[str]]]:
    """(tag, lines) of each fenced block of docs/huggingface.md."""
    blocks, current = [], None
    for line in (helpers.REPO / "docs" / "huggingface.md").read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[1].append(line)
    return blocks


def shown_run(lines: list[str], command: str) -> tuple[str, list[str]]:
    """The `$ command ...` line of a transcript and the lines it prints."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"$ {command}"))
    printed = []
    for line in lines[start + 1:]:
        if line.startswith("$ "):
            break
        printed.append(line)
    return lines[start][2:], printed


def masked(line: str) -> str:
    return re.sub(r"\d[\d,]*(\.\d+)?", "N", line)


def test_the_page_does_what_it_shows(runs, tmp_path):
    """The transcripts of docs/huggingface.md (tests/test_docs.py checks its bash blocks): its
    attnres-export command on a run where the page has it, and its generate.py on the export."""
    blocks = page_blocks()
    transcripts = [lines for tag, lines in blocks if tag in ("text", "console")]
    command, shown = next(shown_run(t, "attnres-export") for t in transcripts
                          if any(x.startswith("$ attnres-export") for x in t))
    run_dir = command.split()[1]
    shutil.copytree(runs / "standard", tmp_path / run_dir)
    ran = subprocess.run([sys.executable, "-m", "attnres.export.main", *command.split()[1:]], cwd=tmp_path,
                         env=helpers.cli_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    printed = ran.stdout.strip().splitlines()
    assert [line.split()[0] for line in printed] == [line.split()[0] for line in shown]
    assert masked(printed[0]) == masked(shown[0]) and printed[-1] == shown[-1]
    assert masked(printed[1]).split("(")[0] == masked(shown[1]).split("(")[0]
    script = next(lines for tag, lines in blocks if tag == "python" and lines[0] == "# generate.py")
    (tmp_path / "generate.py").write_text("\n".join(script) + "\n")
    command, shown = next(shown_run(t, "python generate.py") for t in transcripts
                          if any(x.startswith("$ python generate.py") for x in t))
    ran = subprocess.run([sys.executable, "generate.py"], cwd=tmp_path, env=helpers.cli_env(), capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.startswith("def main") and shown[0].startswith("def main")
