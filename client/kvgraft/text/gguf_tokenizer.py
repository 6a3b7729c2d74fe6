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

Control tokens (token type 3, and the unknown token) become their ids only where asked
(`split_special_tokens=False`); user-defined ones (type 4, e.g. `<think>`) always, as in
llama.cpp. Any other `tokenizer.ggml.model`, or a `pre` value not in the table, is refused
at load with a ValueError naming it. The object answers the part of Hugging Face's
fast-tokenizer interface the daemon uses (`encode`, `decode`, `convert_ids_to_tokens`,
`added_tokens_decoder`, `backend_tokenizer`, `apply_chat_template`, the special tokens),
so a model directory's transformers tokenizer and a GGUF file's are used alike.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as hf_pre

from kvgraft.text.chat_template import ChatTemplate
from kvgraft.text.gguf_metadata import read_metadata
from kvgraft.text.pre_tokenizers import TABLE, pre_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # token types
MODELS = ("gpt2", "llama")  # the tokenizer.ggml.model values built here
# end-of-generation tokens llama.cpp recognizes by their text (llama-vocab.cpp)
END_OF_TURN_TEXTS = frozenset(
    {
        *("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>"),
        *("<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"),
        *("[EOT]", "<｜end▁of▁sentence｜>"),
    }
)


@dataclass
class Vocabulary:
    """The `tokenizer.*` metadata of a GGUF file."""

    model: str
    pre: str
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray | None = None
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, eot, eom, pad
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str = ""

    @classmethod
    def of(cls, metadata: dict[str, Any], name: str) -> Vocabulary:
        def key(suffix: str, default: Any = None) -> Any:
            return metadata.get(f"tokenizer.ggml.{suffix}", default)

        model = key("model")
        if model is None:
            raise ValueError(f"{name} holds no tokenizer (no tokenizer.ggml.model)")
        if model not in MODELS:
            raise ValueError(
                f"{name}: tokenizer model {model!r} (tokenizer.ggml.model) is not one kvgraft "
                f"builds; it builds {', '.join(MODELS)}"
            )
        tokens = list(key("tokens") or [])
        types = key("token_type")
        found = {
            role: key(f"{role}_token_id") for role in ("bos", "eos", "unk", "eot", "eom", "pad")
        }
        special = {
            role: int(index)
            for role, index in found.items()
            if index is not None and 0 <= int(index) < len(tokens)
        }
        spm = model == "llama"
        return cls(
            model=model,
            pre=str(key("pre", "default")),
            tokens=tokens,
            types=np.asarray(types if types is not None else [NORMAL] * len(tokens), np.int32),
            scores=None if key("scores") is None else np.asarray(key("scores"), np.float32),
            merges=list(key("merges") or []),
            special=special,
            add_bos=bool(key("add_bos_token", spm or _adds_bos(key("pre")))),
            add_eos=bool(key("add_eos_token", False)),
            add_space_prefix=bool(key("add_space_prefix", spm)),
            chat_template=str(metadata.get("tokenizer.chat_template") or ""),
        )


def _adds_bos(pre: str | None) -> bool:
    entry = TABLE.get(pre or "default")
    return entry is not None and entry.adds_bos


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
        return cls(Vocabulary.of(metadata, name), name)

    def __deepcopy__(self, memo: dict) -> GgufTokenizer:
        """A tokenizer of its own (its own lock), built again from the same vocabulary."""
        copy = GgufTokenizer(self.vocabulary, self.name)
        copy.chat_template = self.chat_template
        return copy

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def end_of_turn_ids(self) -> frozenset[int]:
        """The ids that end a generation: EOS, EOT, EOM and the control tokens llama.cpp
        takes for an end of turn by their text."""
        vocabulary = self.vocabulary
        ids = {vocabulary.special[r] for r in ("eos", "eot", "eom") if r in vocabulary.special}
        ids.update(
            index
            for index, token in self.added_tokens_decoder.items()
            if token.special and token.content in END_OF_TURN_TEXTS
        )
        return frozenset(ids)

    def encode(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False
    ) -> list[int]:
        """The ids of `text`: control tokens' texts as those tokens unless
        `split_special_tokens`; `add_special_tokens`: BOS / EOS where the file adds them."""
        with self._lock:
            self.backend_tokenizer.encode_special_tokens = split_special_tokens
            ids = self.backend_tokenizer.encode(text, add_special_tokens=False).ids
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
    ids = {token: index for index, token in enumerate(vocabulary.tokens)}
    if vocabulary.model == "gpt2":
        split = pre_tokenizer(vocabulary.pre)  # refuses an unknown value
        merges = [tuple(merge.split(" ", 1)) for merge in vocabulary.merges]
        tokenizer = Tokenizer(models.BPE(ids, merges, ignore_merges=split.ignore_merges))
        tokenizer.pre_tokenizer = hf_pre.Sequence(
            [hf_pre.Split(Regex(pattern), behavior="isolated") for pattern in split.splits]
            + [hf_pre.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
    else:
        if vocabulary.scores is None:
            raise ValueError(f"{name}: a SentencePiece vocabulary without tokenizer.ggml.scores")
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
    merges the best-scored pair first; equal scores: the shorter left piece first)."""
    ids = {token: index for index, token in enumerate(tokens) if types[index] == NORMAL}
    found: list[tuple[float, int, int, str, str]] = []
    for token, index in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-float(scores[index]), ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
