"""How the command line shows things: JSON documents (`--json`) and plain tables.

Digests (bytes fields) are shown as lowercase hex everywhere, in JSON too, so
ids and hashes can be pasted between commands. Field names are the proto's.
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
