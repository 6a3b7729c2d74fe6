"""Sampling values as they travel, shared by the client, the CLI and the daemon.

GenerateOptions.temperature and .top_p are float32s on the wire: `as_float32` is the value
the daemon reads for a Python float (inf beyond float32's range, 0 below its smallest).
On the wire 0 means "unset": a temperature of 0 is read as 1.0, a top_p of 0 as 1 (keep
every token). So a value is checked as the float32 it becomes, never as the float it was:
1e-300 passes a check of 0..2 yet arrives as 0, another meaning. `sampling_temperature`
and `nucleus_mass` refuse such values (InvalidArgument naming the field and the least
value allowed).

The daemon samples at MIN_TEMPERATURE..MAX_TEMPERATURE (below, logits divided by the
temperature overflow and sampling fails); 0 means greedy decoding. The least top_p is
MIN_TOP_P, float32's smallest positive value: any top_p that small keeps only the
likeliest token (the first is always kept), which is what a tiny top_p asks for.
"""

from __future__ import annotations

import math
import struct

from kvgraft.errors import InvalidArgument

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4
MIN_TOP_P = 2.0**-149  # float32's smallest positive (subnormal) value: below it, 0


def as_float32(value: float) -> float:
    """`value` as a float32 field carries it (inf beyond its range)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def sampling_temperature(value: float, param: str = "temperature") -> float:
    """The float32 a sampling temperature (a float above 0) travels as; InvalidArgument
    naming `param` where it is not in MIN_TEMPERATURE..MAX_TEMPERATURE as a float32, among
    them every value that becomes 0 on the wire (which the daemon would read as 1.0)."""
    wire = as_float32(value)
    # 0.0001 itself arrives as 9.99999975e-05: the bound is compared as a float32 too
    if wire < as_float32(MIN_TEMPERATURE):
        became = ", and 0 as the float32 it travels as, which would mean 1.0" if wire == 0 else ""
        raise InvalidArgument(
            f"{param} {value:g} is below {MIN_TEMPERATURE:g}, the least temperature to sample "
            f"at{became}; send 0 to decode greedily",
            param=param,
        )
    if not wire <= MAX_TEMPERATURE:  # NaN too
        raise InvalidArgument(
            f"{param} {value:g} is not a temperature to sample at: send one in "
            f"{MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}",
            param=param,
        )
    return wire


def nucleus_mass(value: float, param: str = "top_p") -> float:
    """The float32 a top_p (`value` in 0..1, above 0) travels as; InvalidArgument naming
    `param` where it becomes 0 on the wire (which the daemon would read as 1: every token)."""
    wire = as_float32(value)
    if wire == 0:
        raise InvalidArgument(
            f"{param} {value:g} is 0 as the float32 it travels as, which would mean 1 (keep "
            f"every token): the least {param} is {MIN_TOP_P:.4g}, which keeps the likeliest "
            "token only",
            param=param,
        )
    return wire
