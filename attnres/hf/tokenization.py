"""Tokenizers for exported models: the byte-level one of attnres's byte data, and any `tokenizer.json`.

Byte-level runs (`data=stdlib`, `data=text`) read token i as byte i of the UTF-8 text.
`byte_tokenizer()` is that as a `tokenizers.Tokenizer`: each byte becomes one token whose id is the
byte's value (no merges, nothing added), and decoding joins the bytes and reads them as UTF-8
(an incomplete character becomes U+FFFD), so text round-trips exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

#: the end-of-text token attnres-prepare puts after each document (and its usual spellings)
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>")


def byte_characters() -> list[str]:
    """The printable character that stands for each byte in a byte-level vocabulary (GPT-2's
    convention, which `tokenizers`' ByteLevel pre-tokenizer and decoder use): printable Latin-1
    bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer() -> Tokenizer:
    """Token id = byte value, for the 256 bytes of UTF-8 text."""
    vocab = {char: byte for byte, char in enumerate(byte_characters())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def end_of_text(tok: Tokenizer) -> str | None:
    """The tokenizer's end-of-text token, if it has one."""
    return next((t for t in END_OF_TEXT if tok.token_to_id(t) is not None), None)


def save_tokenizer(tok: Tokenizer, folder: str | Path, max_length: int) -> dict[str, Any]:
    """Write `tok` as a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) that
    `AutoTokenizer.from_pretrained(folder)` loads; returns the special token ids it has."""
    from transformers import PreTrainedTokenizerFast

    eot = end_of_text(tok)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length,
                                   **({"eos_token": eot, "pad_token": eot} if eot else {}))
    fast.save_pretrained(str(folder))
    return {"eos_token_id": tok.token_to_id(eot), "pad_token_id": tok.token_to_id(eot)} if eot else {}
