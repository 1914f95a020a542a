"""The special tokens lm-eval's rolling and generation tasks need, for byte-level and BPE runs
(attnres.hf.tokenization.hf_tokenizer): an end-of-text token to stop on and pad with, and text that
survives lm-eval's decoding (skip_special_tokens=True)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install 'attnres[hf]'")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from attnres.hf.tokenization import BYTE_PREFIX, byte_tokenizer, hf_tokenizer  # noqa: E402


def test_the_byte_level_tokenizer_ends_and_pads_with_byte_0_and_decodes_newlines():
    tok, ids = hf_tokenizer(byte_tokenizer(), 128)
    assert ids == {"pad_token_id": 0, "eos_token_id": 0} and (tok.eos_token_id, tok.pad_token_id) == (0, 0)
    assert tok.bos_token_id is None and BYTE_PREFIX == 10 and tok.decode([BYTE_PREFIX]) == "\n"
    text = "def f():\n    return 'é'\n"
    encoded = tok(text)["input_ids"]
    assert encoded == list(text.encode()) and tok.decode(encoded, skip_special_tokens=True) == text
    assert tok.decode([*encoded, 0, 0], skip_special_tokens=True) == text  # generation's padding drops out


def test_a_bpe_tokenizer_with_end_of_text_ends_pads_and_starts_with_it():
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.add_special_tokens(["<|endoftext|>"])
    tok, ids = hf_tokenizer(bpe, 64)
    assert ids == {"pad_token_id": 0, "eos_token_id": 0}
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"
    # lm-eval's prefix for a rolling text is the BOS, else the EOS: attnres-prepare's document separator
    assert (tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id) == 0


def test_any_other_vocabulary_names_its_special_tokens():
    words = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "k0": 1}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok, ids = hf_tokenizer(words, 16, pad_token="<pad>", eos_token="<pad>")
    assert ids == {"pad_token_id": 0, "eos_token_id": 0} and tok("k0 k0")["input_ids"] == [1, 1]
