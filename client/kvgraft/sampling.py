"""Sampling temperatures as they travel, shared by the client, the CLI and the daemon.

GenerateOptions.temperature is a float32 on the wire: `as_float32` is the value the
daemon reads for a Python float (inf beyond float32's range, 0 below its smallest).
The daemon samples at MIN_TEMPERATURE..MAX_TEMPERATURE (below, logits divided by the
temperature overflow and sampling fails); 0 means greedy decoding.
"""

from __future__ import annotations

import math
import struct

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4


def as_float32(value: float) -> float:
    """`value` as a float32 field carries it (inf beyond its range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
