"""`POST /tokenize` and `POST /detokenize` in llama.cpp server's shapes, over the served
model's own tokenizer.

    {"content": "...", "add_special": false, "parse_special": true, "with_pieces": false}
        -> {"tokens": [id, ...]}   (with_pieces: [{"id": id, "piece": "..."}, ...])
    {"tokens": [id, ...]} -> {"content": "..."}

As llama.cpp's: `add_special` adds what the tokenizer puts around a text (a BOS token;
SmolLM2 adds none); `parse_special` (default true, llama.cpp's default and what
/v1/completions does with a raw prompt) lets the text of a control token (`<|im_end|>`)
become that token, false keeps it text. A piece is the token's bytes as the model reads
them: a string where they are valid UTF-8, else the list of byte values (a character
split across tokens, an emoji's first bytes). Detokenizing renders control tokens as
their text, as llama.cpp's does.

Every field is checked by name (InvalidArgument: 400); a text or list is at most
max_request_bytes, which the HTTP layer enforces before this runs. The tokenizer is the
model's, shared by every tenant: any authenticated caller may use it. The functions here
run on a pool thread (a long text takes about a CPU-second per megabyte).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraftd.http.openai_requests import checked_text, flag, json_object

# SentencePiece's byte-fallback tokens (<0xC3>) and its word-boundary mark, as llama.cpp's
# token_to_piece reads them
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_MARK = "\u2581"


def tokenize(body: Any, adapter) -> dict[str, Any]:
    """The answer of POST /tokenize for the request body `body`."""
    body = json_object(body, "the request body")
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidArgument("content must be a string: the text to tokenize", param="content")
    checked_text(content, "content")
    add_special = flag(body, "add_special", False)
    parse_special = flag(body, "parse_special", True)
    with_pieces = flag(body, "with_pieces", False)
    tokenizer = _tokenizer(adapter)
    ids = adapter.encode(content, parse_special=parse_special, add_special=add_special)
    if not with_pieces:
        return {"tokens": ids}
    pieces = token_bytes(tokenizer, ids)
    return {"tokens": [{"id": i, "piece": _piece(b)} for i, b in zip(ids, pieces, strict=True)]}


def detokenize(body: Any, adapter) -> dict[str, Any]:
    """The answer of POST /detokenize for the request body `body`."""
    body = json_object(body, "the request body")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidArgument(
            "tokens must be an array of token ids (what /tokenize gives)", param="tokens"
        )
    tokenizer = _tokenizer(adapter)
    vocabulary = len(tokenizer)
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocabulary:
            raise InvalidArgument(
                f"tokens[{index}] = {json.dumps(token)[:40]} is not a token id of this model: "
                f"send whole numbers in 0..{vocabulary - 1}",
                param=f"tokens[{index}]",
            )
    return {"content": tokenizer.decode(tokens, skip_special_tokens=False)}


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


def _piece(raw: bytes) -> str | list[int]:
    """llama.cpp's `piece`: the text where the bytes are valid UTF-8, else the bytes."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


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


def _tokenizer(adapter):
    if adapter.tokenizer is None:
        raise FailedPrecondition(
            f"model {adapter.name} has no tokenizer (a tiny test model reads token ids): "
            "/tokenize and /detokenize need a model with one"
        )
    return adapter.tokenizer
