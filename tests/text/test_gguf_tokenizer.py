"""Tokenizers built from a GGUF file's metadata alone, held to llama.cpp's own test vectors.

Every input of every `.inp` in ../shared/vocab (llama.cpp's tokenizer tests, made with
each family's reference tokenizer) must give exactly the ids of its `.out`; byte-level
vocabularies decode every input back to itself. What kvgraft cannot build (another
tokenizer model, an unknown pre-tokenizer) is refused at load, naming it; a file that is
not GGUF, or is cut short, is refused naming the file. The text path imports neither
transformers nor torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from kvgraft.text.gguf_metadata import read_metadata
from kvgraft.text.gguf_tokenizer import CONTROL, NORMAL, USER_DEFINED, GgufTokenizer

VOCAB = Path(__file__).resolve().parents[2].parent / "shared" / "vocab"
VOCABULARIES = ["gpt-2", "llama-bpe", "qwen2", "llama-spm", "phi-3"]
BYTE_LEVEL = ["gpt-2", "llama-bpe", "qwen2"]  # decode(encode(s)) == s for every s
SEPARATOR = "\n__ggml_vocab_test__\n"

needs_vocab = pytest.mark.skipif(
    not VOCAB.is_dir(), reason=f"{VOCAB} (llama.cpp's tokenizer test data) is not here"
)


def vectors(name: str) -> list[tuple[str, list[int]]]:
    """(input, ids) of a vocabulary's test file, split as llama.cpp's test-tokenizer-0 does."""
    base = VOCAB / f"ggml-vocab-{name}.gguf"
    raw = Path(f"{base}.inp").read_text(encoding="utf-8")
    inputs = raw.split(SEPARATOR)
    lines = Path(f"{base}.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(inputs) and not any(lines[len(inputs) :]), "one line per input"
    return [
        (text, [int(i) for i in line.split()])
        for text, line in zip(inputs, lines[: len(inputs)], strict=True)
    ]


@pytest.fixture(scope="module", params=VOCABULARIES)
def vocabulary(request) -> tuple[str, GgufTokenizer]:
    return request.param, GgufTokenizer.load(VOCAB / f"ggml-vocab-{request.param}.gguf")


@needs_vocab
def test_every_vector_tokenizes_as_the_reference(vocabulary) -> None:
    name, tokenizer = vocabulary
    cases = vectors(name)
    assert len(cases) >= 40
    differ = [(text, tokenizer.encode(text), ids) for text, ids in cases]
    differ = [case for case in differ if case[1] != case[2]]
    assert not differ, f"{name}: {len(differ)} of {len(cases)} differ, first {differ[0]!r}"


@needs_vocab
@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_byte_level_vocabularies_decode_every_input_back(name: str) -> None:
    tokenizer = GgufTokenizer.load(VOCAB / f"ggml-vocab-{name}.gguf")
    for text, _ in vectors(name):
        assert tokenizer.decode(tokenizer.encode(text)) == text


@needs_vocab
def test_sentencepiece_decodes_back_up_to_its_prefix_space() -> None:
    tokenizer = GgufTokenizer.load(VOCAB / "ggml-vocab-llama-spm.gguf")
    for text in ["Hello world", " leading space", "Äpfel\n\tand 🦙.cpp", "w048 7tuijk"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


@needs_vocab
def test_control_tokens_only_where_asked_and_bos_where_the_file_says() -> None:
    qwen = GgufTokenizer.load(VOCAB / "ggml-vocab-qwen2.gguf")
    end = qwen.encode("<|im_end|>")
    assert end == [151645]
    assert 151645 not in qwen.encode("<|im_end|>", split_special_tokens=True)
    assert 151645 in qwen.end_of_turn_ids() and qwen.eos_token_id in qwen.end_of_turn_ids()
    llama3 = GgufTokenizer.load(VOCAB / "ggml-vocab-llama-bpe.gguf")
    assert llama3.encode("hi", add_special_tokens=True)[0] == 128000  # <|begin_of_text|>
    assert llama3.encode("hi")[0] != 128000
    assert 128009 in llama3.end_of_turn_ids()  # <|eot_id|>
    spm = GgufTokenizer.load(VOCAB / "ggml-vocab-llama-spm.gguf")
    assert spm.encode("hi", add_special_tokens=True)[0] == 1  # <s>: add_bos_token


def _write(path: Path, model: str, pre: str, tokens: list[str], types: list[int]) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_user_defined_tokens_are_always_whole_control_tokens_only_when_parsed(tmp_path) -> None:
    tokens = ["a", "b", "ab", "<think>", "<|end|>", "Ġ"]
    types = [NORMAL, NORMAL, NORMAL, USER_DEFINED, CONTROL, NORMAL]
    tokenizer = GgufTokenizer.load(_write(tmp_path / "v.gguf", "gpt2", "gpt-2", tokens, types))
    assert tokenizer.encode("ab<think>ab<|end|>") == [2, 3, 2, 4]
    assert tokenizer.encode("<think>", split_special_tokens=True) == [3]  # not a control token
    assert 4 not in tokenizer.encode("<|end|>", split_special_tokens=True)
    assert tokenizer.end_of_turn_ids() == {4}


@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [("bert", "default", "'bert'"), ("gpt2", "made-up-pre", "'made-up-pre'")],
)
def test_what_kvgraft_cannot_build_is_refused_naming_it(tmp_path, model, pre, named) -> None:
    path = _write(tmp_path / "v.gguf", model, pre, ["a", "b", "ab"], [NORMAL] * 3)
    with pytest.raises(ValueError, match=named):
        GgufTokenizer.load(path)


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused(tmp_path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_metadata(not_gguf)
    whole = _write(tmp_path / "v.gguf", "gpt2", "gpt-2", ["a", "b", "ab"], [NORMAL] * 3)
    data = whole.read_bytes()
    assert read_metadata(whole)["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
    assert np.array_equal(read_metadata(whole)["tokenizer.ggml.token_type"], [1, 1, 1])
    for cut in (10, len(data) // 2, len(data) - 40):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"truncated|ends inside"):
            read_metadata(short)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        read_metadata(empty)


@needs_vocab
def test_the_text_path_imports_neither_transformers_nor_torch() -> None:
    """What the daemon runs for a GGUF model's text: metadata, tokenizer, template, ids."""
    code = f"""
import sys
from kvgraft.text.chat_tokens import ChatTokens, TransformersText
from kvgraft.text.gguf_tokenizer import GgufTokenizer
tokenizer = GgufTokenizer.load({str(VOCAB / "ggml-vocab-qwen2.gguf")!r})
def render(messages, prompt):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=prompt)
chat = ChatTokens(TransformersText(tokenizer), render, tokenizer.chat_template)
ids = chat.ids([{{"role": "user", "content": "hi <|im_end|>"}}], True)
assert tokenizer.decode(ids).endswith("<|im_start|>assistant\\n")
loaded = sorted(name for name in ("transformers", "torch") if name in sys.modules)
print(",".join(loaded) or "neither")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "neither"
