"""A model's tokenizer and template as the adapter holds them: loaded, probed, replaced.

Contract: `load(path)` is the tokenizer a GGUF file holds (kvgraft.text's GgufTokenizer,
built from its metadata: no transformers) or a Hugging Face directory holds (transformers'
AutoTokenizer, imported only then); None where it holds none (the tiny test models read
token ids); a GGUF tokenizer kvgraft cannot build is FailedPrecondition saying what to give
instead. `end_of_generation(config, tokenizer)` is the ids a generation stops at: the
config's and tokenizer's EOS and, for a GGUF file's, EOT, EOM, the FIM ids and the
end-of-turn tokens llama.cpp recognizes. `replace_template` checks a template before the
tokenizer takes it (InvalidArgument naming what fails); `template_stability` is what
`kvgraft info` says of the template (kvgraft.text.chat_template.stability).
"""

from __future__ import annotations

from pathlib import Path

from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.text.chat_template import ChatTemplate, TemplateFailure, stability
from kvgraft.text.gguf_metadata import read_metadata
from kvgraft.text.gguf_tokenizer import GgufTokenizer

TEXT_VERSION = 2  # GGUF tokenizers built by kvgraft.text (1: through transformers)


def load(path: Path):
    """The tokenizer a model directory or GGUF file holds; None where it holds none."""
    if path.is_dir():
        names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((path / name).exists() for name in names):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    try:
        metadata = read_metadata(path)
        if "tokenizer.ggml.model" not in metadata:
            return None
        return GgufTokenizer.from_metadata(metadata, path.name)
    except ValueError as error:  # a tokenizer or pre-tokenizer kvgraft does not build
        raise FailedPrecondition(
            f"{error}. Give the model a tokenizer kvgraft reads (--tokenizer FILE: a GGUF "
            "whose vocabulary is this model's), or load its Hugging Face directory"
        ) from None


def end_of_generation(config, tokenizer) -> frozenset[int]:
    found = getattr(config, "eos_token_id", None)
    ids = set(found if isinstance(found, list) else [found] if found is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if isinstance(tokenizer, GgufTokenizer):  # EOT, EOM and the end-of-turn tokens too
        ids.update(tokenizer.end_of_turn_ids())
    return frozenset(ids)


def replace_template(tokenizer, source: str, name: str) -> None:
    """`tokenizer` renders with `source` from now on, once it compiles."""
    if tokenizer is None:
        raise InvalidArgument(
            f"model {name} has no tokenizer, so a chat template cannot be used with it"
        )
    try:
        ChatTemplate(source, name)
    except TemplateFailure as failure:
        raise InvalidArgument(f"{failure}; fix the template file") from None
    tokenizer.chat_template = source


def template_stability(tokenizer, name: str) -> str:
    source = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    tokens = {
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
    }
    return stability(source, name, **tokens)
