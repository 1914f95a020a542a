"""data=tokens: both token-file formats, their errors, determinism, resume, and bits per byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from attnres.config.errors import ConfigError
from attnres.data.tokens import HEADER_BYTES, TokensDataModule, token_byte_lengths, write_shard
from attnres.training.lit import LitLanguageModel
from tests.data.conftest import fit_recording
from tests.helpers import TINY_MODEL, run_cli


def make_folder(root: Path, dtype=np.uint16, headered=True, vocab=1000, shards=(3000, 2000), val=1500,
                meta: dict | None = None, seed=0) -> tuple[Path, list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    train = [rng.integers(0, vocab, n).astype(dtype) for n in shards]
    for k, t in enumerate(train):
        write_shard(root / f"data_train_{k:06d}.bin", t, headered=headered)
    val_tokens = rng.integers(0, vocab, val).astype(dtype)
    write_shard(root / "data_val_000000.bin", val_tokens, headered=headered)
    (root / "meta.json").write_text(json.dumps({"vocab_size": vocab, **(meta or {})}))
    return root, train, val_tokens


def module(path: Path, tmp_path: Path, **kw) -> TokensDataModule:
    return TokensDataModule(path=str(path), block_size=kw.pop("block_size", 32), batch_size=kw.pop("batch_size", 4),
                            cache_dir=str(tmp_path / "cache"), **kw)


FORMATS = [
    pytest.param(np.uint16, True, {}, id="headered-uint16"),
    pytest.param(np.uint32, True, {}, id="headered-uint32"),
    pytest.param(np.uint16, False, {}, id="raw-uint16"),
    pytest.param(np.uint32, False, {"dtype": "uint32"}, id="raw-uint32"),
]


@pytest.mark.parametrize(("dtype", "headered", "meta"), FORMATS)
def test_formats_round_trip(dtype, headered, meta, tmp_path):
    vocab = 70000 if dtype == np.uint32 else 1000
    root, train, val = make_folder(tmp_path / "d", dtype, headered, vocab=vocab, meta=meta)
    dm = module(root, tmp_path)
    dm.setup("fit")
    assert [s.num_tokens for s in dm.train_shards] == [len(t) for t in train]
    assert all(s.offset == (HEADER_BYTES if headered else 0) for s in dm.train_shards)
    ds = dm.train_dataset()
    for i in range(50):  # every window is the slice of its shard it claims to be
        k, offset = ds.locate(i)
        x, y = ds[i]
        ref = train[k][offset : offset + 33].astype(np.int64)
        assert x.tolist() == ref[:-1].tolist() and y.tolist() == ref[1:].tolist()
    vx, vy = dm.val_dataset()[1]
    assert vx.tolist() == val[32:64].astype(np.int64).tolist() and vy.tolist() == val[33:65].astype(np.int64).tolist()


def test_windows_cover_every_shard_and_never_cross(tmp_path):
    root, train, _ = make_folder(tmp_path / "d", shards=(40, 2000, 33))  # the last shard: exactly one window
    ds = module(root, tmp_path).train_dataset()
    seen = {ds.locate(i)[0] for i in range(3000)}
    assert seen == {0, 1, 2}
    for i in range(3000):
        k, offset = ds.locate(i)
        assert 0 <= offset and offset + 33 <= len(train[k])


def test_vocab_from_config_and_meta(tmp_path):
    root, _, _ = make_folder(tmp_path / "d", vocab=1000)
    assert module(root, tmp_path).vocab_size == 1000
    assert module(root, tmp_path, vocab_size=1200).vocab_size == 1200
    (root / "meta.json").unlink()
    with pytest.raises(ConfigError, match="set data.vocab_size"):
        module(root, tmp_path)
    assert module(root, tmp_path, vocab_size=1000).vocab_size == 1000


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_wrong_magic_is_one_line(tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    bad = root / "data_train_000001.bin"
    data = bytearray(bad.read_bytes())
    data[:4] = np.int32(12345).tobytes()
    bad.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as err:
        module(root, tmp_path).setup()
    assert "wrong magic 12345" in one_line(err) and "data_train_000001.bin" in str(err.value)


def test_truncated_shard_is_one_line(tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    shard = root / "data_train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ConfigError) as err:
        module(root, tmp_path).setup()
    assert "truncated shard" in one_line(err) and "3000 tokens" in str(err.value)


def test_raw_odd_size_is_one_line(tmp_path):
    root, _, _ = make_folder(tmp_path / "d", headered=False)
    shard = root / "data_val_000000.bin"
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(ConfigError) as err:
        module(root, tmp_path).setup()
    assert "not a whole number of uint16" in one_line(err)


def test_vocabulary_overflow_is_one_line(tmp_path):
    root, train, _ = make_folder(tmp_path / "d", vocab=1000)
    train[1][7] = 1500
    write_shard(root / "data_train_000001.bin", train[1])
    with pytest.raises(ConfigError) as err:
        module(root, tmp_path).setup()
    assert "token id 1500" in one_line(err) and "data.vocab_size>=1501" in str(err.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"path": None}, "data.path is not set"),
    ({"path": "/nonexistent/tokens"}, "is not a folder"),
    ({"dtype": "int8"}, "data.dtype='int8'"),
    ({"val_tokens": 3}, "data.val_tokens=3"),
    ({"vocab_size": 0}, "data.vocab_size=0"),
    ({"tokenizer": "/nonexistent/tokenizer.json"}, "data.tokenizer="),
    ({"tokens_per_step": -1}, "data.tokens_per_step=-1"),
])
def test_config_errors(kwargs, needle, tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    kwargs = {"path": str(root), **kwargs}
    with pytest.raises(ConfigError) as err:
        TokensDataModule(cache_dir=str(tmp_path / "c"), block_size=32, **kwargs)
    assert needle in one_line(err)


def test_empty_folder_names_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no train"):
        TokensDataModule(path=str(tmp_path / "empty"), vocab_size=10)


def test_samples_are_a_function_of_seed_and_index(tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    a, b, c = (module(root, tmp_path, seed=s).train_dataset() for s in (0, 0, 1))
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(20))
    assert any(not torch.equal(a[i][0], c[i][0]) for i in range(20))


def test_validation_scores_a_fixed_number_of_tokens(tmp_path):
    root, _, _ = make_folder(tmp_path / "d", val=1500)
    dm = module(root, tmp_path, val_tokens=320)
    assert len(dm.val_dataset()) == 10  # 320 / 32
    dm = module(root, tmp_path, val_batches=2)  # null: val_batches x batch_size x block_size = 256 tokens
    assert len(dm.val_dataset()) == 8
    dm = module(root, tmp_path, val_tokens=10**6)  # more than there are: every whole window (1499 // 32)
    assert len(dm.val_dataset()) == 46


def test_tokens_per_step_sets_the_accumulation(tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    assert module(root, tmp_path, tokens_per_step=4 * 32 * 6).accumulation(world_size=2) == 3
    with pytest.raises(ConfigError, match="not a multiple of batch_size x block_size x devices"):
        module(root, tmp_path, tokens_per_step=1000).accumulation(world_size=1)


def _fit(root: Path, tmp: Path, max_steps: int, out: Path, ckpt: str | None = None) -> list[list[int]]:
    return fit_recording(lambda: module(root, tmp), max_steps, out, ckpt)


@pytest.mark.filterwarnings("ignore:.*no `validation_step`", "ignore:.*LeafSpec", "ignore:Checkpoint directory")
def test_resume_mid_run_sees_the_same_batches(tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    full = _fit(root, tmp_path, 5, tmp_path / "full")
    _fit(root, tmp_path, 3, tmp_path / "part")
    resumed = _fit(root, tmp_path, 5, tmp_path / "part", ckpt=str(tmp_path / "part" / "last.ckpt"))
    assert len(full) == 10 and resumed == full[6:]


# -- bits per byte ------------------------------------------------------------------------------
TEXT = "héllo wörld, ünïcode text: ☃ and € signs.\n" * 40


def tiny_tokenizer(path: Path, vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    tok.save(str(path))
    return path


def test_token_byte_lengths_match_decoding(tmp_path):
    from tokenizers import Tokenizer

    file = tiny_tokenizer(tmp_path / "tokenizer.json")
    lengths = token_byte_lengths(file)
    tok = Tokenizer.from_file(str(file))
    ids = tok.encode(TEXT).ids
    assert int(lengths[ids].sum()) == len(TEXT.encode("utf-8"))  # the bytes of the whole text, multibyte included
    assert lengths[tok.token_to_id("<|endoftext|>")] == 0


class _Uniform(torch.nn.Module):
    """Logits that give each token probability 1 / V: loss ln V nats per scored token."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.bias = vocab, torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, self.vocab) + self.bias
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return out


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_val_bpb_equals_a_hand_count(tmp_path):
    from tokenizers import Tokenizer

    root = tmp_path / "d"
    root.mkdir()
    tok = Tokenizer.from_file(str(tiny_tokenizer(root / "tokenizer.json")))
    text = "naïve café: 3 € ☃ zürich, ünïcode\n"
    # one window: an end-of-text token (0 bytes, input only), then the text; every target is scored
    ids = np.array([tok.token_to_id("<|endoftext|>"), *tok.encode(text).ids], dtype=np.uint16)
    vocab = tok.get_vocab_size()
    write_shard(root / "train.bin", ids)
    write_shard(root / "val.bin", ids)
    (root / "meta.json").write_text(json.dumps({"vocab_size": vocab}))
    T = len(ids) - 1
    dm = module(root, tmp_path, block_size=T, batch_size=1, val_tokens=T)
    lit = LitLanguageModel(_Uniform(vocab), optimizer=torch.optim.SGD, metric=dm.metric)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(lit, datamodule=dm, verbose=False)
    # by hand: T targets at ln V nats each, over the UTF-8 bytes of the text they spell
    expected = T * math.log(vocab) / math.log(2) / len(text.encode("utf-8"))
    assert len(text.encode("utf-8")) > len(text)  # multibyte characters are in the count
    assert trainer.callback_metrics["val/bpb"].item() == pytest.approx(expected, rel=1e-6)  # logged as float32
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(math.log(vocab), rel=1e-6)


