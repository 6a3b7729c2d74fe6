"""What a generation request asks for and what it yields (no torch needed here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgraft.v1 import kvgraft_pb2 as pb


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = 0
    greedy: bool = True  # argmax, the exact mode; otherwise seeded sampling
    temperature: float = 1.0
    top_p: float = 1.0  # sampling: the likeliest tokens whose mass reaches it (1.0: all)
    top_k: int = 0  # sampling: only the k likeliest (0: all)
    seed: int = 0
    no_cache: bool = False  # compute everything, graft nothing
    deposit: bool = False  # store the finished context
    keep: bool = False  # keep it if the store has room, as cache = "auto" does every one
    return_logits: bool = False  # hand back the logits vectors with the result
    allow_untrusted: bool = False  # Graft: restore an untrusted artifact all the same
    labels: Mapping[str, str] = field(default_factory=dict)
    # Also end after generating one of these (it is kept and counted), besides EOS.
    stop_token_ids: frozenset[int] = frozenset()
    # End once the generated text holds one of these (the result's text stops before it).
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # each token's log-probability
    top_logprobs: int = 0  # and the likeliest alternatives' (0..20)
    progress: bool = False  # report how far the prompt got while it is computed


@dataclass(frozen=True)
class ProgressEvent:
    """How far a prompt got while it is computed: `done` of its `total` tokens, of which
    `reused` were grafted."""

    done: int
    total: int
    reused: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as soon as it is chosen (with its log-probabilities if asked)."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[pb.TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ResultEvent:
    """The end of a request: its receipt and, if deposited, the artifact id."""

    receipt: pb.Receipt
    text: str  # up to a stop string, if one ended it
    artifact_id: str
    prompt_logits: bytes = b""  # float32 little-endian, when asked for
    generated_logits: tuple[bytes, ...] = ()
    finish_reason: str = "length"  # "stop": end of turn, a stop token or string
