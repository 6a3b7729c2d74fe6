"""Long hostile text: what an error repeats of it, and a prompt too long to tokenize.

* Errors travel in the grpc-message trailer, percent-encoded: a character outside
  printable ASCII takes 3 bytes per UTF-8 byte there (9 for CJK). Issue 31 cut what an
  error repeats to 2,048 characters, which were up to 18 KiB on the wire, past the
  client's 16 KiB hard limit on metadata (past 8 KiB it refuses at random): long invalid
  ids, tags and sources came back RESOURCE_EXHAUSTED "received metadata size exceeds
  hard limit" from Stat, Pin, Delete, LibraryList and Replicate. Now INVALID_ARGUMENT,
  the message at most MAX_MESSAGE_WIRE_BYTES encoded, its advice whole.
* A 4 MB text prompt was tokenized (2-4 CPU-seconds) before the context limit refused
  it. Now a text that cannot fit max_context_tokens is refused by its length first
  (kvgraftd.engine.requests.token_floor: SmolLM2's tokens are at most 81 bytes of text, so B
  bytes are at least ceil(B / 82) tokens), by Generate, Graft, Deposit and Ask; a text
  at the bound is still tokenized; and the bound never exceeds a text's real count, for
  the texts that come nearest to it. Lookup, which has no context limit, answers about a
  text past the bound (it refused one). A chat text is measured as its template renders
  it: one that trims (Llama 3's) made a text that fits look too long. A tokenizer the
  floor cannot read gets none, where it failed the model's load.

One daemon serves the module: the real model (its tokenizer; LibraryList and Ask need a
model), max_context_tokens 1024 so that the bound is 83,968 bytes.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator

import grpc
import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvgraft.errors import InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.engine.requests.token_floor import TokenFloor
from kvgraftd.server.grpc_server import MAX_MESSAGE_WIRE_BYTES
from kvgraftd.store.artifact_store import Store
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.toy_library import ToyTokenizer, toy_adapter, toy_engine

CODE = grpc.StatusCode
CONTEXT_TOKENS = 1024
LONGEST_TOKEN_BYTES = 82  # SmolLM2's "\n" and 80 spaces, and one for the decoders' margin
BOUND_BYTES = CONTEXT_TOKENS * LONGEST_TOKEN_BYTES


@pytest.fixture(scope="module")
def stub(tmp_path_factory, real_model_args) -> Iterator[pb_grpc.KvgraftStub]:
    daemon = DaemonProcess.start(
        tmp_path_factory.mktemp("hostile-text") / "data",
        [*real_model_args, "--max-context-tokens", str(CONTEXT_TOKENS)],
    )
    try:
        wait_model_ready(daemon.address)
        with grpc.insecure_channel(daemon.address) as channel:
            yield pb_grpc.KvgraftStub(channel)
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        answer = call()
        if isinstance(answer, Iterator):
            list(answer)
    return caught.value


def _wire_bytes(text: str) -> int:
    """What `text` takes percent-encoded, as grpc-message carries it."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode())


# ----------------------------------------------------------------------
# what an error repeats

HOSTILE = {
    "CJK words": " ".join(["中" * 250] * 40),  # was: 17,984 bytes, past the hard limit
    "short CJK words": " ".join(["中文"] * 3000),  # was: past the soft limit (12,910)
    "emoji words": " ".join(["😀" * 200] * 40),
    "percent signs": " ".join(["%" * 250] * 40),
    "a million letters": "a" * 1_000_000,
}
ADVICE = {  # how each refusal ends: what to do
    "Stat": " is not an artifact id: give 8 to 64 hex characters",
    "Pin": " is not an artifact id: give 8 to 64 hex characters",
    "Delete": " is not a full artifact id (64 hex characters)",
    "LibraryList": " is not valid: use 1-64 letters, digits, '.', '_' or '-'",
    "Replicate": " the address at which this daemon reaches it, e.g. 10.0.0.5:50051",
}


def _request(stub: pb_grpc.KvgraftStub, method: str, text: str):
    return {
        "Stat": lambda: stub.Stat(pb.StatRequest(artifact_id=text), timeout=60),
        "Pin": lambda: stub.Pin(pb.PinRequest(artifact_id=text, pinned=True), timeout=60),
        "Delete": lambda: stub.Delete(pb.DeleteRequest(artifact_id=text), timeout=60),
        "LibraryList": lambda: stub.LibraryList(pb.LibraryListRequest(tag=text), timeout=60),
        "Replicate": lambda: stub.Replicate(pb.ReplicateRequest(source=text), timeout=60),
    }[method]


