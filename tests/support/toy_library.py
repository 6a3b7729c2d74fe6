"""A library on the tiny seeded Llama with a byte-level toy tokenizer (the tiny model has
none): the tokenizer, the engine's page size, and how the library tests build a service and
add an entry. The fixtures that use them are in tests/library/conftest.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.library.service import LibraryService

PAGE = 8
MARKERS = {"<|u|>": 300, "<|a|>": 301, "<|e|>": 302}


class ToyTokenizer:
    """Bytes as ids 2..257, three chat markers as 300..302 (302 ends a turn: EOS)."""

    chat_template = "toy"
    eos_token_id = MARKERS["<|e|>"]

    added_tokens_decoder: ClassVar[dict[int, SimpleNamespace]] = {
        index: SimpleNamespace(content=text, special=True) for text, index in MARKERS.items()
    }

    def encode(
        self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False
    ) -> list[int]:
        ids: list[int] = []
        while text:
            markers = () if split_special_tokens else MARKERS
            marker = next((m for m in markers if text.startswith(m)), None)
            if marker:
                ids.append(MARKERS[marker])
                text = text[len(marker) :]
            else:
                ids += [b + 2 for b in text[0].encode()]
                text = text[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        names = {v: k for k, v in MARKERS.items()}
        out, pending = [], bytearray()
        for token in ids:
            if 2 <= token < 258:
                pending.append(token - 2)
                continue
            out.append(pending.decode(errors="replace"))
            pending = bytearray()
            out.append(names.get(token, f"<{token}>"))
        return "".join(out) + pending.decode(errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False) -> str:
        marker = {"user": "<|u|>", "assistant": "<|a|>"}
        text = "".join(f"{marker[m['role']]}{m['content']}<|e|>\n" for m in messages)
        return text + ("<|a|>" if add_generation_prompt else "")


def toy_adapter() -> ModelAdapter:
    adapter = ModelAdapter.load("tiny:0", Path("/nonexistent"))
    adapter.tokenizer = ToyTokenizer()
    adapter.eos_token_ids = frozenset({ToyTokenizer.eos_token_id})
    return adapter


def toy_engine(adapter: ModelAdapter, store) -> Engine:
    return Engine(adapter, store, page_tokens=PAGE, block_tokens=32)


def library_service(engine: Engine) -> LibraryService:
    engines = EngineService(lambda: engine)
    assert engines.wait_ready(10)
    return LibraryService(engines)


def add_entry(library: LibraryService, problem: str, answer: str = "42", **kwargs):
    request = pb.LibraryAddRequest(
        problem=problem,
        solution=kwargs.pop("solution", f"Worked out: {answer}."),
        answer=answer,
        **kwargs,
    )
    return library.add(request)
