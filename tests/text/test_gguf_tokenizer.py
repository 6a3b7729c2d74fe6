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
from kvgraft.text.gguf_tokenizer import GgufTokenizer
from kvgraft.text.gguf_vocabulary import CONTROL, NORMAL, USER_DEFINED

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


def _vocabulary_file(path: Path, **fields) -> Path:
    """A vocabulary-only GGUF of a few tokens, `fields` replacing what it holds."""
    writer = GGUFWriter(str(path), "llama")
    values = {
        "model": "gpt2", "pre": "gpt-2", "tokens": ["a", "b", "ab", "<|im_end|>"],
        "types": [NORMAL, NORMAL, NORMAL, USER_DEFINED], "merges": ["a b"],
    }  # fmt: skip
    values.update(fields)
    writer.add_tokenizer_model(values["model"])
    writer.add_tokenizer_pre(values["pre"])
    writer.add_token_list(values["tokens"])
    writer.add_token_types(values["types"])
    if values["merges"] is not None:
        writer.add_token_merges(values["merges"])
    if "scores" in values:
        writer.add_token_scores(values["scores"])
    for key, value in values.get("ids", {}).items():
        writer.add_uint32(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_user_defined_tokens_are_always_whole_control_tokens_only_when_parsed(tmp_path) -> None:
    tokens = ["a", "b", "ab", "<think>", "<|end|>", "Ġ"]
    types = [NORMAL, NORMAL, NORMAL, USER_DEFINED, CONTROL, NORMAL]
    tokenizer = GgufTokenizer.load(
        _vocabulary_file(tmp_path / "v.gguf", tokens=tokens, types=types)
    )
    assert tokenizer.encode("ab<think>ab<|end|>") == [2, 3, 2, 4]
    assert tokenizer.encode("<think>", split_special_tokens=True) == [3]  # not a control token
    assert 4 not in tokenizer.encode("<|end|>", split_special_tokens=True)
    assert tokenizer.end_of_turn_ids() == {4}


@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [("bert", "default", "'bert'"), ("gpt2", "made-up-pre", "'made-up-pre'")],
)
def test_what_kvgraft_cannot_build_is_refused_naming_it(tmp_path, model, pre, named) -> None:
    path = _vocabulary_file(tmp_path / "v.gguf", model=model, pre=pre)
    with pytest.raises(ValueError, match=named):
        GgufTokenizer.load(path)


def test_a_file_that_is_not_gguf_or_is_cut_short_is_refused(tmp_path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_metadata(not_gguf)
    whole = _vocabulary_file(tmp_path / "v.gguf", tokens=["a", "b", "ab"], types=[NORMAL] * 3)
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


def test_an_end_of_turn_token_is_a_control_token_whatever_the_file_says(tmp_path) -> None:
    """Regression (review): an older file's user-defined `<|im_end|>` was matched in a
    message's text (user-defined tokens always are): a forged turn. llama.cpp makes every
    end-of-turn text a control token; so does kvgraft, and generation stops there."""
    tokenizer = GgufTokenizer.load(_vocabulary_file(tmp_path / "v.gguf"))
    assert tokenizer.encode("ab<|im_end|>") == [2, 3]
    assert 3 not in tokenizer.encode("<|im_end|>", split_special_tokens=True)
    assert tokenizer.end_of_turn_ids() == {3}
    with_fim = _vocabulary_file(tmp_path / "fim.gguf", ids={"fim_sep_token_id": 2})
    assert GgufTokenizer.load(with_fim).end_of_turn_ids() == {2, 3}


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"merges": None}, "merges is not a list"),
        ({"merges": ["ab"]}, "merges is not a list"),
        ({"types": [NORMAL, NORMAL]}, "token_type does not give a number for each token"),
        ({"model": "llama", "merges": None}, "scores does not give a number"),
        ({"model": "llama", "merges": None, "scores": [0.0] * 3}, "scores does not give"),
        (
            {
                "model": "llama",
                "merges": None,
                "tokens": ["x" * 15000],
                "types": [1],
                "scores": [0],
            },
            "too long to be a SentencePiece vocabulary",
        ),
    ],
)
def test_a_malformed_vocabulary_is_refused_naming_the_file(tmp_path, fields, said) -> None:
    path = _vocabulary_file(tmp_path / "bad.gguf", **fields)
    with pytest.raises(ValueError, match=f"bad.gguf.*{said}"):
        GgufTokenizer.load(path)


def test_nested_arrays_and_repeated_keys_are_refused(tmp_path) -> None:
    """Regression (review): nested arrays recursed without a bound (a RecursionError from
    a small file); a key given twice was silently overwritten."""
    path = _vocabulary_file(tmp_path / "v.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"tokenizer.ggml.merges") + len(b"tokenizer.ggml.merges")
    assert data[at : at + 8] == bytes([9, 0, 0, 0, 8, 0, 0, 0])  # array of strings
    nested = bytes(data[: at + 4]) + bytes([9, 0, 0, 0]) + bytes(data[at + 8 :])
    (tmp_path / "nested.gguf").write_bytes(nested)
    with pytest.raises(ValueError, match="array of arrays"):
        read_metadata(tmp_path / "nested.gguf")
    # general.architecture renamed tokenizer.ggml.model (as long): that key given twice
    twice = bytes(data).replace(b"general.architecture", b"tokenizer.ggml.model", 1)
    (tmp_path / "twice.gguf").write_bytes(twice)
    with pytest.raises(ValueError, match=r"gives the metadata key 'tokenizer\.ggml\.model' twice"):
        read_metadata(tmp_path / "twice.gguf")


def test_tokens_sharing_a_text_keep_their_ids_and_the_unknown_token_is_read(tmp_path) -> None:
    tokens = ["a", "b", "ab", "<|im_end|>", "a"]  # a file may give a text twice
    path = _vocabulary_file(tmp_path / "v.gguf", tokens=tokens, types=[NORMAL] * 3 + [3, 1])
    tokenizer = GgufTokenizer.load(path)
    assert len(tokenizer) == 5  # the model's rows, not the distinct texts
    spm = GgufTokenizer.load(VOCAB / "ggml-vocab-llama-spm.gguf")
    assert spm.vocabulary.special["unk"] == 0


def test_the_default_models_smollm_split_cuts_digits_one_by_one() -> None:
    """SmolLM's `pre` (llama.cpp's smollm: digits alone, then GPT-2's split)."""
    from kvgraft.text.default_model import default_model_path

    tokenizer = GgufTokenizer.load(default_model_path())
    assert tokenizer.vocabulary.pre == "smollm"
    ids = tokenizer.encode("Hello 12345 world")
    assert ids == [19556, 216, 33, 34, 35, 36, 37, 905]
    assert [tokenizer.decode([i]) for i in ids[2:7]] == list("12345")


def test_a_copy_keeps_added_tokens_and_has_its_own_lock() -> None:
    import copy

    from tokenizers import AddedToken

    tokenizer = GgufTokenizer.load(VOCAB / "ggml-vocab-gpt-2.gguf")
    tokenizer.backend_tokenizer.add_special_tokens([AddedToken("<|x|>", special=True)])
    copied = copy.deepcopy(tokenizer)
    assert copied.encode("<|x|>") == tokenizer.encode("<|x|>") and len(copied.encode("<|x|>")) == 1
    assert copied._lock is not tokenizer._lock
    assert copied.backend_tokenizer is not tokenizer.backend_tokenizer
