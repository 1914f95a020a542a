"""The lm-eval bridge is exact: attnres_bpb, scored by lm-eval's loglikelihood_rolling on the model
in memory, equals the runner's own val/bpb on the same held-out text (tokenizer, the "\\n" a text
starts after, the context window of block_size); lm-eval's batched generation (left padding, an
attention_mask) gives each prompt its own greedy text."""

from __future__ import annotations

import functools
import json

import pytest
import pytorch_lightning as pl
import torch

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install 'attnres[eval]'")

from attnres.data import TextBytesDataModule  # noqa: E402
from attnres.hf import AttnResConfig, AttnResForCausalLM  # noqa: E402
from attnres.hf.tokenization import BYTE_PREFIX, byte_tokenizer, hf_tokenizer  # noqa: E402
from attnres.tasks import lmeval, local  # noqa: E402
from attnres.training.lit import LitLanguageModel  # noqa: E402

T, WINDOWS = 32, 12
SHAPE = {"vocab_size": 256, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": T}
BLOCK = {"_target_": "attnres.BlockAttentionResidual", "num_blocks": 2, "kernel": "torch"}


@pytest.fixture
def offline(monkeypatch):
    for name in lmeval.OFFLINE:
        monkeypatch.setenv(name, "1")
    lmeval.go_offline(True)  # also in huggingface_hub and datasets, if imported already


def held_out_text(tmp_path):
    """A corpus file whose validation part (the last val_fraction of its bytes) is "\\n" + WINDOWS * T
    bytes of text with multi-byte characters in it, as a byte-level run reads it."""
    text = "".join(f"def f{i}(x):  # é ü {i * i}\n    return x * {i}\n" for i in range(200))
    held = text.encode()[: WINDOWS * T]
    while True:
        try:
            held.decode()
            break
        except UnicodeDecodeError:
            held = held[:-1]
    held = held + b" " * (WINDOWS * T - len(held))
    train = text.encode()[-2000:]
    body = train + b"\n" + held
    (tmp_path / "corpus.txt").write_bytes(body)
    return tmp_path / "corpus.txt", (1 + len(held)) / len(body), held.decode()


def runner_val_bpb(model, dm) -> float:
    module = LitLanguageModel(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), metric="bpb")
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False)
    return float(trainer.validate(module, datamodule=dm, verbose=False)[0]["val/bpb"])


@pytest.mark.slow  # lm-eval's import and task index: about 20 s
@pytest.mark.parametrize("residual", [BLOCK, {"_target_": "attnres.StandardResidual"}], ids=["block", "standard"])
def test_attnres_bpb_through_lm_eval_is_the_runners_val_bpb(tmp_path, offline, monkeypatch, residual):
    monkeypatch.setenv("ATTNRES_CACHE", str(tmp_path / "cache"))
    path, fraction, held = held_out_text(tmp_path)
    dm = TextBytesDataModule(path=str(path), block_size=T, batch_size=4, val_batches=WINDOWS // 4,
                             val_fraction=fraction)
    dm.setup()
    assert bytes(dm.memmaps()[1]) == b"\n" + held.encode()
    torch.manual_seed(0)
    hf = AttnResForCausalLM(AttnResConfig(transformer=SHAPE, residual=residual)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))  # far from uniform predictions, so that a shifted window shows

    docs, key = local.task_docs("attnres_bpb", dm, 0)
    assert docs == [{"text": held}]
    folder = local.prepare_own(["attnres_bpb"], dm, 0)["attnres_bpb"]
    assert json.loads((folder / "test.jsonl").read_text()) == docs[0]
    manager = lmeval.task_manager([folder])
    lmeval.check_tasks(["attnres_bpb"], manager)
    tokenizer, _ = hf_tokenizer(byte_tokenizer(), T)
    result = lmeval.evaluate(hf, tokenizer, ["attnres_bpb"], manager, batch_size=5, prefix_token_id=BYTE_PREFIX)
    ours = runner_val_bpb(hf.transformer, dm)
    theirs = result["metrics"]["attnres_bpb/bits_per_byte"]
    assert 4.0 < ours < 16.0
    assert abs(theirs - ours) < 1e-3, (theirs, ours)
    assert abs(theirs - ours) < 1e-5  # in fact only the order of float32 sums differs


GENERATE = """task: greedy_bytes
dataset_path: json
dataset_kwargs:
  data_files:
    test: "@DATA@"
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["@@@"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.mark.slow  # lm-eval's import and task index: about 20 s
def test_lm_evals_batched_generation_pads_on_the_left_and_gives_each_prompt_its_own_greedy_text(tmp_path, offline):
    """generate_until in one batch of six prompts of different lengths (left padding, an attention_mask)
    gives what each prompt alone gives under attnres's own greedy decoding: exact_match 1.0."""
    torch.manual_seed(1)
    hf = AttnResForCausalLM(AttnResConfig(transformer=SHAPE, residual=BLOCK)).eval().double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    tokenizer, _ = hf_tokenizer(byte_tokenizer(), T)
    docs = []
    for prompt in ("def", "import os", "x = 1\n", "class A:\n    pass", "for i in range(3):", "#"):
        ids = torch.tensor([list(prompt.encode())])
        new = hf.transformer.generate(ids, 10, temperature=0)[0, ids.shape[1]:].tolist()
        docs.append({"prompt": prompt, "target": tokenizer.decode(new, skip_special_tokens=True).split("@@@")[0]})
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "greedy_bytes.yaml").write_text(GENERATE.replace("@DATA@", str(tmp_path / "test.jsonl")))
    manager = lmeval.task_manager([tmp_path])
    lmeval.check_tasks(["greedy_bytes"], manager)
    result = lmeval.evaluate(hf, tokenizer, ["greedy_bytes"], manager, batch_size=6, prefix_token_id=BYTE_PREFIX)
    assert result["samples"] == {"greedy_bytes": 6}
    assert result["metrics"]["greedy_bytes/exact_match"] == 1.0