@pytest.mark.parametrize("method", sorted(ADVICE))
def test_a_long_invalid_id_tag_or_source_is_invalid_argument(stub, method) -> None:
    for shape, text in HOSTILE.items():
        error = _refusal(_request(stub, method, text))
        assert error.code() == CODE.INVALID_ARGUMENT, (shape, error.details())
        details = error.details()
        assert _wire_bytes(details) <= MAX_MESSAGE_WIRE_BYTES, shape
        assert all(c.isprintable() for c in details), shape
        assert details.endswith(ADVICE[method]), (shape, details[-200:])


# ----------------------------------------------------------------------
# a prompt too long to tokenize


def _floor_message(what: str, size: int, max_new_tokens: int = 0, chat: bool = False) -> str:
    least = -(-size // LONGEST_TOKEN_BYTES)
    reserved = f", {least + max_new_tokens} with max_new_tokens" if max_new_tokens else ""
    rendered = " in its chat template" if chat else ""
    return (
        f"the {what} is {size} bytes of text{rendered}: at least {least} tokens for this "
        f"model (none is longer than {LONGEST_TOKEN_BYTES} bytes){reserved}, more than "
        f"max_context_tokens={CONTEXT_TOKENS}; shorten it"
    )


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(stub, real_model) -> None:
    text = "a" * 4_000_000  # 1,000,000 tokens: was tokenized first (3.9 CPU-s here)
    prompt = pb.Prompt(text=text)
    calls = {
        "Generate": lambda: stub.Generate(
            pb.GenerateRequest(prompt=prompt, options=pb.GenerateOptions(max_new_tokens=16)),
            timeout=60,
        ),
        "Graft": lambda: stub.Graft(
            pb.GraftRequest(artifact_id="0" * 64, continuation=prompt), timeout=60
        ),
        "Deposit": lambda: stub.Deposit(pb.DepositRequest(prompt=prompt), timeout=60),
        "Ask": lambda: stub.Ask(pb.AskRequest(text=text), timeout=60),
    }
    asked = real_model.render_chat([{"role": "user", "content": text}], True).encode()
    expected = {
        "Generate": _floor_message("prompt", len(text), max_new_tokens=16),
        "Graft": _floor_message("continuation", len(text)),
        "Deposit": _floor_message("prompt", len(text)),
        "Ask": _floor_message("question", len(asked), chat=True),  # as its template renders
    }
    for method, call in calls.items():
        error = _refusal(call)
        assert error.code() == CODE.INVALID_ARGUMENT, (method, error.details())
        assert error.details() == expected[method], method  # was: "context of 1000000 tokens"


def test_a_text_at_the_bound_is_tokenized(stub) -> None:
    at_bound = pb.Prompt(text="a" * BOUND_BYTES)  # may be 1024 tokens: counted, not refused
    assert stub.Lookup(pb.LookupRequest(prompt=at_bound), timeout=60).matched_tokens == 0
    error = _refusal(lambda: stub.Deposit(pb.DepositRequest(prompt=at_bound), timeout=60))
    assert error.details().startswith("context of 20992 tokens exceeds max_context_tokens=1024")
    past = pb.Prompt(text="a" * (BOUND_BYTES + 1))
    error = _refusal(lambda: stub.Deposit(pb.DepositRequest(prompt=past), timeout=60))
    assert error.details() == _floor_message("prompt", BOUND_BYTES + 1)


def test_lookup_answers_about_a_text_past_the_bound(stub) -> None:
    """Was: refused by the floor, though Lookup has no max_context_tokens limit."""
    past = pb.Prompt(text="a" * (BOUND_BYTES + 1))
    assert stub.Lookup(pb.LookupRequest(prompt=past), timeout=60).matched_tokens == 0


def _nearest_texts(tokenizer) -> dict[str, str]:
    """Texts of the fewest tokens for their bytes: runs of the longest tokens, special
    tokens' text, and text whose tokens split UTF-8 characters."""
    vocab = tokenizer.backend_tokenizer.decode_batch([[i] for i in range(len(tokenizer))], False)
    longest = sorted(vocab, key=lambda text: len(text.encode()))[-20:]
    rng = random.Random(32)
    return {
        "the longest token, repeated": longest[-1] * 500,
        "the 20 longest, shuffled": "".join(rng.choice(longest) for _ in range(500)),
        "special tokens' text": "<|im_start|><|im_end|><|endoftext|>" * 300,
        "spaces": " " * 50_000,
        "newlines and spaces": ("\n" + " " * 80) * 300,
        "CJK and emoji": "".join(rng.choice("中文字😀é\u0301") for _ in range(5000)),
        "random code points": "".join(chr(rng.randrange(32, 0x2FFFF)) for _ in range(3000))
        .encode("utf-8", "replace")
        .decode(),
    }


def test_the_floor_never_exceeds_a_real_count(real_model) -> None:
    floor = TokenFloor.of(real_model.tokenizer)
    assert floor == TokenFloor(LONGEST_TOKEN_BYTES)
    for name, text in _nearest_texts(real_model.tokenizer).items():
        for chat in (False, True):
            counted = len(real_model.encode(text, chat=chat))
            assert floor.tokens(text) <= counted, (name, chat, floor.tokens(text), counted)


def _fast(tokenizer: Tokenizer, **kwargs) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)


