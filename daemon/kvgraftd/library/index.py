"""The knowledge library's index: entries and library contexts, kept from the change feed.

The store's change feed (`log` sub-database: every artifact added or
deleted, in order, never truncated) is the single source of truth. The index
replays it from the last sequence it saw before every library request, reading
the manifest of each added artifact once, so it follows artifacts written by
any path: LibraryAdd, Deposit, PutArtifact, replication, Delete, `kvgraft rm`.
No sub-database is added to the store and nothing is written: a restart rebuilds
the index by one replay (one manifest read per artifact ever added).

An artifact of the served model is an entry when it is exactly what LibraryAdd writes
for the texts its labels name (library.format.is_entry: its labels and tokens are
made again from those texts, once, when it is indexed), whoever wrote it: labels
alone, which any Deposit may set, do not make an entry, so a Deposit labelled for a
question cannot stand for it. Entries are kept per recall key, and per normalized
problem text for questions asked in other words; library contexts per (fingerprint,
tag, library key), recognised by their labels and used only when they hold the
tokens the library would build (library.service). When two entries share a recall key (two
deposits of one problem with different solutions, e.g. replicated from
elsewhere), the earliest added wins, deterministically.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvgraft.errors import NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.library.format import (
    KIND_CONTEXT,
    KIND_ENTRY,
    ChatModel,
    is_entry,
    normalize_question,
    tags_of,
)
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.trust_index import is_trusted


@dataclass(frozen=True)
class IndexedEntry:
    artifact_id: str
    fingerprint: bytes
    key: str  # problem-sha256
    problem_tokens: int
    num_tokens: int
    sequence: int
    created_unix_ms: int
    labels: dict[str, str]

    @property
    def tags(self) -> list[str]:
        return tags_of(self.labels)

    @property
    def question(self) -> str:
        """The problem as normalize_question leaves it."""
        return normalize_question(self.labels.get("problem", ""))

    def to_proto(self) -> pb.LibraryEntry:
        return pb.LibraryEntry(
            artifact_id=self.artifact_id,
            problem=self.labels.get("problem", ""),
            answer=self.labels.get("answer", ""),
            verified_by=self.labels.get("verified-by", ""),
            tags=self.tags,
            problem_tokens=self.problem_tokens,
            num_tokens=self.num_tokens,
            created_unix_ms=self.created_unix_ms,
            solution=self.labels.get("solution", ""),
        )


@dataclass(frozen=True)
class IndexedContext:
    artifact_id: str
    fingerprint: bytes
    tag: str
    key: str  # library-key
    sequence: int


class LibraryIndex:
    def __init__(self, store: Store, model: ChatModel, fingerprint: bytes) -> None:
        self._store = store
        self._model = model  # the served model's tokenizer: is an artifact an entry?
        self._fingerprint = fingerprint
        self._lock = threading.Lock()
        self._next_sequence = 1
        self._entries: dict[str, IndexedEntry] = {}  # by artifact id
        self._by_key: dict[tuple[bytes, str], set[str]] = {}  # (fingerprint, key) -> ids
        # (fingerprint, normalize_question(problem)) -> ids: recall of a rephrased question
        self._by_question: dict[tuple[bytes, str], set[str]] = {}
        self._contexts: dict[str, IndexedContext] = {}  # by artifact id

    def refresh(self) -> None:
        """Apply the change records added since the last refresh."""
        with self._lock:
            while records := self._store.changes_since(self._next_sequence):
                for record in records:
                    self._apply(record)
                self._next_sequence = records[-1].sequence + 1

    def _apply(self, record: pb.ChangeRecord) -> None:
        aid = record.artifact_id
        if record.kind == pb.ChangeRecord.KIND_DELETED:
            gone = self._entries.pop(aid, None)
            if gone is not None:
                self._by_key[(gone.fingerprint, gone.key)].discard(aid)
                self._by_question[(gone.fingerprint, gone.question)].discard(aid)
            self._contexts.pop(aid, None)
            return
        try:
            stored = self._store.get_record(aid)
        except NotFound:  # deleted later in the feed
            return
        manifest = stored.manifest()
        labels = dict(manifest.labels)
        kind = labels.get("kind")
        if kind == KIND_ENTRY and self._is_entry(manifest, labels):
            entry = self._entries[aid] = IndexedEntry(
                artifact_id=aid,
                fingerprint=manifest.model_fingerprint,
                key=labels.get("problem-sha256", ""),
                problem_tokens=int(labels["problem-tokens"]),
                num_tokens=len(manifest.token_ids),
                sequence=record.sequence,
                created_unix_ms=stored.created_unix_ms,
                labels=labels,
            )
            self._by_key.setdefault((entry.fingerprint, entry.key), set()).add(aid)
            self._by_question.setdefault((entry.fingerprint, entry.question), set()).add(aid)
        elif kind == KIND_CONTEXT:
            self._contexts[aid] = IndexedContext(
                artifact_id=aid,
                fingerprint=manifest.model_fingerprint,
                tag=labels.get("tag", ""),
                key=labels.get("library-key", ""),
                sequence=record.sequence,
            )

    def _is_entry(self, manifest: pb.Manifest, labels: dict[str, str]) -> bool:
        """An entry of the served model, exactly as LibraryAdd writes it (entries of another
        model are never served: its tokenizer is not here to check them)."""
        return manifest.model_fingerprint == self._fingerprint and is_entry(
            self._model, manifest.token_ids, labels
        )

    # ------------------------------------------------------------------
    def entries(self, fingerprint: bytes, tag: str = "") -> list[IndexedEntry]:
        """Entries of one model (and tag), ordered by artifact id."""
        with self._lock:
            found = [
                entry
                for entry in self._entries.values()
                if entry.fingerprint == fingerprint and (not tag or tag in entry.tags)
            ]
        return sorted(found, key=lambda entry: entry.artifact_id)

    def entry(self, artifact_id: str) -> IndexedEntry | None:
        with self._lock:
            return self._entries.get(artifact_id)

    def match(self, fingerprint: bytes, key: str) -> IndexedEntry | None:
        """The earliest-added entry of this model with this recall key."""
        return self._earliest(self._by_key, (fingerprint, key))

    def match_question(self, fingerprint: bytes, text: str) -> IndexedEntry | None:
        """The earliest-added entry of this model whose problem normalizes as `text` does."""
        return self._earliest(self._by_question, (fingerprint, normalize_question(text)))

    def _earliest(
        self, table: dict[tuple[bytes, str], set[str]], key: tuple[bytes, str]
    ) -> IndexedEntry | None:
        with self._lock:
            found = [self._entries[aid] for aid in table.get(key, ())]
        trusted = [entry for entry in found if self.trusted(entry.artifact_id)]
        return min(trusted, key=lambda entry: entry.sequence, default=None)

    def trusted(self, artifact_id: str) -> bool:
        """Only trusted entries and contexts are grafted: a forged one is never recalled."""
        return is_trusted(self._store.provenance(artifact_id))

    def contexts(self, fingerprint: bytes, tag: str) -> list[IndexedContext]:
        """Trusted library contexts of one model and tag, newest last."""
        with self._lock:
            found = [
                context
                for context in self._contexts.values()
                if context.fingerprint == fingerprint and context.tag == tag
            ]
        trusted = [context for context in found if self.trusted(context.artifact_id)]
        return sorted(trusted, key=lambda context: context.sequence)
