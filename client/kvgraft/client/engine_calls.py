"""The engine's calls of `kvgraft.Client`: lookup, deposit, generate, graft, verify.

The engine's calls return the typed results of kvgraft.results (the protobuf
response stays available as their `raw`); generate and graft wait for the end,
generate_stream and graft_stream give the tokens as they come. A prompt is text,
token ids, or a conversation (`messages`, rendered by the daemon with the model's
chat template). Mistakes a call can see on its own (an unknown option, a value of the
wrong type or sign, options that contradict) are TypeError or ValueError before
anything is sent; what needs the daemon's limits (top_p beyond 1, a fifth stop
string) comes back as its kvgraft.errors.InvalidArgument, in its words.

Every one of them computes (lookup tokenizes with the model), so each takes the
compute deadline (`compute_timeout_s`, kvgraft.client.connection).

A daemon loads its model in the background after it starts, and refuses the engine's
calls with kvgraft.errors.Unavailable meanwhile; `wait_for_model` waits for the load
(the command line does, before every command that needs the engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvgraft.client.connection import COMPUTE, Connected
from kvgraft.errors import DeadlineExceeded, InvalidArgument
from kvgraft.results import (
    DepositResult,
    GenerateResult,
    GenerationStream,
    Progress,
    VerifyResult,
)
from kvgraft.sampling import MIN_TOP_P, as_float32
from kvgraft.v1 import kvgraft_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 32  # the CLI's default too
LOGITS_MAX_NEW_TOKENS = 16  # the daemon returns the logits of at most 16 steps (one message)
# The options of generate and graft besides max_new_tokens (GenerateOptions in the proto).
GENERATE_OPTIONS = (
    "greedy",
    "temperature",
    "seed",
    "no_cache",
    "deposit",
    "labels",
    "return_logits",
    "allow_untrusted",
    "on_progress",
    "top_p",
    "top_k",
    "stop",
    "logprobs",
    "top_logprobs",
    "keep",
)
# A conversation's messages: [{"role": "system" | "user" | "assistant", "content": str}]
Messages = Sequence[Mapping[str, str]]
# How often wait_for_model asks: a load takes seconds (a cached model) to minutes (a
# first conversion), and an Info call costs the daemon next to nothing.
MODEL_POLL_S = 0.5


class EngineCalls(Connected):
    def wait_for_model(
        self,
        timeout_s: float | None = None,
        on_progress: Callable[[float], None] | None = None,
    ) -> str:
        """Wait while the daemon's model loads; return its state once it no longer is
        "loading": "ready", "none" (a daemon without a model) or "failed: ..." (the
        engine's calls then say what to do). `on_progress` is called with the seconds
        waited so far each time a look (about every half second) finds it loading;
        nothing is called when it is ready at once. Raises DeadlineExceeded when it
        still loads after `timeout_s` (default: compute_timeout_s); each look runs
        under the compute deadline too, the wait being the first part of the call that
        needs the engine."""
        limit_s = self.compute_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        while True:
            left_s = limit_s - (time.monotonic() - started)
            with self._mapped(COMPUTE):
                deadline_s = min(self.compute_timeout_s, max(left_s, MODEL_POLL_S))
                state = self._stub.Info(pb.InfoRequest(), timeout=deadline_s).model_state
            waited_s = time.monotonic() - started
            if state != "loading":
                return state
            if waited_s >= limit_s:
                raise DeadlineExceeded(
                    f"the model of kvgraftd at {self.address} is still loading after "
                    f"{limit_s:g} s: give it longer with --timeout S (in Python, "
                    "wait_for_model(timeout_s=S)), or see the daemon's log"
                )
            if on_progress is not None:
                on_progress(waited_s)
            time.sleep(min(MODEL_POLL_S, max(limit_s - waited_s, 0.0)))

    def lookup(
        self,
        token_ids: Iterable[int] | None = None,
        *,
        text: str | None = None,
        chat: bool = False,
    ) -> pb.LookupResponse:
        """How many leading tokens of a prompt (`token_ids`, or `text` tokenized by the
        daemon's model) the store holds: what a generate of it would reuse."""
        if text is not None:
            request = pb.LookupRequest(prompt=_prompt(text, token_ids, chat))
        elif token_ids is not None:
            request = pb.LookupRequest(token_ids=list(token_ids))
        else:
            raise InvalidArgument("give either text or token_ids")
        return self._unary(self._stub.Lookup, request, COMPUTE)

    def deposit(
        self,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        chat: bool = False,
        labels: Mapping[str, str] | None = None,
        verified_by: str = "",
        on_progress: Callable[[Progress], None] | None = None,
    ) -> DepositResult:
        """Have the daemon compute a context (`text`, or `token_ids`) and store it, with
        `labels` (part of the artifact's id) and `verified_by`; returns a
        kvgraft.DepositResult (its id and receipt). `on_progress` is called with a
        kvgraft.Progress about every half second while the daemon computes (the deposit
        then runs as a Generate of no new tokens: the same artifact)."""
        prompt = _prompt(text, token_ids, chat)
        if on_progress is None:
            request = pb.DepositRequest(prompt=prompt, labels=labels, verified_by=verified_by)
            return DepositResult.from_proto(self._unary(self._stub.Deposit, request, COMPUTE))
        labels = {**(labels or {}), **({"verified-by": verified_by} if verified_by else {})}
        options = pb.GenerateOptions(deposit=True, labels=labels, progress=True)
        call = self._open(
            self._stub.Generate, pb.GenerateRequest(prompt=prompt, options=options), COMPUTE
        )
        result = GenerationStream(self._stream(call, COMPUTE), call.cancel, on_progress).result()
        response = pb.DepositResponse(
            artifact_id=result.deposited_artifact_id, receipt=result.receipt.raw
        )
        return DepositResult.from_proto(response)

    def generate(
        self,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        messages: Messages | None = None,
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerateResult:
        """Generate from a prompt, grafting the longest stored prefix; waits for the end.

        The prompt is one of `text` (tokenized by the daemon's model; `chat=True` wraps
        it in the model's chat template), `token_ids`, or `messages`: a conversation,
        oldest first, as OpenAI's API takes it ([{"role": "user", "content": "Hi"}];
        roles system, user, assistant), rendered with the chat template for the
        assistant's next turn. With keep=True each turn's context stays in the store, so
        the next turn (the same messages, the answer and a new one) reuses it all:

            messages = [{"role": "user", "content": "Name a colour."}]
            answer = client.generate(messages=messages, keep=True)
            messages += [{"role": "assistant", "content": answer.text},
                         {"role": "user", "content": "And another?"}]
            client.generate(messages=messages, keep=True).reused_tokens  # the first turn

        Options:

        max_new_tokens  tokens to generate at most (default 32, as the CLI's; 16 with
                        return_logits, the most steps whose logits the daemon returns)
        temperature     0 decodes greedily (as OpenAI's API does); above 0 samples at
                        that temperature
        greedy          True: argmax decoding (the default); False: sample (at
                        temperature 1.0 unless one is given). A temperature with
                        greedy=True, or greedy=False with temperature 0, is a ValueError
        seed            the sampling seed: the same seed gives the same tokens
        top_p           when sampling: only the likeliest tokens whose probabilities
                        add up to top_p (0 < top_p <= 1; 1: all)
        top_k           when sampling: only the top_k likeliest tokens (0: all)
        stop            a string or a list of them (at most 4, 1-256 characters each):
                        generation ends once the text holds one; the text stops
                        before it and finish_reason is "stop"
        logprobs        True: each Token carries its log-probability (the model's,
                        before temperature, top-p and top-k); GenerateResult.logprobs
                        gathers them
        top_logprobs    0-20: and that many likeliest alternatives of each step
                        (implies logprobs)
        keep            keep the finished context in the store (evictable, as
                        cache="auto" keeps every one), so a next turn reuses it
        no_cache        compute everything fresh, graft nothing
        deposit         store the finished context (its id: deposited_artifact_id)
        labels          labels of the deposited artifact ({"key": "value"})
        return_logits   also return the logits as float32 numpy arrays
                        (GenerateResult.prompt_logits, generated_logits)
        allow_untrusted graft: allow an artifact nobody trusted vouches for
        on_progress     called with a kvgraft.Progress about every half second while
                        the daemon computes the prompt

        top_p or top_k while decoding greedily is a ValueError (they choose among samples:
        give a temperature). Any other keyword is a TypeError. Returns a
        kvgraft.GenerateResult (its finish_reason says why it ended);
        `generate_stream` gives the tokens as they come.
        """
        return self.generate_stream(
            text,
            token_ids=token_ids,
            messages=messages,
            chat=chat,
            max_new_tokens=max_new_tokens,
            **options,
        ).result()

    def generate_stream(
        self,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        messages: Messages | None = None,
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerationStream:
        """generate, as a stream: iterate it for the tokens (kvgraft.Token), then call its
        result() (kvgraft.GenerationStream). The prompt and options are generate's."""
        on_progress = options.pop("on_progress", None)
        sent = _generate_options("generate_stream", max_new_tokens, options, on_progress)
        request = pb.GenerateRequest(prompt=_prompt(text, token_ids, chat, messages), options=sent)
        return self._generation(self._stub.Generate, request, on_progress, sent.logprobs)

    def graft(
        self,
        artifact_id: str,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        messages: Messages | None = None,
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerateResult:
        """Graft a whole artifact (id or unique prefix), append the continuation (`text`,
        `token_ids` or `messages`, rendered as generate renders them; may be empty:
        text=""), generate; waits for the end. The options are generate's; returns a
        kvgraft.GenerateResult."""
        return self.graft_stream(
            artifact_id,
            text,
            token_ids=token_ids,
            messages=messages,
            chat=chat,
            max_new_tokens=max_new_tokens,
            **options,
        ).result()

    def graft_stream(
        self,
        artifact_id: str,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        messages: Messages | None = None,
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerationStream:
        """graft, as a stream: iterate it for the tokens, then call its result()."""
        on_progress = options.pop("on_progress", None)
        sent = _generate_options("graft_stream", max_new_tokens, options, on_progress)
        request = pb.GraftRequest(
            artifact_id=artifact_id,
            continuation=_prompt(text, token_ids, chat, messages),
            options=sent,
        )
        return self._generation(self._stub.Graft, request, on_progress, sent.logprobs)

    def _generation(self, method, request, on_progress, logprobs: bool) -> GenerationStream:
        call = self._open(method, request, COMPUTE)
        stream = self._stream(call, COMPUTE)
        return GenerationStream(stream, call.cancel, on_progress, logprobs=logprobs)

    def verify(self, artifact_id: str) -> VerifyResult:
        """Recompute an artifact fresh on the daemon and compare every hash."""
        request = pb.VerifyRequest(artifact_id=artifact_id)
        response = self._unary(self._stub.Verify, request, COMPUTE)
        return VerifyResult.from_proto(response)


def _generate_options(
    call: str, max_new_tokens: int | None, options: dict, on_progress=None
) -> pb.GenerateOptions:
    """The GenerateOptions of a generate or graft `call`: an unknown option is a TypeError
    (as an unexpected keyword argument is in Python), values that contradict a ValueError."""
    unknown = sorted(set(options) - set(GENERATE_OPTIONS))
    if unknown:
        raise TypeError(
            f"{call}() got an unexpected keyword argument {unknown[0]!r} (its options: "
            f"max_new_tokens, {', '.join(GENERATE_OPTIONS)})"
        )
    if max_new_tokens is None:
        logits = options.get("return_logits", False)
        max_new_tokens = LOGITS_MAX_NEW_TOKENS if logits else DEFAULT_MAX_NEW_TOKENS
    elif max_new_tokens < 0:  # protobuf's own words would be "Value out of range: -3"
        raise ValueError(f"max_new_tokens must be 0 or more, not {max_new_tokens}")
    rest = {k: v for k, v in options.items() if k not in ("greedy", "temperature")}
    decoding = _decoding(options.get("greedy"), options.get("temperature"))
    _check_choice(decoding, rest)
    if "stop" in rest:
        rest["stop"] = _stop_strings(rest["stop"])
    if rest.get("top_logprobs"):
        rest["logprobs"] = True  # the alternatives come with the token's own
    return pb.GenerateOptions(
        max_new_tokens=max_new_tokens, progress=on_progress is not None, **decoding, **rest
    )


def _check_choice(decoding: dict, options: dict) -> None:
    """ValueError for top_p or top_k that would be ignored (greedy decoding) and for
    counts the wire cannot carry; their bounds beyond are the daemon's to say."""
    for name in ("top_k", "top_logprobs"):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be a whole number, not {type(value).__name__}")
        if value is not None and value < 0:  # protobuf's words: "Value out of range"
            raise ValueError(f"{name} must be 0 or more, not {value}")
    top_p = options.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float)):
        raise TypeError(f"top_p must be a number, not {type(top_p).__name__}")
    if top_p is not None and top_p > 0 and as_float32(top_p) == 0:  # the daemon would read 1
        raise ValueError(
            f"top_p={top_p!r} is 0 on the wire (a float32), which means every token: give "
            f"{MIN_TOP_P:.4g} or more (that small keeps the likeliest token alone)"
        )
    sampling = decoding.get("greedy") is False
    narrowed = [
        f"{name}={options[name]!r}"
        for name, everything in (("top_p", (0, 1)), ("top_k", (0,)))
        if options.get(name) is not None and options[name] not in everything
    ]
    if narrowed and not sampling:
        raise ValueError(
            f"{' and '.join(narrowed)} with greedy decoding: they choose among samples; give "
            "a temperature above 0 (or greedy=False) to sample"
        )


def _stop_strings(stop: str | Iterable[str]) -> list[str]:
    """`stop` as the list sent: a string is one stop string."""
    stops = [stop] if isinstance(stop, str) else list(stop)
    for item in stops:
        if not isinstance(item, str):
            raise TypeError(f"stop takes strings, not {type(item).__name__}: {item!r}")
    return stops


def _decoding(greedy: bool | None, temperature: float | None) -> dict:
    """greedy and temperature as sent. Temperature 0 is greedy decoding (as in OpenAI's
    API), a temperature above 0 samples at it, greedy=False alone samples at 1.0; the
    proto's temperature 0 would mean 1.0 when sampling, so it is never sent with
    greedy=False."""
    if temperature is not None and temperature == 0:
        if greedy is False:
            raise ValueError(
                "greedy=False with temperature=0: a temperature of 0 is greedy decoding; "
                "give a temperature above 0 to sample"
            )
        return {"greedy": True}
    if temperature is not None:
        if greedy:
            raise ValueError(
                f"greedy=True with temperature={temperature!r}: a temperature samples; "
                "leave out greedy=True to sample, or the temperature to decode greedily"
            )
        if temperature > 0 and as_float32(temperature) == 0:  # the daemon would read 1.0
            raise ValueError(
                f"temperature={temperature!r} is 0 on the wire (a float32): give 0 to decode "
                "greedily, or a temperature of 0.0001 or more to sample"
            )
        return {"greedy": False, "temperature": temperature}
    if greedy is None:
        return {}  # absent: greedy
    return {"greedy": True} if greedy else {"greedy": False, "temperature": 1.0}


def _prompt(
    text: str | None,
    token_ids: Iterable[int] | None,
    chat: bool,
    messages: Messages | None = None,
) -> pb.Prompt:
    given = [given is not None for given in (text, token_ids, messages)]
    if sum(given) != 1:
        raise InvalidArgument("give one of text, token_ids or messages")
    if text is not None:
        return pb.Prompt(text=text, chat=chat)
    if token_ids is not None:
        return pb.Prompt(tokens=pb.TokenIds(ids=list(token_ids)), chat=chat)
    return pb.Prompt(conversation=_conversation(messages))


def _conversation(messages: Messages) -> pb.Conversation:
    """`messages` as sent; TypeError for what is not a list of {"role", "content"} strings
    (the roles themselves are the daemon's to check)."""
    if isinstance(messages, str | bytes | Mapping):
        raise TypeError(
            'messages is a list of {"role": ..., "content": ...} dicts, not one '
            f"{type(messages).__name__}"
        )
    sent = pb.Conversation()
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not all(
            isinstance(message.get(key), str) for key in ("role", "content")
        ):
            raise TypeError(
                f'messages[{index}] is {message!r}: give {{"role": "user", "content": "..."}} '
                "with both values strings"
            )
        sent.messages.add(role=message["role"], content=message["content"])
    return sent
