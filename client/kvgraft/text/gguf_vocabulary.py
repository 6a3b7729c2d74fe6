"""A GGUF file's vocabulary: its `tokenizer.*` metadata, checked and read as llama.cpp reads it.

Contract: `Vocabulary.of(metadata, name)` gives the tokenizer model, the pre-tokenizer
name, the tokens with their types, the merges or scores, the special ids, the BOS / EOS
flags and the chat template, or a ValueError naming the file and what is wrong (no
tokenizer, a model kvgraft does not build, missing or mismatched tokens, types, scores or
merges, a vocabulary too costly to read). As llama.cpp does, a token whose text marks an
end of turn or a fill-in-the-middle pad, repository or file separator (`<|im_end|>`,
`<|eot_id|>`, `<|fim_pad|>`, ...) is a control token whatever type the file gives it (an
older file's user-defined `<|im_end|>` would otherwise be read in a message's text:
a forged turn), and `end_of_generation` holds EOS, EOT, EOM, the FIM ids and those texts.
`digest()` is a SHA-256 of everything that decides the ids of a text (the model
fingerprint hashes it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # token types (GGUF's, llama.cpp's)
MODELS = ("gpt2", "llama")  # the tokenizer.ggml.model values built here
ROLES = {  # special ids: role -> the key's name in tokenizer.ggml.
    "bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
    "eot": "eot_token_id", "eom": "eom_token_id", "fim_pad": "fim_pad_token_id",
    "fim_rep": "fim_rep_token_id", "fim_sep": "fim_sep_token_id",
}  # fmt: skip
# tokens llama.cpp ends a generation at, by their text (llama-vocab.cpp), made control tokens
END_OF_GENERATION_TEXTS = frozenset(
    {
        *("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>"),
        *("<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>"),
        *("[EOT]", "<｜end▁of▁sentence｜>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>"),
        *("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>", "<|file_sep|>"),
    }
)
# what reading a SentencePiece vocabulary's merges may cost: the sum of its tokens' squared
# lengths (Llama 2's is ~1.5 million; a hostile file's could take hours)
MAX_MERGE_WORK = 200_000_000


@dataclass
class Vocabulary:
    model: str
    pre: str
    tokens: list[str]
    types: np.ndarray
    scores: np.ndarray | None = None
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # ROLES' roles present
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str = ""

    @classmethod
    def of(cls, metadata: dict[str, Any], name: str, adds_bos: bool = False) -> Vocabulary:
        """`adds_bos`: whether llama.cpp puts BOS before a text of this `pre` value where the
        file does not say (kvgraft.text.pre_tokenizers)."""

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
        tokens = key("tokens")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, str) for t in tokens)
        ):
            raise ValueError(f"{name}: tokenizer.ggml.tokens is not a list of token texts")
        types = _numbers(key("token_type", [NORMAL] * len(tokens)), len(tokens), "token_type", name)
        spm = model == "llama"
        scores = key("scores")
        if spm:
            scores = _numbers(scores, len(tokens), "scores", name).astype(np.float32)
            if sum(len(token) ** 2 for token in tokens) > MAX_MERGE_WORK:
                raise ValueError(
                    f"{name}: its tokens are too long to be a SentencePiece vocabulary"
                )
        merges = key("merges")
        if not spm and (
            not isinstance(merges, list)
            or not all(isinstance(m, str) and " " in m.strip(" ") for m in merges)
        ):
            raise ValueError(f"{name}: tokenizer.ggml.merges is not a list of 'left right' pairs")
        special = {}
        for role, suffix in ROLES.items():
            index = key(suffix)
            if isinstance(index, int) and 0 <= index < len(tokens):
                special[role] = index
        types = types.astype(np.int32)
        for index, token in enumerate(tokens):  # llama.cpp's "control-looking" tokens
            if token in END_OF_GENERATION_TEXTS:
                types[index] = CONTROL
        return cls(
            model=model,
            pre=str(key("pre", "default")),
            tokens=tokens,
            types=types,
            scores=scores if spm else None,
            merges=[] if spm else merges,
            special=special,
            add_bos=bool(key("add_bos_token", spm or adds_bos)),
            add_eos=bool(key("add_eos_token", False)),
            add_space_prefix=bool(key("add_space_prefix", spm)),
            chat_template=str(metadata.get("tokenizer.chat_template") or ""),
        )

    def end_of_generation(self) -> frozenset[int]:
        """The ids that end a generation: EOS, EOT, EOM, the FIM ids, and the control
        tokens llama.cpp takes for an end by their text."""
        ids = {index for role, index in self.special.items() if role not in ("bos", "unk")}
        ids.update(i for i, token in enumerate(self.tokens) if token in END_OF_GENERATION_TEXTS)
        return frozenset(ids)

    def digest(self) -> bytes:
        """SHA-256 of what decides a text's ids (and the template), independent of the
        library that builds the tokenizer."""
        digest = hashlib.sha256(b"kvgraft-vocabulary/1\0")
        described = {
            "model": self.model, "pre": self.pre, "special": self.special,
            "add_bos": self.add_bos, "add_eos": self.add_eos,
            "add_space_prefix": self.add_space_prefix, "chat_template": self.chat_template,
        }  # fmt: skip
        digest.update(json.dumps(described, sort_keys=True).encode())
        for strings in (self.tokens, self.merges):
            digest.update(len(strings).to_bytes(8, "little"))
            for text in strings:
                data = text.encode("utf-8", "surrogatepass")
                digest.update(len(data).to_bytes(8, "little") + data)
        digest.update(self.types.astype("<i4").tobytes())
        if self.scores is not None:
            digest.update(self.scores.astype("<f4").tobytes())
        return digest.digest()


def _numbers(value: Any, count: int, what: str, name: str) -> np.ndarray:
    array = np.asarray(value) if value is not None else None
    if array is None or array.ndim != 1 or array.size != count or array.dtype.kind not in "iuf":
        raise ValueError(f"{name}: tokenizer.ggml.{what} does not give a number for each token")
    return array
