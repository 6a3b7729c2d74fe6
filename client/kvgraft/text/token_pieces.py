"""The bytes each token stands for, as llama.cpp's `token_to_piece` gives them.

Contract: `token_bytes(tokenizer, ids)` gives, for a tokenizer with Hugging Face's
fast-tokenizer interface (a GGUF file's kvgraft.text.gguf_tokenizer.GgufTokenizer, or a
model directory's transformers tokenizer), each id's bytes: an added token's text; a
byte-level BPE token's characters mapped back to their bytes (GPT-2's table); a
SentencePiece token with its mark as a space, a byte token (`<0xC3>`) as its byte. A
token's bytes need not be UTF-8 on their own (a character split across tokens).
`piece(raw)` is llama.cpp server's `piece`: the text where valid UTF-8, else the bytes.
"""

from __future__ import annotations

import json
import re

# SentencePiece's byte-fallback tokens (<0xC3>) and its word-boundary mark, as llama.cpp's
# token_to_piece reads them
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_MARK = "\u2581"


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The bytes each token stands for, as llama.cpp's token_to_piece gives them: an added
    token's text; a byte-level BPE token's characters mapped back to their bytes (GPT-2's
    table); a SentencePiece token with its mark as a space, a byte token as its byte."""
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    byte_level = _byte_level(tokenizer)
    out = []
    for token_id, token in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        if token_id in added:
            out.append(added[token_id].encode())
        elif byte_level and all(char in BYTE_OF_CHAR for char in token):
            out.append(bytes(BYTE_OF_CHAR[char] for char in token))
        elif match := BYTE_TOKEN.fullmatch(token):
            out.append(bytes([int(match[1], 16)]))
        else:
            out.append(token.replace(SPACE_MARK, " ").encode())
    return out


def piece(raw: bytes) -> str | list[int]:
    """llama.cpp's `piece`: the text where the bytes are valid UTF-8, else the bytes."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (GPT-2's kind: SmolLM2, Llama 3)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = backend.decoder if backend is not None else None
    if decoder is None:
        return False
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:  # a custom (Python) decoder describes itself in no JSON
        return False
    steps = state.get("decoders") or [] if state.get("type") == "Sequence" else [state]
    return any(step.get("type") == "ByteLevel" for step in steps)


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each byte is written as a printable
    character (itself where printable, else one from 256 on), so a token's characters
    give back its bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


BYTE_OF_CHAR = _gpt2_byte_table()
