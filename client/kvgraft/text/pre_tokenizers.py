"""How a byte-level BPE vocabulary cuts text before its merges: the `tokenizer.ggml.pre`
values of GGUF files, each with the split llama.cpp applies (src/llama-vocab.cpp).

Contract: `pre_tokenizer(name)` gives the `PreTokenizer` of a `pre` value: the regular
expressions that cut text, applied one after another (each match, and each stretch
between matches, a piece of its own: tokenizers' `Split(..., "isolated")`, as llama.cpp's
`unicode_regex_split`), and whether a piece that is itself a token skips the merges
(`ignore_merges`), and whether llama.cpp puts BOS before a text where the file does not
say (`adds_bos`). A value that is not in the table raises UnknownPreTokenizer naming it:
a vocabulary is never cut by a guess, because a wrong cut tokenizes silently worse.

The expressions are the ones the models' own tokenizer.json files give (llama.cpp keeps
them in comments beside its adapted copies); tokenizers' regex engine (Oniguruma) reads
them as they are. Where llama.cpp's adapted copy is only an approximation (Tekken's and
GPT-4o's letter classes: its engine has no Unicode letter case), kvgraft follows the model's own
expression, which the reference ids come from. The names of one family share an entry.
"""

from __future__ import annotations

from typing import NamedTuple

_CONTRACTIONS = r"'s|'t|'re|'ve|'m|'ll|'d"
GPT2 = _CONTRACTIONS + r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


class PreTokenizer(NamedTuple):
    splits: tuple[str, ...]  # applied in this order, every piece kept
    ignore_merges: bool = False  # a piece that is a token is that token
    adds_bos: bool = False  # BOS before a text where the file does not say (add_bos_token)


class UnknownPreTokenizer(ValueError):
    """A `tokenizer.ggml.pre` value kvgraft does not know how to apply."""


def _named(names: str, entry: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), entry)


TABLE: dict[str, PreTokenizer] = {
    # llama.cpp's default for a BPE vocabulary that names no pre-tokenizer
    **_named("default", PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9]{3}"))),
    **_named(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert "
        "jina-v1-en jina-v2-code roberta-bpe exaone4 mpt olmo jais trillion granite-docling",
        PreTokenizer((GPT2,)),
    ),
    **_named(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer((LLAMA3,), ignore_merges=True, adds_bos=True),
    ),
    **_named("dbrx smaug-bpe chatglm-bpe", PreTokenizer((LLAMA3,))),
    **_named("glm4 glm5", PreTokenizer((LLAMA3,), ignore_merges=True)),
    **_named(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        PreTokenizer((QWEN2,)),
    ),
    **_named("qwen35", PreTokenizer((QWEN35,))),
    **_named(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", GPT2)),
    ),
    **_named("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9]{3}"))),
    **_named("tekken", PreTokenizer((TEKKEN,), ignore_merges=True, adds_bos=True)),
    **_named("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((GPT4O,))),
    **_named("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreTokenizer(DEEPSEEK3)),
    **_named("deepseek-coder", PreTokenizer(DEEPSEEK_CODER)),
    **_named("bloom poro-chat gpt3-finnish", PreTokenizer((BLOOM,))),
    **_named("viking", PreTokenizer((BLOOM, r"\p{N}"))),
}


def pre_tokenizer(name: str) -> PreTokenizer:
    """The split of `tokenizer.ggml.pre` value `name` (UnknownPreTokenizer if none)."""
    try:
        return TABLE[name]
    except KeyError:
        raise UnknownPreTokenizer(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not one kvgraft knows; "
            f"known: {', '.join(sorted(TABLE))}"
        ) from None