def test_without_a_tokenizer_only_loss_is_reported(tmp_path):
    root, _, _ = make_folder(tmp_path / "d")
    assert module(root, tmp_path).metric == "loss"


# -- end to end: attnres-prepare, attnres-run data=tokens, mode=eval, mode=sample ---------------------
@pytest.mark.slow
def test_prepare_train_eval_sample_through_the_cli(tmp_path):
    from attnres.data import prepare

    src = tmp_path / "src"
    src.mkdir()
    for k in range(10):
        (src / f"f{k}.txt").write_text("".join(f"def f{k}_{j}(x):\n    return x * {j} + {k}\n" for j in range(200)))
    prepare.prepare(str(src), str(tmp_path / "tok"), vocab_size=300, workers=2, val_fraction=0.3, progress=False)
    tiny = ["data=tokens", f"data.path={tmp_path / 'tok'}", "data.block_size=32", "data.batch_size=4",
            "data.tokens_per_step=256", "data.val_tokens=256", *TINY_MODEL, "residual=block", "num_blocks=2",
            "trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "logger=none"]
    train = run_cli(*tiny, "trainer.max_steps=6", "trainer.val_check_interval=6", "hydra.run.dir=run",
                 cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["tokens_seen"] == 6 * 256  # 2 micro-batches of 4 x 32 per step
    assert {"val/bpb", "val/loss", "train/bpb"} <= set(metrics["metrics"])
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    data = [a for a in tiny if a.startswith("data.") or a == "data=tokens"]
    ev = run_cli("mode=eval", f"ckpt_path={ckpt}", *data, "hydra.run.dir=ev", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    scored = json.loads((tmp_path / "ev" / "eval.json").read_text())["metrics"]
    assert scored["val/bpb"] == pytest.approx(metrics["metrics"]["val/bpb"], rel=1e-6)  # the same weights, data
    sample = run_cli("mode=sample", f"ckpt_path={ckpt}", *data, "sample.prompt=def",
                  "sample.max_new_tokens=12", "sample.num_samples=2", "hydra.run.dir=sa", cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr[-3000:]
    samples = json.loads((tmp_path / "sa" / "samples.json").read_text())["samples"]
    assert len(samples) == 2 and all(s.startswith("def") for s in samples)
    bad = run_cli(*tiny, "data.tokens_per_step=100", "trainer.max_steps=2", "hydra.run.dir=bad",
               cwd=tmp_path)
    assert bad.returncode == 2 and "not a multiple of batch_size x block_size x devices" in bad.stderr


