"""Ed25519 public keys that vouch for nothing: the identity and the other points of small order.

An artifact's signature is Ed25519 over its id (kvgraftd.store.signing). Verification
checks [S]B = R + [k]A; when the public key A is a point of small order (the identity,
or one of the seven others in the curve's 8-torsion) that equation holds for S = 0 and
an R among the torsion points, whatever the message: the identity key with R = identity
and S = 0 "signs" every artifact. The cryptography package (OpenSSL) accepts such keys
and signatures, so every place a key or a signature enters checks this first:
uploads, replication and the bucket (through the daemon's signature check), bundles,
and `[trust] keys`.

The check is libsodium's blocklist (`has_small_order`): a key is refused when its y
coordinate, reduced mod p = 2^255 - 19, is that of a small-order point (1, p - 1, 0, or
±Y8, those of order 8), whatever its sign bit. Reducing first catches the non-canonical
encodings (y = p, y = p + 1) too. Pure Python, no dependency: the client imports it.
"""

from __future__ import annotations

KEY_BYTES = 32
_P = 2**255 - 19
# The y of the points of order 8: a root of d*y^4 + 2*y^2 - 1 = 0 (mod p), where
# d = -121665/121666 is the curve's constant (the other root is p - Y8).
_Y8 = 2707385501144840649318225287225658788936804267575313519463743609750303402022
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _Y8, _P - _Y8})


def is_degenerate(public_key: bytes) -> bool:
    """Whether a 32-byte Ed25519 public key is a point of small order (the identity among
    them): a key any signature "by" which proves nothing. A key of another length is
    not a key at all: the caller refuses it on its own terms."""
    if len(public_key) != KEY_BYTES:
        return False
    y = int.from_bytes(public_key, "little") & ((1 << 255) - 1)  # without x's sign bit
    return (y - _P if y >= _P else y) in _SMALL_ORDER_Y
