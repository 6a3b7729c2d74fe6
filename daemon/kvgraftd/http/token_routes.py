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
from typing import Any

from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.text.token_pieces import piece, token_bytes
from kvgraftd.http.openai_requests import checked_text, flag, json_object


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
    return {"tokens": [{"id": i, "piece": piece(b)} for i, b in zip(ids, pieces, strict=True)]}


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


def _tokenizer(adapter):
    if adapter.tokenizer is None:
        raise FailedPrecondition(
            f"model {adapter.name} has no tokenizer (a tiny test model reads token ids): "
            "/tokenize and /detokenize need a model with one"
        )
    return adapter.tokenizer
