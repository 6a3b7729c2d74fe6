"""How the command line shows things: JSON documents (`--json`), plain tables, and text
streamed as it is generated.

Digests (bytes fields) are shown as lowercase hex everywhere, in JSON too, so
ids and hashes can be pasted between commands. Field names are the proto's, and so are
enum values (KV_DTYPE_FLOAT32), except trust: one word everywhere (`trust_name`:
computed, verified, signed, untrusted), in tables, `stat`, JSON and the HTTP API's
receipts alike.
Streamed text never shows a stop string: `HeldText` holds back what may be the start
of one until the next token says.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvgraft.errors import printable
from kvgraft.results import Token
from kvgraft.v1 import kvgraft_pb2 as pb

TRUST_NAMES = {
    pb.Provenance.TRUST_COMPUTED: "computed",
    pb.Provenance.TRUST_VERIFIED: "verified",
    pb.Provenance.TRUST_SIGNED: "signed",
    pb.Provenance.TRUST_UNTRUSTED: "untrusted",
}


def trust_name(trust: int) -> str:
    """A Provenance.Trust as users read it: "computed", ...; unset is untrusted."""
    return TRUST_NAMES.get(trust, "untrusted")


def message_to_json(message: Message) -> dict:
    """A protobuf message as plain JSON data, every field present, bytes as hex."""
    out: dict = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _scalar(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_scalar(field, v) for v in value]
        elif field.message_type is not None and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _scalar(field, value)
    return out


def _scalar(field: FieldDescriptor, value):
    if field.message_type is not None:
        return message_to_json(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes(value).hex()
    if field.enum_type is pb.Provenance.Trust.DESCRIPTOR:
        return trust_name(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    return value


def human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def emit(as_json: bool, document: object, text: str) -> None:
    """Print one JSON document, or the plain text, on stdout."""
    print(json.dumps(document, indent=2) if as_json else text)


def when(unix_ms: int) -> str:
    """A unix-ms time as UTC "YYYY-MM-DD HH:MM:SS"."""
    return datetime.fromtimestamp(unix_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def time_left(unix_ms: int) -> str:
    """How long until `unix_ms`, in whole minutes rounded up: "2h00m", "3d04h", "5m"."""
    minutes = max(0, math.ceil((unix_ms - time.time() * 1000) / 60_000))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"


def clip(text: str, width: int) -> str:
    """`text` on one line (runs of whitespace as one space), printable, cut to `width`
    with "…"."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def progress_bar(
    args: argparse.Namespace, description: str, *, total: int | None = None, unit: str = "B"
):
    """A tqdm bar on stderr for interactive use (a terminal, not --json); else None."""
    if args.json or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=description, file=sys.stderr)


class HeldText:
    """Generated text as it may be shown while it streams, given the run's stop strings:
    the daemon sends the token that completes a stop string before it stops, and cuts
    the result's text before it, so the tail that could begin a stop string waits."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._text = ""
        self._shown = 0
        self._stopped = False

    def add(self, piece: str) -> str:
        """The text that may be shown now that `piece` came."""
        if self._stopped:
            return ""
        self._text += piece
        found = [i for i in (self._text.find(stop) for stop in self._stops) if i >= 0]
        if found:
            self._stopped = True
            return self._take(min(found))
        held = max(  # the longest tail that begins a stop string
            (n for s in self._stops for n in range(1, len(s)) if self._text.endswith(s[:n])),
            default=0,
        )
        return self._take(len(self._text) - held)

    def finish(self) -> str:
        """What is still held at the end (no stop string came after all)."""
        return "" if self._stopped else self._take(len(self._text))

    def _take(self, end: int) -> str:
        shown, self._shown = self._text[self._shown : end], max(self._shown, end)
        return shown


def token_to_json(token: Token) -> dict:
    """A generated token with its log-probabilities (asked for with --logprobs)."""
    return {
        "token_id": token.token_id,
        "text": token.text,
        "logprob": token.logprob,
        "top_logprobs": [
            {"token_id": t.token_id, "text": t.text, "logprob": t.logprob}
            for t in token.top_logprobs
        ],
    }


def logprob_table(tokens: Sequence[Token]) -> str:
    """One line per generated token: its text (quoted, so spaces show), its logprob, and
    the likeliest alternatives of its step with theirs."""
    rows = [
        (
            repr(token.text),
            f"{token.logprob:.4f}",
            ", ".join(f"{t.text!r} {t.logprob:.4f}" for t in token.top_logprobs),
        )
        for token in tokens
    ]
    return table(("token", "logprob", "likeliest"), rows)
