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
    seed: int = 0
    no_cache: bool = False  # compute everything, graft nothing
    deposit: bool = False  # store the finished context
    return_logits: bool = False  # hand back the logits vectors with the result
    allow_untrusted: bool = False  # Graft: restore an untrusted artifact all the same
    labels: Mapping[str, str] = field(default_factory=dict)
    # Also end after generating one of these (it is kept and counted), besides EOS.
    stop_token_ids: frozenset[int] = frozenset()
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
    """One generated token, as soon as it is chosen."""

    token_id: int
    text: str


@dataclass(frozen=True)
class ResultEvent:
    """The end of a request: its receipt and, if deposited, the artifact id."""

    receipt: pb.Receipt
    text: str
    artifact_id: str
    prompt_logits: bytes = b""  # float32 little-endian, when asked for
    generated_logits: tuple[bytes, ...] = ()
