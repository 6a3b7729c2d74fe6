"""The engine's calls of `kvgraft.Client`: lookup, deposit, generate, graft, verify.

The engine's calls return the typed results of kvgraft.results (the protobuf
response stays available as their `raw`); generate and graft wait for the end,
generate_stream and graft_stream give the tokens as they come.

Every one of them computes (lookup tokenizes with the model), so each takes the
compute deadline (`compute_timeout_s`, kvgraft.client.connection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvgraft.client.connection import COMPUTE, Connection
from kvgraft.errors import InvalidArgument
from kvgraft.results import (
    DepositResult,
    GenerateResult,
    GenerationStream,
    Progress,
    VerifyResult,
)
from kvgraft.sampling import as_float32
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
)


class EngineCalls(Connection):
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
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerateResult:
        """Generate from a prompt, grafting the longest stored prefix; waits for the end.

        The prompt is `text` (tokenized by the daemon's model; `chat=True` wraps it in
        the model's chat template) or `token_ids`. Options:

        max_new_tokens  tokens to generate at most (default 32, as the CLI's; 16 with
                        return_logits, the most steps whose logits the daemon returns)
        temperature     0 decodes greedily (as OpenAI's API does); above 0 samples at
                        that temperature
        greedy          True: argmax decoding (the default); False: sample (at
                        temperature 1.0 unless one is given). A temperature with
                        greedy=True, or greedy=False with temperature 0, is a ValueError
        seed            the sampling seed: the same seed gives the same tokens
        no_cache        compute everything fresh, graft nothing
        deposit         store the finished context (its id: deposited_artifact_id)
        labels          labels of the deposited artifact ({"key": "value"})
        return_logits   also return the logits as float32 numpy arrays
                        (GenerateResult.prompt_logits, generated_logits)
        allow_untrusted graft: allow an artifact nobody trusted vouches for
        on_progress     called with a kvgraft.Progress about every half second while
                        the daemon computes the prompt

        Any other keyword is a TypeError. Returns a kvgraft.GenerateResult;
        `generate_stream` gives the tokens as they come.
        """
        return self.generate_stream(
            text, token_ids=token_ids, chat=chat, max_new_tokens=max_new_tokens, **options
        ).result()

    def generate_stream(
        self,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerationStream:
        """generate, as a stream: iterate it for the tokens (kvgraft.Token), then call its
        result() (kvgraft.GenerationStream). The options are generate's."""
        on_progress = options.pop("on_progress", None)
        request = pb.GenerateRequest(
            prompt=_prompt(text, token_ids, chat),
            options=_generate_options("generate_stream", max_new_tokens, options, on_progress),
        )
        call = self._open(self._stub.Generate, request, COMPUTE)
        return GenerationStream(self._stream(call, COMPUTE), call.cancel, on_progress)

    def graft(
        self,
        artifact_id: str,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerateResult:
        """Graft a whole artifact (id or unique prefix), append the continuation (`text`
        or `token_ids`, may be empty: text=""), generate; waits for the end. The
        options are generate's; returns a kvgraft.GenerateResult."""
        return self.graft_stream(
            artifact_id,
            text,
            token_ids=token_ids,
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
        chat: bool = False,
        max_new_tokens: int | None = None,
        **options,
    ) -> GenerationStream:
        """graft, as a stream: iterate it for the tokens, then call its result()."""
        on_progress = options.pop("on_progress", None)
        request = pb.GraftRequest(
            artifact_id=artifact_id,
            continuation=_prompt(text, token_ids, chat),
            options=_generate_options("graft_stream", max_new_tokens, options, on_progress),
        )
        call = self._open(self._stub.Graft, request, COMPUTE)
        return GenerationStream(self._stream(call, COMPUTE), call.cancel, on_progress)

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
    return pb.GenerateOptions(
        max_new_tokens=max_new_tokens, progress=on_progress is not None, **decoding, **rest
    )


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


def _prompt(text: str | None, token_ids: Iterable[int] | None, chat: bool) -> pb.Prompt:
    if (text is None) == (token_ids is None):
        raise InvalidArgument("give either text or token_ids")
    if text is not None:
        return pb.Prompt(text=text, chat=chat)
    return pb.Prompt(tokens=pb.TokenIds(ids=list(token_ids)), chat=chat)