def _byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_tokens(["hello"])
    return tokenizer


def test_tokenizers_that_can_shorten_text_get_no_floor() -> None:
    assert TokenFloor.of(_fast(_byte_level_bpe())) == TokenFloor(len("hello") + 1)
    assert TokenFloor.of(None) is None  # the tiny test model: ids only
    dropping = _byte_level_bpe()
    dropping.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()]  # spaces dropped
    )
    composing = _byte_level_bpe()
    composing.normalizer = normalizers.NFKC()  # "e\u0301" (3 bytes) becomes "é" (2)
    shrinking = _byte_level_bpe()
    shrinking.normalizer = normalizers.Replace("  ", " ")
    no_bytes = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=True))  # a run of unknowns: 1
    for tokenizer in (dropping, composing, shrinking, no_bytes):
        assert TokenFloor.of(_fast(tokenizer)) is None
    stripping = _byte_level_bpe()
    stripping.add_tokens([AddedToken("<x>", rstrip=True)])  # "<x>" and every space after it
    assert TokenFloor.of(_fast(stripping)) is None
    lengthening = _byte_level_bpe()
    lengthening.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]  # Llama 2's
    )
    assert TokenFloor.of(_fast(lengthening)) is not None


# Llama 3's template trims each message's content before it is tokenized
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_text_is_measured_as_its_template_renders_it(real_model, tmp_path) -> None:
    """Was: the floor measured a chat prompt's raw text, so spaces a trimming template
    drops made a prompt that fits (a few tokens) InvalidArgument."""
    adapter = copy.copy(real_model)  # the session's adapter, with its own tokenizer
    adapter.tokenizer = copy.deepcopy(real_model.tokenizer)
    adapter.tokenizer.chat_template = TRIMMING_TEMPLATE
    store = Store(tmp_path / "store")
    try:
        engine = Engine(adapter, store, max_context_tokens=CONTEXT_TOKENS)
        service = EngineService(lambda: engine)
        assert service.wait_ready(60)
        padded = " " * BOUND_BYTES + "What is 2 + 2?"  # past the bound, as typed
        deposited = service.deposit(pb.DepositRequest(prompt=pb.Prompt(text=padded, chat=True)))
        held = store.get_record(deposited.artifact_id).manifest().token_ids
        assert list(held) == adapter.encode("What is 2 + 2?", chat=True)
        past = " " * BOUND_BYTES + "x" * BOUND_BYTES  # what is left does not fit
        rendered = adapter.render_chat([{"role": "user", "content": past}], True).encode()
        with pytest.raises(InvalidArgument) as refused:
            service.deposit(pb.DepositRequest(prompt=pb.Prompt(text=past, chat=True)))
        assert str(refused.value) == _floor_message("prompt", len(rendered), chat=True)
    finally:
        store.close()


class UnreadableTokenizer(ToyTokenizer):
    """A tokenizer TokenFloor.of cannot read: its backend fails when asked for."""

    @property
    def backend_tokenizer(self):
        raise RuntimeError("no backend here")


def test_a_tokenizer_the_floor_cannot_read_still_loads(tmp_path, caplog) -> None:
    """Was: TokenFloor.of ran inside the model's load, so its error failed the engine (every
    engine call FAILED_PRECONDITION). Such a tokenizer gets no floor, said in one line."""
    adapter = toy_adapter()
    adapter.tokenizer = UnreadableTokenizer()
    store = Store(tmp_path / "store")
    try:
        engine = toy_engine(adapter, store)
        service = EngineService(lambda: engine)
        assert service.wait_ready(10)
        assert service.engine() is engine
        service.refuse_overlong_text("a" * 10_000_000, "prompt")  # no floor: nothing refused
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warnings == [
            "event=no_token_floor tokenizer=UnreadableTokenizer (RuntimeError: no backend "
            "here); overlong texts are refused once tokenized"
        ]
    finally:
        store.close()
