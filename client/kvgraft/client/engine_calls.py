"""The engine's calls of `kvgraft.Client`: lookup, deposit, generate, graft, verify.

The engine's calls return the typed results of kvgraft.results (the protobuf
response stays available as their `raw`); generate and graft wait for the end,
generate_stream and graft_stream give the tokens as they come.

Calls that compute (deposit, generate, graft, verify) take the transfer
deadline of kvgraft.client.connection.Connection; lookup the short one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvgraft.client.connection import Connection
from kvgraft.errors import InvalidArgument
from kvgraft.results import (
    DepositResult,
    GenerateResult,
    GenerationStream,
    VerifyResult,
)
from kvgraft.v1 import kvgraft_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 32  # the CLI's default too
LOGITS_MAX_NEW_TOKENS = 16  # the daemon returns the logits of at most 16 steps (one message)


class EngineCalls(Connection):
    def lookup(
        self,
        token_ids: Iterable[int] | None = None,
        *,
        text: str | None = None,
        chat: bool = False,
    ) -> pb.LookupResponse:
        """How much of a prompt the store holds as whole pages (what a generate would reuse)."""
        if text is not None:
            request = pb.LookupRequest(prompt=_prompt(text, token_ids, chat))
        elif token_ids is not None:
            request = pb.LookupRequest(token_ids=list(token_ids))
        else:
            raise InvalidArgument("give either text or token_ids")
        return self._unary(self._stub.Lookup, request)

    def deposit(
        self,
        text: str | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        chat: bool = False,
        labels: Mapping[str, str] | None = None,
        verified_by: str = "",
    ) -> DepositResult:
        """Have the daemon compute a context and store it; returns its id and receipt."""
        request = pb.DepositRequest(
            prompt=_prompt(text, token_ids, chat), labels=labels, verified_by=verified_by
        )
        response = self._unary(self._stub.Deposit, request, self.transfer_timeout_s)
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

        Options: max_new_tokens (default 32, as the CLI's; 16 with return_logits, the
        most steps whose logits the daemon returns), greedy (default True), temperature,
        seed, no_cache, deposit, labels, return_logits (see GenerateOptions in the
        proto). `generate_stream` gives the tokens as they come.
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
        """generate, as a stream: iterate it for the tokens, then call its result()."""
        request = pb.GenerateRequest(
            prompt=_prompt(text, token_ids, chat),
            options=_generate_options(max_new_tokens, options),
        )
        call = self._open(self._stub.Generate, request, self.transfer_timeout_s)
        return GenerationStream(self._stream(call), call.cancel)

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
        """Graft a whole artifact, append the continuation, generate; waits for the end."""
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
        request = pb.GraftRequest(
            artifact_id=artifact_id,
            continuation=_prompt(text, token_ids, chat),
            options=_generate_options(max_new_tokens, options),
        )
        call = self._open(self._stub.Graft, request, self.transfer_timeout_s)
        return GenerationStream(self._stream(call), call.cancel)

    def verify(self, artifact_id: str) -> VerifyResult:
        """Recompute an artifact fresh on the daemon and compare every hash."""
        request = pb.VerifyRequest(artifact_id=artifact_id)
        response = self._unary(self._stub.Verify, request, self.transfer_timeout_s)
        return VerifyResult.from_proto(response)


def _generate_options(max_new_tokens: int | None, options: dict) -> pb.GenerateOptions:
    if max_new_tokens is None:
        logits = options.get("return_logits", False)
        max_new_tokens = LOGITS_MAX_NEW_TOKENS if logits else DEFAULT_MAX_NEW_TOKENS
    return pb.GenerateOptions(max_new_tokens=max_new_tokens, **options)


def _prompt(text: str | None, token_ids: Iterable[int] | None, chat: bool) -> pb.Prompt:
    if (text is None) == (token_ids is None):
        raise InvalidArgument("give either text or token_ids")
    if text is not None:
        return pb.Prompt(text=text, chat=chat)
    return pb.Prompt(tokens=pb.TokenIds(ids=list(token_ids)), chat=chat)
