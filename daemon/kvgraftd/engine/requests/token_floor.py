"""The fewest tokens a text can become, known without tokenizing it.

Tokenizing costs about a CPU-second per megabyte (SmolLM2's tokenizer, 2 cores), so
a request whose text cannot fit max_context_tokens is refused by its length before
it is tokenized (kvgraftd.engine.requests.service). The bound: a BPE tokenizer that sees every
byte of its text covers each byte by exactly one token, and no token covers more
bytes than the longest one of its vocabulary, L; so a text of B UTF-8 bytes is at
least ceil(B / L) tokens. Chat templates and special tokens only add text. For SmolLM2
L is 82 (its longest token, a newline and 80 spaces, is 81 bytes; one more for the
margin below): 4 MB of text is at least 48,781 tokens, past the default 32,768, while
English prose is about 4 bytes a token.

The bound holds only where nothing shortens the text before the BPE sees it, so a
tokenizer gets a floor only when all of this is true, else none (its texts are
tokenized, then counted, as before):
* its model is BPE that sees every byte: a byte-level pre-tokenizer (GPT-2's kind:
  SmolLM2, Llama 3) or byte fallback (Llama 2's), so no unknown-token swallows text;
* its normalizer is absent, or only prepends text or replaces a string by one at
  least as long (Llama 2's "▁" for " "): Unicode normalizations (NFC, NFKC) and
  lowercasing can make text shorter;
* its pre-tokenizer drops nothing (no whitespace splitting, no "removed" behavior);
* no added token strips the whitespace around it (lstrip, rstrip): it would cover
  any run of spaces.
L is measured by decoding every token alone, plus one byte: some decoders drop a
lone token's leading space. Decoding overcounts a token holding part of a UTF-8
character (it decodes to U+FFFD, 3 bytes), which only loosens the floor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Pre-tokenizers that split text without dropping any of it (unless told to: "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


@dataclass(frozen=True)
class TokenFloor:
    longest_token_bytes: int  # L: no token covers more bytes of text than this

    @classmethod
    def of(cls, tokenizer) -> TokenFloor | None:
        """The floor of a Hugging Face fast tokenizer; None where none is safe (see above)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not _sees_every_byte(backend):
            return None
        if backend.normalizer is not None and not _never_shortens(_state(backend.normalizer)):
            return None
        if backend.pre_tokenizer is not None and not _drops_nothing(_state(backend.pre_tokenizer)):
            return None
        if any(t.lstrip or t.rstrip for t in tokenizer.added_tokens_decoder.values()):
            return None
        texts = backend.decode_batch([[i] for i in range(len(tokenizer))], False)
        return cls(max(len(text.encode()) for text in texts) + 1)

    def tokens(self, text: str) -> int:
        """The fewest tokens `text` can be (ceil of its UTF-8 bytes / L)."""
        return -(-len(text.encode()) // self.longest_token_bytes)


def _state(component) -> dict:
    """A tokenizers component (normalizer, pre-tokenizer) as its JSON description; a
    custom one (Python code) has none, and is judged as unknown: no floor."""
    try:
        return json.loads(component.__getstate__())
    except Exception:  # what a custom component raises is its own
        return {"type": "custom"}


def _components(state: dict) -> list[dict]:
    """The steps of a component: itself, or those of a Sequence."""
    steps = state.get("normalizers") or state.get("pretokenizers")
    if state.get("type") == "Sequence" and steps is not None:
        return [step for inner in steps for step in _components(inner)]
    return [state]


def _sees_every_byte(backend) -> bool:
    model = backend.model
    if type(model).__name__ != "BPE":
        return False
    byte_level = backend.pre_tokenizer is not None and any(
        step.get("type") == "ByteLevel" for step in _components(_state(backend.pre_tokenizer))
    )
    return byte_level or bool(getattr(model, "byte_fallback", False))


def _never_shortens(normalizer: dict) -> bool:
    return all(_lengthens(step) for step in _components(normalizer))


def _lengthens(step: dict) -> bool:
    """Whether a normalizer step leaves every text at least as long in bytes."""
    if step.get("type") == "Prepend":
        return True
    pattern = step.get("pattern", {}).get("String")  # a Regex pattern could match anything
    return (
        step.get("type") == "Replace"
        and pattern is not None
        and len(step.get("content", "").encode()) >= len(pattern.encode())
    )


def _drops_nothing(pre_tokenizer: dict) -> bool:
    return all(
        step.get("type") in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in _components(pre_tokenizer)
    )
