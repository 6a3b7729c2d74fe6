"""Typed results of the engine calls: what `Client.generate`, `graft`, `deposit`, `ask` and
`verify` return.

Small frozen dataclasses with the fields a caller reads (`text`,
`reused_tokens`, `receipt.prompt_logits_sha256`, ...), built from the daemon's
protobuf responses in one place. Each keeps that response as `raw`, for anyone
who wants every field of the wire message. Digests are `bytes`; `Receipt.hashes`
gives the three receipt hashes in hex, the thing to compare between two runs. Their
reprs are for reading: hashes in hex, counts, ids, logits by shape (never raw bytes or
protobuf text). Logits asked for (`return_logits`) are float32 numpy arrays; log-probabilities
asked for (`logprobs`) ride on each `Token`, and the result gathers them (`logprobs`).
`GenerationStream` is a Generate or Graft call in progress: iterate it for the
tokens as they arrive, then ask it for the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvgraft.errors import DataLoss
from kvgraft.v1 import kvgraft_pb2 as pb

ASK_PATHS = {
    pb.ASK_PATH_RECALL: "recall",
    pb.ASK_PATH_GENERATE: "generate",
    pb.ASK_PATH_LIBRARY: "library",
}


@dataclass(frozen=True)
class Receipt:
    """Proof of a computation: anyone with the same model and profile can re-run and compare."""

    input_sha256: bytes
    prompt_logits_sha256: bytes
    generated_logits_sha256: bytes
    generated_token_ids: tuple[int, ...]
    reused_tokens: int
    computed_tokens: int
    model_fingerprint: bytes
    profile: pb.ComputeProfile = field(hash=False)  # compared, but a message does not hash
    grafted_artifact_id: str
    # How the tokens were chosen, when not by argmax alone (None: greedy, no stop strings).
    sampling: Sampling | None
    raw: pb.Receipt = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, receipt: pb.Receipt) -> Receipt:
        sampled = receipt.HasField("sampling")
        return cls(
            input_sha256=receipt.input_sha256,
            prompt_logits_sha256=receipt.prompt_logits_sha256,
            generated_logits_sha256=receipt.generated_logits_sha256,
            generated_token_ids=tuple(receipt.generated_token_ids),
            reused_tokens=receipt.reused_tokens,
            computed_tokens=receipt.computed_tokens,
            model_fingerprint=receipt.model_fingerprint,
            profile=receipt.profile,
            grafted_artifact_id=receipt.grafted_artifact_id,
            sampling=Sampling.from_proto(receipt.sampling) if sampled else None,
            raw=receipt,
        )

    @property
    def hashes(self) -> tuple[str, str, str]:
        """(input, prompt logits, generated logits) SHA-256 in hex: equal runs, equal hashes."""
        return (
            self.input_sha256.hex(),
            self.prompt_logits_sha256.hex(),
            self.generated_logits_sha256.hex(),
        )

    def __repr__(self) -> str:
        return _repr(
            self,
            reused_tokens=self.reused_tokens,
            computed_tokens=self.computed_tokens,
            generated_tokens=len(self.generated_token_ids),
            input_sha256=self.input_sha256.hex(),
            prompt_logits_sha256=self.prompt_logits_sha256.hex(),
            generated_logits_sha256=self.generated_logits_sha256.hex(),
            model_fingerprint=self.model_fingerprint.hex()[:16],  # as `kvgraft info` shows it
            grafted_artifact_id=self.grafted_artifact_id,
            **({"sampling": self.sampling} if self.sampling is not None else {}),
        )


@dataclass(frozen=True)
class Sampling:
    """How a run chose its tokens when not by argmax alone, as its receipt covers it: with
    the same receipt inputs and these, anyone chooses the same tokens again."""

    greedy: bool  # True: argmax with stop strings; False: sampled as below
    temperature: float
    top_p: float  # nucleus: the fewest likeliest tokens whose mass reaches it (1.0: all)
    top_k: int  # only the k likeliest tokens (0: all)
    seed: int
    stop: tuple[str, ...]  # generation ended at the first of these in the text

    @classmethod
    def from_proto(cls, sampling: pb.Sampling) -> Sampling:
        return cls(
            greedy=sampling.greedy,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed,
            stop=tuple(sampling.stop),
        )


def _repr(result: object, **fields: object) -> str:
    """`Name(field=value, ...)`, each value as repr() shows it."""
    shown = ", ".join(f"{name}={value!r}" for name, value in fields.items())
    return f"{type(result).__name__}({shown})"


class _Shape:
    """How an array shows in a repr: `float32[16, 49152]`, not its numbers."""

    def __init__(self, array: np.ndarray | None) -> None:
        self._text = "None" if array is None else f"{array.dtype}{list(array.shape)}"

    def __repr__(self) -> str:
        return self._text


def _logits(prompt: bytes, generated: list[bytes]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The logits a GenerateResult carries (float32 little-endian bytes) as arrays:
    [vocab] at the last prompt position, [steps, vocab] for the generated steps; None
    when they were not asked for."""
    if not prompt:
        return None, None
    vocab = len(prompt) // 4
    steps = np.frombuffer(b"".join(generated), dtype="<f4").reshape(len(generated), vocab)
    return np.frombuffer(prompt, dtype="<f4").astype(np.float32), steps.astype(np.float32)


