"""A model's tokenizer built from its GGUF file's metadata alone, as llama.cpp reads it.

Contract: `GgufTokenizer.load(path)` (or `from_metadata`) builds, on Hugging Face's
`tokenizers` library, the tokenizer `tokenizer.ggml.*` describes, giving the ids llama.cpp
gives for the same text (held to llama.cpp's own test vectors in tests/text):

* `gpt2` (byte-level BPE: Llama 3, Qwen, SmolLM, GPT-2, Mistral's Tekken, ...): the file's
  tokens and merges, the text cut first by the split its `tokenizer.ggml.pre` names
  (kvgraft.text.pre_tokenizers), bytes spelled as GPT-2 spells them.
* `llama` (SentencePiece BPE: Llama 2, Mistral 7B, Phi-3): merges recovered from the
  tokens' scores, a space before the text and after each control token where
  `add_space_prefix` (the default), spaces as "▁", a character with no token as its
  UTF-8 bytes' `<0xXX>` tokens.

Control tokens (token type 3, the unknown token, and the end-of-turn and FIM tokens
llama.cpp makes control tokens by their text: kvgraft.text.gguf_vocabulary) become their
ids only where asked (`split_special_tokens=False`); user-defined ones (type 4, e.g.
`<think>`) always, as in llama.cpp. Any other `tokenizer.ggml.model`, or a `pre` value not
in the table, is refused at load with a ValueError naming it. The object answers the part
of Hugging Face's fast-tokenizer interface the daemon uses (`encode`, `decode`,
`convert_ids_to_tokens`, `added_tokens_decoder`, `backend_tokenizer`,
`apply_chat_template`, the special tokens), so a model directory's transformers tokenizer
and a GGUF file's are used alike; `encode` adds no BOS unless asked
(`add_special_tokens=True`), as the daemon always asks explicitly.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as hf_pre

from kvgraft.text.chat_template import ChatTemplate
from kvgraft.text.gguf_metadata import read_metadata
from kvgraft.text.gguf_vocabulary import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Vocabulary
from kvgraft.text.pre_tokenizers import TABLE, pre_tokenizer


class GgufTokenizer:
    """A GGUF file's tokenizer (see the module's contract)."""

    def __init__(self, vocabulary: Vocabulary, name: str = "") -> None:
        self.vocabulary = vocabulary
        self.name = name
        self.backend_tokenizer = _build(vocabulary, name)
        self.chat_template = vocabulary.chat_template
        self._lock = threading.Lock()  # encode_special_tokens is the backend's state
        tokens, special = vocabulary.tokens, vocabulary.special
        self.bos_token_id, self.eos_token_id = special.get("bos"), special.get("eos")
        self.bos_token = tokens[self.bos_token_id] if self.bos_token_id is not None else None
        self.eos_token = tokens[self.eos_token_id] if self.eos_token_id is not None else None

    @classmethod
    def load(cls, path: str | Path) -> GgufTokenizer:
        return cls.from_metadata(read_metadata(path), str(path))

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], name: str) -> GgufTokenizer:
        entry = TABLE.get(str(metadata.get("tokenizer.ggml.pre", "default")))
        adds_bos = entry is not None and entry.adds_bos
        return cls(Vocabulary.of(metadata, name, adds_bos), name)

    def __deepcopy__(self, memo: dict) -> GgufTokenizer:
        """A tokenizer of its own (its own lock and Rust tokenizer, its added tokens too)."""
        copy = object.__new__(GgufTokenizer)
        copy.__dict__.update(self.__dict__)
        copy.backend_tokenizer = Tokenizer.from_str(self.backend_tokenizer.to_str())
        copy._lock = threading.Lock()
        return copy

    def __len__(self) -> int:
        """The vocabulary's size: its tokens' count (two tokens may share a text)."""
        return len(self.vocabulary.tokens)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def end_of_turn_ids(self) -> frozenset[int]:
        """The ids that end a generation (Vocabulary.end_of_generation)."""
        return self.vocabulary.end_of_generation()

    def definition_digest(self) -> bytes:
        """SHA-256 of the vocabulary and template this tokenizer is built from (the model
        fingerprint hashes it: the same whatever version of `tokenizers` builds it)."""
        return self.vocabulary.digest()

    def encode(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False
    ) -> list[int]:
        """The ids of `text`: control tokens' texts as those tokens unless
        `split_special_tokens`; `add_special_tokens`: BOS / EOS where the file adds them."""
        backend = self.backend_tokenizer
        with self._lock:
            backend.encode_special_tokens = split_special_tokens
            try:
                ids = backend.encode(text, add_special_tokens=False).ids
            finally:
                backend.encode_special_tokens = False
        if add_special_tokens:
            vocabulary = self.vocabulary
            if vocabulary.add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if vocabulary.add_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (GPT-2's byte alphabet, "▁", ...)."""
        return [self.backend_tokenizer.id_to_token(index) for index in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **context: Any,
    ) -> str:
        """The conversation rendered by the file's template (or `chat_template`), as
        transformers renders it (kvgraft.text.chat_template); text only."""
        if tokenize:
            raise ValueError("apply_chat_template renders text; tokenize it with chat_tokens")
        template = ChatTemplate(chat_template or self.chat_template, self.name)
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **context,
        )


def _build(vocabulary: Vocabulary, name: str) -> Tokenizer:
    split = pre_tokenizer(vocabulary.pre) if vocabulary.model == "gpt2" else None  # or refused
    try:
        return _built(vocabulary, split)
    except Exception as error:  # tokenizers' own, for merges or tokens it cannot take
        raise ValueError(f"{name}: its vocabulary cannot be built ({error})") from None


def _built(vocabulary: Vocabulary, split) -> Tokenizer:
    ids = {token: index for index, token in enumerate(vocabulary.tokens)}
    if split is not None:
        merges = [tuple(merge.split(" ", 1)) for merge in vocabulary.merges]
        tokenizer = Tokenizer(models.BPE(ids, merges, ignore_merges=split.ignore_merges))
        tokenizer.pre_tokenizer = hf_pre.Sequence(
            [hf_pre.Split(Regex(pattern), behavior="isolated") for pattern in split.splits]
            + [hf_pre.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
    else:
        unk = vocabulary.special.get("unk")
        tokenizer = Tokenizer(
            models.BPE(
                ids,
                _merges_by_score(vocabulary.tokens, vocabulary.scores, vocabulary.types),
                unk_token=vocabulary.tokens[unk] if unk is not None else None,
                byte_fallback=True,
                fuse_unk=True,
            )
        )
        steps = [normalizers.Prepend("▁")] if vocabulary.add_space_prefix else []
        tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if vocabulary.add_space_prefix else []
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
    types = vocabulary.types
    tokenizer.add_special_tokens(
        [
            AddedToken(vocabulary.tokens[i], special=True, normalized=False)
            for i in np.flatnonzero((types == CONTROL) | (types == UNKNOWN))
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(vocabulary.tokens[i], special=False, normalized=False)
            for i in np.flatnonzero(types == USER_DEFINED)
        ]
    )
    return tokenizer


def _merges_by_score(
    tokens: list[str], scores: np.ndarray, types: np.ndarray
) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every (left, right) of two
    normal tokens whose join is a token, the join with the higher score first (llama.cpp
    merges the best-scored pair first; equal scores: by the pieces' ids)."""
    ids = {token: index for index, token in enumerate(tokens) if types[index] == NORMAL}
    found: list[tuple[float, int, int, str, str]] = []
    for token, index in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-float(scores[index]), ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
