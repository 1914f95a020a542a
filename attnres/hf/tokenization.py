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


#: the byte a byte-level model's documents start after: the stdlib corpus joins its files with
#: "\n\n", so "\n" is what lm-eval should put before a text it scores from its start (its
#: `prefix_token_id`); not a special token, so decoded text keeps its newlines
BYTE_PREFIX = ord("\n")


def hf_tokenizer(tok: Tokenizer, max_length: int, **special: Any) -> tuple[Any, dict[str, int]]:
    """`tok` as a Hugging Face `PreTrainedTokenizerFast`, in memory, with the special tokens that
    generation and lm-eval need; returns it and the special token ids it has.

    A tokenizer with an end-of-text token pads and ends with it (and lm-eval starts a rolling
    text after it, as attnres-prepare's documents do). The byte-level one pads and ends with byte 0
    (`Ā`, the character that stands for it, id 0), which text never holds, so generation runs to
    its stop strings or its length; its `split_special_tokens` is on, so an `Ā` or a NUL in a text
    is still the bytes of its UTF-8 form: text keeps round-tripping byte for byte. `special`
    (`eos_token=`, `pad_token=`) names them for any other vocabulary."""
    from transformers import PreTrainedTokenizerFast

    eot = end_of_text(tok)
    if special:
        pass
    elif eot:
        special = {"eos_token": eot, "pad_token": eot}
    elif is_byte_level(tok):
        special = {"eos_token": byte_characters()[0], "pad_token": byte_characters()[0], "split_special_tokens": True}
    else:
        special = {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **special)
    ids = {f"{k}_id": tok.token_to_id(special[k]) for k in ("pad_token", "eos_token") if k in special}
    return fast, ids


def save_tokenizer(tok: Tokenizer, folder: str | Path, max_length: int) -> dict[str, Any]:
    """Write `tok` as a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) that
    `AutoTokenizer.from_pretrained(folder)` loads (`hf_tokenizer`); returns the special token ids
    it has (`pad_token_id`, `eos_token_id`), for generation_config.json."""
    fast, ids = hf_tokenizer(tok, max_length)
    fast.save_pretrained(str(folder))
    return ids