@dataclass(frozen=True)
class TokenLogprob:
    """A likely token at one step, with its log-probability (natural log, the model's own:
    before temperature, top-p and top-k)."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class Token:
    """A token as it is generated (`text`: the token decoded on its own). Asked for with
    `logprobs=True`: its `logprob`, and with `top_logprobs=N` the N likeliest tokens of
    its step, likeliest first."""

    token_id: int
    text: str
    logprob: float | None = None  # None unless logprobs were asked for
    top_logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, token: pb.GeneratedToken, logprobs: bool) -> Token:
        if not logprobs:  # the wire's 0.0 would read as a probability of 1
            return cls(token.token_id, token.text)
        top = tuple(TokenLogprob(t.token_id, t.text, t.logprob) for t in token.top_logprobs)
        return cls(token.token_id, token.text, token.logprob, top)

    def __repr__(self) -> str:
        shown = {"token_id": self.token_id, "text": self.text}
        if self.logprob is not None:
            shown.update(logprob=self.logprob, top_logprobs=self.top_logprobs)
        return _repr(self, **shown)


@dataclass(frozen=True)
class Progress:
    """How far a prompt got while the daemon computes it: `done` of its `total` tokens,
    `reused` of them grafted (asked for with `on_progress`)."""

    done: int
    total: int
    reused: int


@dataclass(frozen=True)
class GenerateResult:
    """The end of a generate or graft call."""

    text: str  # every generated token decoded together (special tokens left out; cut
    # before the stop string that ended it)
    token_ids: tuple[int, ...]  # the generated token ids
    reused_tokens: int  # tokens whose KV was grafted from the store
    computed_tokens: int  # tokens whose KV was computed
    receipt: Receipt
    deposited_artifact_id: str  # with deposit=True: the stored context's id
    # Why generation ended: "stop" (end of turn, a stop token or string) or "length"
    # (max_new_tokens reached); "" from a daemon that does not say.
    finish_reason: str
    # With return_logits=True (else None), float32: [vocab] at the last prompt position
    # and [steps, vocab] for the generated ones; their bytes are what the receipt hashes.
    prompt_logits: np.ndarray | None = field(compare=False)
    generated_logits: np.ndarray | None = field(compare=False)
    # With logprobs=True (else None): every generated Token with its logprob (and its
    # top_logprobs), as the stream gave them.
    logprobs: tuple[Token, ...] | None = field(repr=False, compare=False)
    raw: pb.GenerateResult = field(repr=False, compare=False)

    @classmethod
    def from_proto(
        cls, result: pb.GenerateResult, logprobs: tuple[Token, ...] | None = None
    ) -> GenerateResult:
        receipt = Receipt.from_proto(result.receipt)
        prompt_logits, generated_logits = _logits(result.prompt_logits, result.generated_logits)
        return cls(
            text=result.text,
            token_ids=receipt.generated_token_ids,
            reused_tokens=receipt.reused_tokens,
            computed_tokens=receipt.computed_tokens,
            receipt=receipt,
            deposited_artifact_id=result.deposited_artifact_id,
            finish_reason=result.finish_reason,
            prompt_logits=prompt_logits,
            generated_logits=generated_logits,
            logprobs=logprobs,
            raw=result,
        )

    def __repr__(self) -> str:
        return _repr(
            self,
            text=self.text,
            token_ids=self.token_ids,
            **({"finish_reason": self.finish_reason} if self.finish_reason else {}),
            reused_tokens=self.reused_tokens,
            computed_tokens=self.computed_tokens,
            deposited_artifact_id=self.deposited_artifact_id,
            prompt_logits=_Shape(self.prompt_logits),
            generated_logits=_Shape(self.generated_logits),
            receipt=self.receipt,
        )


@dataclass(frozen=True)
class DepositResult:
    """A context computed and stored by the daemon."""

    artifact_id: str
    reused_tokens: int
    computed_tokens: int
    receipt: Receipt
    raw: pb.DepositResponse = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, response: pb.DepositResponse) -> DepositResult:
        receipt = Receipt.from_proto(response.receipt)
        return cls(
            artifact_id=response.artifact_id,
            reused_tokens=receipt.reused_tokens,
            computed_tokens=receipt.computed_tokens,
            receipt=receipt,
            raw=response,
        )


@dataclass(frozen=True)
class VerifyResult:
    """A stored artifact recomputed fresh: `ok` when every hash matched."""

    ok: bool
    mismatches: tuple[str, ...]  # names of the fields that differ
    stored: Receipt
    recomputed: Receipt
    raw: pb.VerifyResponse = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, response: pb.VerifyResponse) -> VerifyResult:
        return cls(
            ok=response.ok,
            mismatches=tuple(response.mismatches),
            stored=Receipt.from_proto(response.stored),
            recomputed=Receipt.from_proto(response.recomputed),
            raw=response,
        )


@dataclass(frozen=True)
class AskResult:
    """An answer: recalled from a library entry, generated, or generated with a library."""

    answer: str
    path: str  # "recall", "generate" or "library"
    matched_entry: str | None  # the library entry recalled; None when none matched
    verified_answer: str  # recall: the entry's stored answer
    matches_verified: bool  # recall: the answer equals the stored one (normalized)
    decode_tokens: int
    reused_tokens: int
    computed_tokens: int
    receipt: Receipt
    wall_s: float
    cpu_s: float
    library_artifact_id: str  # library path: the library context grafted
    library_built: bool  # library path: this call computed that context first
    raw: pb.AskResponse = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, response: pb.AskResponse) -> AskResult:
        receipt = Receipt.from_proto(response.receipt)
        return cls(
            answer=response.answer,
            path=ASK_PATHS.get(response.path, "unspecified"),
            matched_entry=response.entry_id or None,
            verified_answer=response.verified_answer,
            matches_verified=response.matches_verified,
            decode_tokens=response.decode_tokens,
            reused_tokens=receipt.reused_tokens,
            computed_tokens=receipt.computed_tokens,
            receipt=receipt,
            wall_s=response.wall_s,
            cpu_s=response.cpu_s,
            library_artifact_id=response.library_artifact_id,
            library_built=response.library_built,
            raw=response,
        )


class GenerationStream:
    """A generate or graft call in progress.

        stream = client.generate_stream(text="...", max_new_tokens=32)
        for token in stream:            # Token(token_id, text), as generated
            print(token.text, end="", flush=True)
        result = stream.result()        # GenerateResult, the receipt included

    `result()` reads whatever has not been read yet; `cancel()` ends the call. With
    `on_progress`, the prompt's Progress reports are handed to it as they arrive. With
    `logprobs` (the call asked for them) each Token carries its log-probabilities and
    the result gathers the tokens (GenerateResult.logprobs).
    """

    def __init__(
        self,
        responses: Iterator[pb.GenerateResponse],
        cancel,
        on_progress: Callable[[Progress], None] | None = None,
        *,
        logprobs: bool = False,
    ) -> None:
        self._responses = responses
        self._cancel = cancel
        self.on_progress = on_progress
        self._logprobs = logprobs
        self._tokens: list[Token] = []
        self._result: GenerateResult | None = None

    def __iter__(self) -> Iterator[Token]:
        for response in self._responses:
            if response.HasField("token"):
                token = Token.from_proto(response.token, self._logprobs)
                if self._logprobs:
                    self._tokens.append(token)
                yield token
            elif response.HasField("result"):
                gathered = tuple(self._tokens) if self._logprobs else None
                self._result = GenerateResult.from_proto(response.result, gathered)
            elif response.HasField("progress") and self.on_progress is not None:
                got = response.progress
                self.on_progress(
                    Progress(got.prompt_tokens_done, got.prompt_tokens, got.reused_tokens)
                )

    def result(self) -> GenerateResult:
        for _ in self:
            pass
        if self._result is None:
            raise DataLoss("the generation stream ended without a result")
        return self._result

    def cancel(self) -> None:
        self._cancel()
