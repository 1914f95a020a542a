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


def is_byte_level(tok: Tokenizer) -> bool:
    """Whether `tok` is `byte_tokenizer()`'s vocabulary: 256 tokens, id = byte value."""
    chars = byte_characters()
    return tok.get_vocab_size(with_added_tokens=True) == 256 and all(tok.token_to_id(c) == b for b, c in
                                                                     ((0, chars[0]), (97, "a"), (255, chars[255])))


def save_tokenizer(tok: Tokenizer, folder: str | Path, max_length: int) -> dict[str, Any]:
    """Write `tok` as a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) that
    `AutoTokenizer.from_pretrained(folder)` loads; returns the special token ids it has.

    Padding: a tokenizer with an end-of-text token pads with it; the byte-level one pads with byte 0
    (`pad_token` "Ā", the character that stands for it, id 0), so `tokenizer(texts, padding=True)`
    works as with any Hugging Face tokenizer. Its `split_special_tokens` is on, so a "Ā" in a text
    is still the two bytes of its UTF-8 form: text keeps round-tripping byte for byte."""
    from transformers import PreTrainedTokenizerFast

    eot = end_of_text(tok)
    if eot:
        special = {"eos_token": eot, "pad_token": eot}
    elif is_byte_level(tok):
        special = {"pad_token": byte_characters()[0], "split_special_tokens": True}
    else:
        special = {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **special)
    fast.save_pretrained(str(folder))
    ids = {"pad_token_id": tok.token_to_id(special["pad_token"])} if "pad_token" in special else {}
    return {**ids, "eos_token_id": tok.token_to_id(eot)} if eot else ids
