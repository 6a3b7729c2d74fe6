"""The engine RPCs (Lookup, Deposit, Generate, Graft, Verify), independent of gRPC.

The model loads in the background when the daemon starts, so the store RPCs
serve at once; until the engine is ready these calls raise Unavailable with
the time spent so far. A daemon started with `--model none` has no engine and
answers FailedPrecondition. Requests are validated here (prompt present,
token ids in the vocabulary, generation bounds) before the engine runs; a text that
cannot fit max_context_tokens is refused by its length before it is tokenized
(kvgraftd.engine.requests.token_floor), here for Generate, Graft and Deposit, and through
`refuse_overlong_text` for the library's Ask. A chat text is measured as its template
renders it (a template may trim it). Lookup has no context limit (it answers about any
prompt), so its text is always tokenized. The floor is best-effort: a tokenizer it cannot
read gets none, and the engine loads all the same.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvgraft.errors import (
    ContextLengthExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvgraftError,
    Unavailable,
)
from kvgraft.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, as_float32
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.decoding import DecodeOptions, ProgressEvent, ResultEvent
from kvgraftd.engine.requests.token_floor import TokenFloor
from kvgraftd.engine.scheduling.batcher import BatchFigures

if TYPE_CHECKING:  # the engine imports torch; a store-only daemon never does
    from kvgraftd.engine.requests.engine import Engine

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 4096
MAX_LOGITS_STEPS = 16
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
CHAT_ROLES = ("system", "user", "assistant")


class EngineService:
    def __init__(self, load: Callable[[], Engine] | None) -> None:
        """`load` builds the engine (run on a background thread); None: no model."""
        self._engine: Engine | None = None
        self._floor: TokenFloor | None = None  # the engine's tokenizer's, once it is loaded
        self._error: BaseException | None = None
        self._started = time.monotonic()
        self._ready = threading.Event()
        self._enabled = load is not None
        if load is not None:
            threading.Thread(
                target=self._load, args=(load,), name="model-load", daemon=True
            ).start()

    def _load(self, load: Callable[[], Engine]) -> None:
        try:
            engine = load()
            self._floor = _floor_of(engine.adapter.tokenizer)
            self._engine = engine
        except BaseException as exc:  # reported on every engine call
            # one line for the operator; the traceback for whoever debugs (log level DEBUG)
            log.error(
                "the model failed to load (%s: %s); the daemon serves the store only: fix "
                "--model (or --tokenizer, --chat-template) and restart",
                type(exc).__name__,
                exc,
            )
            log.debug("the model's load", exc_info=exc)
            self._error = exc
        finally:
            self._ready.set()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._ready.wait(timeout_s)

    def batch_figures(self) -> BatchFigures | None:
        """The batcher's counters and the requests running and queued (None: no batching)."""
        engine = self._engine
        if engine is None:
            return None
        admission = engine.admission
        return BatchFigures(
            engine.batcher.snapshot(),
            admission.running,
            admission.queued,
            admission.live_kv_bytes,
            admission.max_live_kv_bytes,
        )

    def engine(self) -> Engine:
        if not self._enabled:
            raise FailedPrecondition(
                "this daemon runs without a model (--model none); restart it with a model "
                "to deposit, generate, graft or verify"
            )
        if not self._ready.is_set():
            waited = time.monotonic() - self._started
            raise Unavailable(
                f"the model is still loading ({waited:.0f} s so far); retry in a few seconds"
            )
        if self._engine is None:
            detail = (
                str(self._error) if isinstance(self._error, KvgraftError) else repr(self._error)
            )
            raise FailedPrecondition(f"the model failed to load ({detail}); see the daemon log")
        return self._engine

    # ------------------------------------------------------------------
    def describe(self, response: pb.InfoResponse) -> None:
        """Fill the model fields of an InfoResponse (all of them once the engine is ready)."""
        if not self._enabled:
            response.model_state = "none"
        elif not self._ready.is_set():
            response.model_state = "loading"
        elif self._engine is None:
            response.model_state = f"failed: {self._error}"
        else:
            response.model_state = "ready"
            engine = self._engine
            response.model_name = engine.adapter.name
            response.model_family = engine.adapter.family.name
            response.schedule = engine.adapter.schedule
            response.chat_template = engine.adapter.template_stability
            response.model_fingerprint = engine.fingerprint
            response.profile.CopyFrom(engine.profile)
            response.page_tokens = engine.page_tokens
            response.cache.auto_deposits = engine.auto_deposits
            response.cache.auto_deposits_skipped = engine.auto_deposits_skipped

    def tier_infos(self) -> list[pb.TierInfo]:
        """The device and host tiers of a ready engine (none before)."""
        if self._engine is None:
            return []
        tiers = self._engine.tiers
        out = []
        for name, tier, capacity in (
            ("device", tiers.pool, tiers.pool.budget_bytes),
            ("host", tiers.host, tiers.host.budget_bytes),
        ):
            c = tier.counters
            out.append(
                pb.TierInfo(
                    name=name,
                    capacity_bytes=capacity,
                    used_bytes=tier.used_bytes,
                    holding_bytes=tier.holding_bytes,
                    hits=c.hits,
                    misses=c.misses,
                    evictions=c.evictions,
                    bytes_streamed=c.bytes_streamed,
                    peak_bytes=c.peak_bytes,
                )
            )
        return out

    def device_max_allocated_bytes(self) -> int:
        if self._engine is None or self._engine.tiers.pool.device.type != "cuda":
            return 0
        import torch

        return torch.cuda.max_memory_allocated(self._engine.tiers.pool.device)

    def refuse_overlong_text(
        self, text: str, what: str, reserved_tokens: int = 0, chat: bool = False
    ) -> None:
        """InvalidArgument when `text` alone is more tokens than max_context_tokens allows
        (with `reserved_tokens` more, e.g. max_new_tokens), by its length: before it is
        tokenized. With `chat`, what is measured is the chat template's rendering of it
        (cheap), since a template may trim it (Llama 3's `| trim`). Nothing is refused
        where the tokenizer has no safe floor."""
        engine = self.engine()
        if self._floor is None:
            return
        if chat:
            text = engine.adapter.render_chat([{"role": "user", "content": text}], True)
        least = self._floor.tokens(text)
        if least + reserved_tokens <= engine.max_context_tokens:
            return
        reserved = f", {least + reserved_tokens} with max_new_tokens" if reserved_tokens else ""
        rendered = " in its chat template" if chat else ""
        raise ContextLengthExceeded(
            f"the {what} is {len(text.encode())} bytes of text{rendered}: at least {least} "
            f"tokens for this model (none is longer than {self._floor.longest_token_bytes} "
            f"bytes){reserved}, more than max_context_tokens={engine.max_context_tokens}; "
            "shorten it"
        )

    def _tokens(
        self, prompt: pb.Prompt, what: str, reserved_tokens: int = 0, floor: bool = True
    ) -> list[int]:
        """The prompt's token ids; a text past the floor is refused first (with `floor`)."""
        engine = self.engine()
        kind = prompt.WhichOneof("input")
        if kind == "text":
            if floor:
                self.refuse_overlong_text(prompt.text, what, reserved_tokens, prompt.chat)
            ids = engine.adapter.encode(prompt.text, chat=prompt.chat)
        elif kind == "conversation":
            messages = _messages(prompt.conversation, what)
            if floor:
                rendered = engine.adapter.render_chat(messages, True)
                self.refuse_overlong_text(rendered, what, reserved_tokens)
            ids = engine.adapter.chat_tokens(messages, True)
        elif kind == "tokens":
            ids = list(prompt.tokens.ids)
        else:
            ids = []
        if not ids:
            raise InvalidArgument(f"the {what} is empty: give text or at least one token id")
        return ids

    @staticmethod
    def _options(
        options: pb.GenerateOptions, labels: dict[str, str] | None = None
    ) -> DecodeOptions:
        if options.max_new_tokens > MAX_NEW_TOKENS:
            raise InvalidArgument(f"max_new_tokens is at most {MAX_NEW_TOKENS}")
        if options.return_logits and options.max_new_tokens > MAX_LOGITS_STEPS:
            raise InvalidArgument(
                f"return_logits allows at most {MAX_LOGITS_STEPS} generated steps (the vectors "
                "travel in one message); generate fewer tokens"
            )
        greedy = options.greedy if options.HasField("greedy") else True
        temperature = options.temperature or 1.0
        # the field is a float32: 0.0001 arrives as 9.99999975e-05, which is in bounds
        if not greedy and not as_float32(MIN_TEMPERATURE) <= temperature <= MAX_TEMPERATURE:
            # logits / 1e-38 overflow to inf and sampling fails: refuse, saying the bounds
            raise InvalidArgument(
                f"temperature {temperature:g} is outside {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g} "
                "when sampling; for a temperature near 0, decode greedily (leave greedy set)"
            )
        top_p = options.top_p or 1.0
        if not 0.0 < top_p <= 1.0:
            raise InvalidArgument(f"top_p {top_p:g} is outside 0..1 (1 keeps every token)")
        stop = tuple(options.stop)
        if len(stop) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise InvalidArgument(
                f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} "
                f"characters; {len(stop)} given, of {sorted({len(s) for s in stop})} characters"
            )
        if options.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs is at most {MAX_TOP_LOGPROBS}")
        return DecodeOptions(
            max_new_tokens=options.max_new_tokens,
            greedy=greedy,
            temperature=temperature,
            top_p=top_p,
            top_k=options.top_k,
            seed=options.seed,
            stop=stop,
            logprobs=options.logprobs or options.top_logprobs > 0,
            top_logprobs=options.top_logprobs,
            keep=options.keep,
            no_cache=options.no_cache,
            deposit=options.deposit,
            return_logits=options.return_logits,
            allow_untrusted=options.allow_untrusted,
            labels={**dict(options.labels), **(labels or {})},
            progress=options.progress,
        )

    @staticmethod
    def _responses(events) -> Iterator[pb.GenerateResponse]:
        for event in events:
            if isinstance(event, ResultEvent):
                result = pb.GenerateResult(
                    receipt=event.receipt,
                    text=event.text,
                    deposited_artifact_id=event.artifact_id,
                    prompt_logits=event.prompt_logits,
                    generated_logits=event.generated_logits,
                    finish_reason=event.finish_reason,
                )
                yield pb.GenerateResponse(result=result)
            elif isinstance(event, ProgressEvent):
                progress = pb.Progress(
                    prompt_tokens_done=event.done,
                    prompt_tokens=event.total,
                    reused_tokens=event.reused,
                )
                yield pb.GenerateResponse(progress=progress)
            else:
                token = pb.GeneratedToken(token_id=event.token_id, text=event.text)
                if event.logprob is not None:
                    token.logprob = event.logprob
                    token.top_logprobs.extend(event.top_logprobs)
                yield pb.GenerateResponse(token=token)

    # ------------------------------------------------------------------
    def lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        engine = self.engine()
        tokens = list(request.token_ids)
        if request.HasField("prompt"):
            if tokens:
                raise InvalidArgument("give token_ids or prompt, not both")
            # no floor: Lookup has no context limit, it answers about any prompt
            tokens = self._tokens(request.prompt, "prompt", floor=False)
        return engine.lookup(tokens)

    def deposit(
        self, request: pb.DepositRequest, is_active: Callable[[], bool] | None = None
    ) -> pb.DepositResponse:
        labels = dict(request.labels)
        if request.verified_by:
            labels["verified-by"] = request.verified_by
        options = self._options(pb.GenerateOptions(deposit=True), labels)
        tokens = self._tokens(request.prompt, "prompt")
        events = list(self.engine().generate(tokens, options, is_active))
        result = events[-1]
        return pb.DepositResponse(artifact_id=result.artifact_id, receipt=result.receipt)

    def generate(
        self, request: pb.GenerateRequest, is_active: Callable[[], bool] | None = None
    ) -> Iterator[pb.GenerateResponse]:
        options = self._options(request.options)
        tokens = self._tokens(request.prompt, "prompt", options.max_new_tokens)
        events = self.engine().generate(tokens, options, is_active)
        return self._responses(events)

    def graft(
        self, request: pb.GraftRequest, is_active: Callable[[], bool] | None = None
    ) -> Iterator[pb.GenerateResponse]:
        options = self._options(request.options)
        tokens = self._tokens(request.continuation, "continuation", options.max_new_tokens)
        events = self.engine().graft(request.artifact_id, tokens, options, is_active)
        return self._responses(events)

    def verify(
        self, request: pb.VerifyRequest, is_active: Callable[[], bool] | None = None
    ) -> pb.VerifyResponse:
        return self.engine().verify(request.artifact_id, is_active)


def _messages(conversation: pb.Conversation, what: str) -> list[dict[str, str]]:
    """A conversation as the chat template takes it; InvalidArgument for an empty one or an
    unknown role."""
    if not conversation.messages:
        raise InvalidArgument(f"the {what} is a conversation without messages: give at least one")
    for index, message in enumerate(conversation.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"message {index} has role {message.role!r}: use one of {', '.join(CHAT_ROLES)}"
            )
    return [{"role": m.role, "content": m.content} for m in conversation.messages]


def _floor_of(tokenizer) -> TokenFloor | None:
    """The tokenizer's floor, best-effort: one TokenFloor.of cannot read (an unusual
    tokenizer) gets none, and its texts are tokenized, then counted, as without a floor."""
    try:
        return TokenFloor.of(tokenizer)
    except Exception as exc:  # a third-party tokenizer's own error: never the engine's load
        log.warning(
            "event=no_token_floor tokenizer=%s (%s: %s); overlong texts are refused once tokenized",
            type(tokenizer).__name__,
            type(exc).__name__,
            exc,
        )
        return None
