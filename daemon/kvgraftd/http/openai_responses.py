"""The engine's answers written in OpenAI's response shapes, with the receipt beside them.

A completion (`chat.completion`, `text_completion`) or the chunks of a stream
(`chat.completion.chunk`, `text_completion` chunks), field for field as OpenAI's API
reference spells them, plus one `kvgraft` object: the receipt's hashes in hex, the tokens
reused and computed, each grafted artifact and who vouched for it, the compute profile,
the sampling a verifier needs to replay the answer, and the artifact deposited. In a
stream it rides on the last chunk (the one with `finish_reason`).

`usage.prompt_tokens_details.cached_tokens` is the receipt's reused tokens: the prompt
tokens whose KV was grafted rather than computed. `TextDeltas` turns the tokens of a
stream into text pieces that never end inside a UTF-8 character and never show any part
of a stop string the final text leaves out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvgraft.v1 import kvgraft_pb2 as pb

TRUST_NAMES = {
    pb.Provenance.TRUST_COMPUTED: "computed",
    pb.Provenance.TRUST_SIGNED: "signed",
    pb.Provenance.TRUST_VERIFIED: "verified",
    pb.Provenance.TRUST_UNTRUSTED: "untrusted",
}


class Completion:
    """The fixed fields of one response (id, creation time, model), chat or text."""

    def __init__(self, model: str, fingerprint: bytes, chat: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.system_fingerprint = f"kvgraft-{fingerprint.hex()[:16]}"

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    # ------------------------------------------------------------------
    def whole(
        self, result: pb.GenerateResult, tokens: Sequence[pb.GeneratedToken], logprobs: bool
    ) -> dict[str, Any]:
        """The response of a request that did not stream."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            choice["logprobs"] = chat_logprobs(tokens) if logprobs else None
            obj = "chat.completion"
        else:
            choice["text"] = result.text
            choice["logprobs"] = text_logprobs(tokens) if logprobs else None
            obj = "text_completion"
        body = self._envelope(obj, [choice])
        body["usage"] = usage(result.receipt)
        body["kvgraft"] = kvgraft_object(result)
        return body

    def chunk(
        self, text: str, token: pb.GeneratedToken | None = None, first: bool = False
    ) -> dict[str, Any]:
        """One piece of a stream: `text` (and `token`'s log-probabilities, if asked)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            choice["logprobs"] = chat_logprobs([token]) if token is not None else None
            return self._envelope("chat.completion.chunk", [choice])
        choice["text"] = text
        choice["logprobs"] = text_logprobs([token]) if token is not None else None
        return self._envelope("text_completion", [choice])

    def last_chunk(self, text: str, result: pb.GenerateResult) -> dict[str, Any]:
        """The stream's last choice: the text not sent yet, finish_reason and the receipt."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
            choice["logprobs"] = None
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice["text"] = text
            choice["logprobs"] = None
            body = self._envelope("text_completion", [choice])
        body["kvgraft"] = kvgraft_object(result)
        return body

    def usage_chunk(self, result: pb.GenerateResult) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk without choices."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(result.receipt)
        return body


def usage(receipt: pb.Receipt) -> dict[str, Any]:
    completion = len(receipt.generated_token_ids)
    prompt = receipt.reused_tokens + receipt.computed_tokens - completion
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": receipt.reused_tokens},
    }


def kvgraft_object(result: pb.GenerateResult) -> dict[str, Any]:
    """The receipt as JSON: hashes in hex, counts, grafts, profile, sampling."""
    receipt = result.receipt
    profile = receipt.profile
    body: dict[str, Any] = {
        "receipt": {
            "input_sha256": receipt.input_sha256.hex(),
            "prompt_logits_sha256": receipt.prompt_logits_sha256.hex(),
            "generated_logits_sha256": receipt.generated_logits_sha256.hex(),
            "generated_token_ids": list(receipt.generated_token_ids),
            "model_fingerprint": receipt.model_fingerprint.hex(),
        },
        "reused_tokens": receipt.reused_tokens,
        "computed_tokens": receipt.computed_tokens,
        "grafted": [
            {
                "artifact_id": g.artifact_id,
                "tokens": g.tokens,
                "trust": TRUST_NAMES.get(g.trust, "unknown"),
                "owner": g.owner,
                "vouched_by": g.vouched_by.hex(),
            }
            for g in receipt.grafted
        ],
        "grafted_artifact_id": receipt.grafted_artifact_id,
        "profile": {
            "torch_version": profile.torch_version,
            "device_kind": profile.device_kind,
            "device_name": profile.device_name,
            "compute_dtype": profile.compute_dtype,
            "attention": profile.attention,
            "page_tokens": profile.page_tokens,
            "products": profile.products,
        },
        "sampling": _sampling(receipt),
        "deposited_artifact_id": result.deposited_artifact_id,
    }
    return body


def _sampling(receipt: pb.Receipt) -> dict[str, Any]:
    if not receipt.HasField("sampling"):
        return {"greedy": True, "stop": []}
    s = receipt.sampling
    if s.greedy:
        return {"greedy": True, "stop": list(s.stop)}
    return {
        "greedy": False,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": s.seed,
        "stop": list(s.stop),
    }


def chat_logprobs(tokens: Sequence[pb.GeneratedToken]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.text,
                "logprob": t.logprob,
                "bytes": list(t.text.encode()),
                "top_logprobs": [
                    {"token": a.text, "logprob": a.logprob, "bytes": list(a.text.encode())}
                    for a in t.top_logprobs
                ],
            }
            for t in tokens
        ]
    }


def text_logprobs(tokens: Sequence[pb.GeneratedToken], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' shape; `offset`: where the first token's text starts."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{a.text: a.logprob for a in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
    }


class TextDeltas:
    """The text a stream has not sent yet, as each token arrives.

    The generated tokens are decoded together each time (a character split across tokens
    shows only once whole); the end of the text that could begin one of the stop strings
    is held back until the next token tells. The final text (the engine's, cut before a
    stop string) settles what is left.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self.sent = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):  # inside a character: wait for its other bytes
            return ""
        safe = text[: len(text) - self._held(text)]
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def rest(self, final_text: str) -> str:
        """What is left to send of the final text."""
        if final_text.startswith(self.sent):
            return final_text[len(self.sent) :]
        return ""  # the decoded pieces disagreed with the whole (not seen with BPE)

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that begin a stop string (or hold one whole: the
        engine cuts there)."""
        held = 0
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                held = max(held, len(text) - at)
                continue
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held
