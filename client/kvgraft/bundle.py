"""Artifact bundles: one artifact in one safetensors file.

Layout (the safetensors format, written by hand so pages stream to disk and
bfloat16 needs no numpy support): each distinct page is a tensor named
`kv.<sha256 hex>` of shape [2, kv_heads, tokens, head_dim] (K then V) in the
layout's dtype, in the order the manifest first names it; `__metadata__`
holds the format tag, the artifact id and the manifest (base64 of its
canonical bytes). The header is compact JSON padded with spaces to 8 bytes.
Writing is a pure function of the artifact, so importing a bundle and
exporting it again gives the identical file. Files are written to a
temporary name, fsynced, then renamed: a reader never sees half a bundle.

Reading checks everything: the format tag, the manifest, that the header names
each of the artifact's pages exactly once with its dtype, shape and offsets and
nothing else, and every page's SHA-256 (DataLoss on a mismatch). A signature by a
key of small order is dropped on reading (the importing daemon checks the others).
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import struct
from pathlib import Path

from kvgraft.artifact import Artifact, canonical_bytes, page_sizes, page_token_count, parse_manifest
from kvgraft.errors import DataLoss, InvalidArgument
from kvgraft.public_keys import is_degenerate
from kvgraft.v1 import kvgraft_pb2 as pb

BUNDLE_FORMAT = "kvgraft-bundle/1"
_SAFETENSORS_DTYPES = {
    pb.KV_DTYPE_FLOAT32: "F32",
    pb.KV_DTYPE_FLOAT16: "F16",
    pb.KV_DTYPE_BFLOAT16: "BF16",
}
_MAX_HEADER_BYTES = 100 << 20


def _tensor_name(digest: bytes) -> str:
    return "kv." + digest.hex()


def _page_shapes(manifest: pb.Manifest) -> dict[bytes, list[int]]:
    layout = manifest.layout
    shapes: dict[bytes, list[int]] = {}
    for position, digest in enumerate(manifest.page_sha256):
        tokens = page_token_count(manifest, position // layout.num_layers)
        shapes.setdefault(digest, [2, layout.kv_heads, tokens, layout.head_dim])
    return shapes


def _header(artifact: Artifact) -> bytes:
    manifest = artifact.manifest
    sizes = page_sizes(manifest)
    dtype = _SAFETENSORS_DTYPES[manifest.layout.kv_dtype]
    header: dict[str, object] = {
        "__metadata__": {
            "format": BUNDLE_FORMAT,
            "artifact_id": artifact.id,
            "manifest": base64.b64encode(canonical_bytes(manifest)).decode("ascii"),
            # who computed or verified it: a daemon trusting one of these grafts it at once
            # (a JSON string: safetensors metadata values are strings)
            "signatures": json.dumps(
                [
                    {"public_key": s.public_key.hex(), "signature": s.signature.hex()}
                    for s in artifact.signatures
                ],
                separators=(",", ":"),
            ),
        }
    }
    offset = 0
    for digest, shape in _page_shapes(manifest).items():
        header[_tensor_name(digest)] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + sizes[digest]],
        }
        offset += sizes[digest]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-(8 + len(encoded)) % 8)


def write_bundle(artifact: Artifact, path: Path) -> None:
    """Write `artifact` (all pages present) to `path` atomically."""
    artifact.check_page_sizes()
    header = _header(artifact)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            for digest in _page_shapes(artifact.manifest):
                out.write(artifact.pages[digest])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _signatures(path: Path, found: object) -> list[pb.ArtifactSignature]:
    """The metadata's signatures, but those by a key of small order (kvgraft.public_keys:
    they "sign" any artifact, so one proves a forgery, not who computed it), dropped
    here as the daemon would drop them. The rest are checked by the daemon that
    imports them."""
    try:
        items = json.loads(found)  # type: ignore[arg-type]
        signatures = [
            pb.ArtifactSignature(
                public_key=bytes.fromhex(item["public_key"]),
                signature=bytes.fromhex(item["signature"]),
            )
            for item in items
        ]
    except (TypeError, KeyError, ValueError):
        raise InvalidArgument(f"{path}: its metadata's signatures are malformed") from None
    return [s for s in signatures if not is_degenerate(s.public_key)]


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are unique (json keeps the last of a repeated key silently)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        repeated = next(key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1)
        raise ValueError(f"the name {repeated!r} appears twice")
    return found


def read_bundle(path: Path) -> Artifact:
    """Read and fully verify a bundle. Page bytes are views of a read-only map."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise InvalidArgument(f"{path} is not a kvgraft bundle (too short)")
            data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except FileNotFoundError:
        raise InvalidArgument(f"{path} does not exist") from None
    except OSError as exc:  # a directory, no permission, ...
        raise InvalidArgument(f"{path}: cannot read it ({exc.strerror})") from None
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > min(_MAX_HEADER_BYTES, size - 8):
        raise InvalidArgument(f"{path} is not a safetensors file (bad header length)")
    try:
        header = json.loads(bytes(data[8 : 8 + header_bytes]), object_pairs_hook=_unique_keys)
        metadata = header.pop("__metadata__")
        if metadata.get("format") != BUNDLE_FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}")
        manifest = parse_manifest(base64.b64decode(metadata["manifest"], validate=True))
    except InvalidArgument:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgument(f"{path} is not a {BUNDLE_FORMAT} bundle ({exc})") from None
    artifact = Artifact(manifest, signatures=_signatures(path, metadata.get("signatures", "[]")))
    if metadata.get("artifact_id") != artifact.id:
        raise DataLoss(f"{path}: the artifact id in its metadata does not match its manifest")
    body = data[8 + header_bytes :]
    shapes = _page_shapes(manifest)
    extra = sorted(set(header) - {_tensor_name(digest) for digest in shapes})
    if extra:
        raise InvalidArgument(
            f"{path} holds tensors its manifest does not name ({', '.join(extra[:3])}): "
            "a bundle holds exactly its artifact's pages"
        )
    dtype = _SAFETENSORS_DTYPES[manifest.layout.kv_dtype]
    for digest, expected in page_sizes(manifest).items():
        name = digest.hex()[:16]
        entry = header.get(_tensor_name(digest))
        if not isinstance(entry, dict):
            raise DataLoss(f"{path} lacks page {name}")
        if entry.get("dtype") != dtype or entry.get("shape") != shapes[digest]:
            raise InvalidArgument(
                f"{path}: page {name} is {entry.get('dtype')} {entry.get('shape')}; the "
                f"manifest's layout needs {dtype} {shapes[digest]}"
            )
        offsets = entry.get("data_offsets")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(offset) is int for offset in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(body)
        ):
            raise InvalidArgument(f"{path}: page {name} has bad data_offsets {offsets!r}")
        start, end = offsets
        if end - start != expected:
            raise DataLoss(f"{path}: page {name} has {end - start} bytes, not {expected}")
        artifact.pages[digest] = body[start:end]
    artifact.verify()
    return artifact
