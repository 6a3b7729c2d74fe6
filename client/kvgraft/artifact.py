"""Artifacts: a manifest plus the pages it names.

The manifest (kvgraft.v1.Manifest) is the identity of an artifact: its id is
the SHA-256 of the manifest's deterministic protobuf serialization. This
module owns the geometry rules every component relies on: how many pages an
artifact has, how many bytes each page holds, and what a valid manifest is.
Both the client (before sending) and the daemon (on receipt) validate with
`validate_manifest`, so the rules live in one place.

Pages are raw bytes: K then V of one layer for one run of token positions,
each [kv_heads, tokens, head_dim] in the layout's dtype. They are never
converted here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvgraft.errors import DataLoss, InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb

FORMAT_VERSION = 1
DIGEST_BYTES = 32
MAX_MANIFEST_BYTES = 3 << 20  # one gRPC message with room to spare
MAX_PAGE_BYTES = 64 << 20
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 128
MAX_LABEL_VALUE_CHARS = 4096

DTYPE_BYTES = {pb.KV_DTYPE_FLOAT32: 4, pb.KV_DTYPE_FLOAT16: 2, pb.KV_DTYPE_BFLOAT16: 2}
DTYPE_NAMES = {
    pb.KV_DTYPE_FLOAT32: "float32",
    pb.KV_DTYPE_FLOAT16: "float16",
    pb.KV_DTYPE_BFLOAT16: "bfloat16",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def canonical_bytes(manifest: pb.Manifest) -> bytes:
    """The bytes the artifact id is computed over."""
    return manifest.SerializeToString(deterministic=True)


def artifact_id(manifest: pb.Manifest) -> str:
    return hashlib.sha256(canonical_bytes(manifest)).hexdigest()


def page_count(manifest: pb.Manifest) -> int:
    """Pages per layer: ceil(tokens / page_tokens)."""
    page_tokens = manifest.profile.page_tokens
    return -(-len(manifest.token_ids) // page_tokens)


def page_token_count(manifest: pb.Manifest, page_index: int) -> int:
    page_tokens = manifest.profile.page_tokens
    return min(page_tokens, len(manifest.token_ids) - page_index * page_tokens)


def page_size_bytes(layout: pb.KvLayout, tokens: int) -> int:
    """Bytes of one page of `tokens` positions: K and V, [kv_heads, tokens, head_dim]."""
    return 2 * layout.kv_heads * tokens * layout.head_dim * DTYPE_BYTES[layout.kv_dtype]


def page_sizes(manifest: pb.Manifest) -> dict[bytes, int]:
    """Size of every distinct page the manifest names (validated manifests only)."""
    return dict(_positioned_sizes(manifest))


def _positioned_sizes(manifest: pb.Manifest) -> Iterator[tuple[bytes, int]]:
    """(digest, size) of every page position in order: all pages are whole but the last's."""
    layers = manifest.layout.num_layers
    last = (page_count(manifest) - 1) * layers  # first position of the last page
    full = page_size_bytes(manifest.layout, page_token_count(manifest, 0))
    tail = page_size_bytes(manifest.layout, page_token_count(manifest, last // layers))
    for position, digest in enumerate(manifest.page_sha256):
        yield digest, full if position < last else tail


def validate_manifest(manifest: pb.Manifest) -> None:
    """Raise InvalidArgument unless `manifest` describes a well-formed artifact."""
    if manifest.format_version != FORMAT_VERSION:
        raise InvalidArgument(
            f"manifest format_version {manifest.format_version} is not supported "
            f"(this version reads {FORMAT_VERSION}); upgrade kvgraft"
        )
    if len(manifest.model_fingerprint) != DIGEST_BYTES:
        raise InvalidArgument("manifest model_fingerprint must be a 32-byte SHA-256")
    layout = manifest.layout
    if min(layout.num_layers, layout.kv_heads, layout.head_dim) < 1:
        raise InvalidArgument("manifest layout needs num_layers, kv_heads and head_dim >= 1")
    if layout.kv_dtype not in DTYPE_BYTES:
        raise InvalidArgument(
            f"manifest layout kv_dtype {layout.kv_dtype} is not one of {sorted(DTYPES_BY_NAME)}"
        )
    if manifest.profile.page_tokens < 1:
        raise InvalidArgument("manifest profile.page_tokens must be >= 1")
    tokens = len(manifest.token_ids)
    if tokens < 1:
        raise InvalidArgument("manifest has no token_ids: an artifact holds at least one token")
    _validate_segments(manifest.segment_ends, tokens)
    expected = page_count(manifest) * layout.num_layers
    if len(manifest.page_sha256) != expected:
        raise InvalidArgument(
            f"manifest names {len(manifest.page_sha256)} pages; {tokens} tokens in pages of "
            f"{manifest.profile.page_tokens} over {layout.num_layers} layers need {expected}"
        )
    if any(len(digest) != DIGEST_BYTES for digest in manifest.page_sha256):
        raise InvalidArgument("every manifest page_sha256 entry must be 32 bytes")
    if page_size_bytes(layout, min(tokens, manifest.profile.page_tokens)) > MAX_PAGE_BYTES:
        raise InvalidArgument(
            f"pages of this geometry exceed {MAX_PAGE_BYTES >> 20} MiB; use fewer page_tokens"
        )
    _validate_shared_sizes(manifest)
    _validate_labels(manifest.labels)
    if len(canonical_bytes(manifest)) > MAX_MANIFEST_BYTES:
        raise InvalidArgument(
            f"manifest exceeds {MAX_MANIFEST_BYTES >> 20} MiB; split the context into "
            "several artifacts"
        )


def _validate_segments(segment_ends: Sequence[int], tokens: int) -> None:
    if not segment_ends:
        raise InvalidArgument("manifest has no segment_ends; a single append is [tokens]")
    previous = 0
    for end in segment_ends:
        if end <= previous:
            raise InvalidArgument("manifest segment_ends must be strictly increasing and > 0")
        previous = end
    if previous != tokens:
        raise InvalidArgument(
            f"manifest segment_ends end at {previous}, but the artifact has {tokens} tokens"
        )


def _validate_shared_sizes(manifest: pb.Manifest) -> None:
    """One hash, one size: a page named at two sizes is a collision or a lie."""
    seen: dict[bytes, int] = {}
    for digest, size in _positioned_sizes(manifest):
        if seen.setdefault(digest, size) != size:
            raise InvalidArgument(
                f"page {digest.hex()[:16]} is named at two sizes ({seen[digest]} and {size} bytes)"
            )


def _validate_labels(labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels per artifact")
    for key, value in labels.items():
        if not key or len(key) > MAX_LABEL_KEY_CHARS:
            raise InvalidArgument(f"label keys must have 1 to {MAX_LABEL_KEY_CHARS} characters")
        if len(value) > MAX_LABEL_VALUE_CHARS:
            raise InvalidArgument(f"label {key!r} exceeds {MAX_LABEL_VALUE_CHARS} characters")


def parse_manifest(raw: bytes) -> pb.Manifest:
    """Parse manifest bytes from an untrusted source and validate them."""
    manifest = pb.Manifest()
    try:
        manifest.ParseFromString(raw)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise InvalidArgument(f"manifest bytes do not parse: {exc}") from None
    with_unknown = manifest.SerializeToString(deterministic=True)
    manifest.DiscardUnknownFields()
    if manifest.SerializeToString(deterministic=True) != with_unknown:
        raise InvalidArgument(
            "manifest carries fields this kvgraft version does not know; upgrade kvgraft"
        )
    validate_manifest(manifest)
    return manifest


@dataclass
class Artifact:
    """A manifest and the bytes of its pages, keyed by SHA-256."""

    manifest: pb.Manifest
    pages: dict[bytes, bytes | memoryview] = field(default_factory=dict)
    # Who computed or verified it (Ed25519 over its id): they travel with it, and a
    # daemon that trusts one of the keys grafts it at once (docs/architecture.md, "Trust").
    signatures: list[pb.ArtifactSignature] = field(default_factory=list)

    @property
    def id(self) -> str:
        return artifact_id(self.manifest)

    @classmethod
    def build(
        cls,
        *,
        model_fingerprint: bytes,
        layout: pb.KvLayout,
        profile: pb.ComputeProfile,
        token_ids: Sequence[int],
        page_bytes: Sequence[bytes | memoryview],
        segment_ends: Sequence[int] | None = None,
        labels: Mapping[str, str] | None = None,
        receipt: pb.Receipt | None = None,
    ) -> Artifact:
        """Make an artifact from pages given page-major (page p, layer l at p * L + l)."""
        manifest = pb.Manifest(
            format_version=FORMAT_VERSION,
            model_fingerprint=model_fingerprint,
            layout=layout,
            profile=profile,
            token_ids=list(token_ids),
            segment_ends=list(segment_ends or [len(token_ids)]),
            labels=dict(labels or {}),
        )
        if receipt is not None:
            manifest.receipt.CopyFrom(receipt)
        pages: dict[bytes, bytes | memoryview] = {}
        for data in page_bytes:
            digest = hashlib.sha256(data).digest()
            manifest.page_sha256.append(digest)
            pages[digest] = data
        validate_manifest(manifest)
        artifact = cls(manifest, pages)
        artifact.check_page_sizes()
        return artifact

    def page(self, page_index: int, layer: int) -> bytes | memoryview:
        digest = self.manifest.page_sha256[page_index * self.manifest.layout.num_layers + layer]
        return self.pages[digest]

    def check_page_sizes(self) -> None:
        for digest, size in page_sizes(self.manifest).items():
            data = self.pages.get(digest)
            if data is not None and len(memoryview(data).cast("B")) != size:
                raise InvalidArgument(
                    f"page {digest.hex()[:16]} has {len(data)} bytes; the layout needs {size}"
                )

    def verify(self) -> None:
        """Recompute every page's SHA-256; raise DataLoss on a mismatch or a missing page."""
        for digest in page_sizes(self.manifest):
            data = self.pages.get(digest)
            if data is None:
                raise DataLoss(f"page {digest.hex()[:16]} of artifact {self.id[:16]} is missing")
            if hashlib.sha256(data).digest() != digest:
                raise DataLoss(f"page {digest.hex()[:16]} of artifact {self.id[:16]} is corrupt")
