"""A tiny model with a real vocabulary (`--tokenizer FILE`), end to end through the daemon.

`--model tiny:qwen2:1 --tokenizer ggml-vocab-qwen2.gguf` builds the tiny Qwen 2 model with
the vocabulary's size and serves it with that file's tokenizer and Qwen 2.5's template (the
file's own), so a family test sends text, not ids: the official `openai` package holds a
conversation of three turns, each answer real text decoded by the file's tokenizer, each
turn reusing every earlier one (the template is stable, and `kvgraft info` says so); the
model stops at the file's end-of-turn tokens. `--chat-template` replaces the template:
Qwen 3's, which rewrites an earlier answer that holds reasoning, is reported by info.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import openai
import pytest

from kvgraft import Client
from kvgraft.errors import InvalidArgument
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.testing.daemon_process import DaemonProcess
from tests.conftest import MODEL_CACHE
from tests.http.model_daemon import wait_until_healthy

VOCAB = Path(__file__).resolve().parents[2].parent / "shared" / "vocab"
QWEN2 = VOCAB / "ggml-vocab-qwen2.gguf"
QWEN3_TEMPLATE = VOCAB / "templates" / "Qwen-Qwen3-0.6B.jinja"
IM_END, ENDOFTEXT = 151645, 151643

pytestmark = pytest.mark.skipif(not QWEN2.is_file(), reason=f"{VOCAB} is not here")


def _daemon(tmp_path: Path, *extra: str) -> DaemonProcess:
    args = ["--model", "tiny:qwen2:1", "--tokenizer", str(QWEN2), "--cache", "auto"]
    daemon = DaemonProcess.start(tmp_path, [*args, "--model-cache", str(MODEL_CACHE), *extra])
    wait_until_healthy(daemon)
    return daemon


def test_the_tiny_model_stops_at_the_files_end_of_turn_tokens_and_its_template_is_probed() -> None:
    adapter = ModelAdapter.load("tiny:qwen2:1", MODEL_CACHE, tokenizer=str(QWEN2))
    assert adapter.geometry.vocab_size == len(adapter.tokenizer) == 151936
    assert {IM_END, ENDOFTEXT} <= adapter.eos_token_ids
    assert adapter.template_stability == "stable"
    ids = adapter.chat_tokens([{"role": "user", "content": "hi <|im_end|>"}], True)
    assert ids.count(IM_END) == 2  # the system turn's and the user turn's: the text's is text
    # --chat-template: Qwen 3's rewrites an earlier answer that holds reasoning, and says so
    adapter.replace_chat_template(QWEN3_TEMPLATE.read_text())
    said = adapter.template_stability
    assert said.startswith("it renders answer 1 otherwise") and "reuse stops there" in said


def test_a_vocabulary_without_a_template_is_refused_for_chat_saying_so() -> None:
    llama3 = VOCAB / "ggml-vocab-llama-bpe.gguf"  # llama.cpp's file holds no template
    adapter = ModelAdapter.load("tiny:llama:1", MODEL_CACHE, tokenizer=str(llama3))
    assert adapter.template_stability == "none"
    with pytest.raises(InvalidArgument, match="has no chat template"):
        adapter.chat_tokens([{"role": "user", "content": "hi"}], True)
    assert adapter.encode("Hello world") == [9906, 1917]  # text without a template: fine
    with pytest.raises(InvalidArgument, match=r"does not compile.*fix the template file"):
        adapter.replace_chat_template("{% if messages %}")
    adapter.replace_chat_template(QWEN3_TEMPLATE.read_text())
    assert adapter.render_chat([{"role": "user", "content": "hi"}], True).startswith(
        "<|im_start|>user\nhi<|im_end|>"
    )


def test_a_conversation_with_a_real_vocabulary_reuses_every_turn(tmp_path) -> None:
    daemon = _daemon(tmp_path)
    try:
        api = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="-", max_retries=0)
        model = api.models.list().data[0].id
        messages = [{"role": "user", "content": "Name three birds."}]
        turns = []
        for follow_up in ("And three trees?", "And three rivers?", "Thanks."):
            answer = api.chat.completions.create(
                model=model, messages=messages, max_tokens=6, temperature=0
            )
            turns.append(answer)
            text = answer.choices[0].message.content
            assert isinstance(text, str) and text
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_up},
            ]
        for before, after in itertools.pairwise(turns):
            # the earlier turn's prompt is grafted whole; its answer as far as the text
            # the client sent back tokenizes to the ids the model chose
            assert after.usage.prompt_tokens_details.cached_tokens >= before.usage.prompt_tokens
        with Client(daemon.address) as client:
            assert client.info().chat_template == "stable"
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.log()
