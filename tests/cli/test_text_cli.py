"""`kvgraft tokenize` and `kvgraft detokenize`: offline, no daemon (the server flag points
nowhere), with the code the daemon runs (kvgraft.text).

A text's ids are the vocabulary's (Qwen 2's file: llama.cpp's own vector for "Hello world");
`--json` gives the ids, their count and each piece; a conversation is rendered with the
file's template, its markers in a message kept as text; detokenize gives the text back;
what cannot work is refused with the fix: a flag that belongs to the other input, an id
past the vocabulary, a file that is not GGUF, a template that refuses the conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_usage import kvgraft

VOCAB = Path(__file__).resolve().parents[2].parent / "shared" / "vocab"
QWEN2 = VOCAB / "ggml-vocab-qwen2.gguf"
IM_START, IM_END = 151644, 151645

pytestmark = pytest.mark.skipif(not QWEN2.is_file(), reason=f"{VOCAB} is not here")


def test_a_text_and_its_pieces_and_back() -> None:
    plain = kvgraft("tokenize", "--model", str(QWEN2), "--text", "Hello world")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["9707", "1879"]
    document = json.loads(
        kvgraft("--json", "tokenize", "--model", str(QWEN2), "--text", "🦙 <|im_end|>").stdout
    )
    assert document["tokens"][-1] == IM_END and document["count"] == len(document["tokens"])
    assert document["pieces"][0] == "🦙" and document["pieces"][-1] == "<|im_end|>"
    text = kvgraft("tokenize", "--model", str(QWEN2), "--text", "<|im_end|>", "--no-parse-special")
    assert str(IM_END) not in text.stdout.split()
    back = kvgraft("detokenize", "--model", str(QWEN2), "--ids", "9707,1879")
    assert back.returncode == 0 and back.stdout == "Hello world\n"


def test_a_conversation_is_rendered_and_its_messages_stay_text(tmp_path) -> None:
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi<|im_end|>"}]))
    result = kvgraft("--json", "tokenize", "--model", str(QWEN2), "--messages", str(messages))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["rendered"].endswith("<|im_start|>user\nhi<|im_end|><|im_end|>\n"
                                         "<|im_start|>assistant\n")  # fmt: skip
    # the system turn, the user's and the opening of the answer; the message's marker is text
    assert document["tokens"].count(IM_START) == 3 and document["tokens"].count(IM_END) == 2


def test_what_cannot_work_is_refused_saying_what_to_do(tmp_path) -> None:
    messages = tmp_path / "chat.json"
    messages.write_text('[{"role": "user", "content": "hi"}]')
    both = kvgraft("tokenize", "--model", str(QWEN2), "--messages", str(messages), "--add-special")
    assert both.returncode == 2 and "are for a text" in both.stderr
    alone = kvgraft("tokenize", "--model", str(QWEN2), "--text", "x", "--no-generation-prompt")
    assert alone.returncode == 2 and "go with --messages" in alone.stderr
    past = kvgraft("detokenize", "--model", str(QWEN2), "--ids", "999999")
    assert past.returncode == 1 and "not in" in past.stderr and "151936 tokens" in past.stderr
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a model")
    refused = kvgraft("tokenize", "--model", str(not_gguf), "--text", "x")
    assert refused.returncode == 1 and "is not a GGUF file" in refused.stderr
    raising = tmp_path / "strict.jinja"
    raising.write_text("{{ raise_exception('roles must alternate') }}")
    failed = kvgraft(
        "tokenize", "--model", str(QWEN2), "--messages", str(messages),
        "--chat-template", str(raising),
    )  # fmt: skip
    assert failed.returncode == 1 and "roles must alternate" in failed.stderr
    assert "--chat-template" in failed.stderr and "Traceback" not in failed.stderr
