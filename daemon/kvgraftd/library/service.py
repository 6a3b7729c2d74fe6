"""The knowledge library RPCs (LibraryAdd, LibraryList, LibraryRemove, Ask), independent of gRPC.

The seed's flywheel: a verified solution is deposited once as a KV artifact
(kvgraftd.library.format describes the context and its labels); a recurring
problem is then answered from it in a few decode tokens, and a tag's entries
grafted as context help the model on problems it has not seen. Everything
runs on the engine's public calls, so every answer is computed under the
exactness contract and comes with a receipt:

* LibraryAdd = Engine.generate(entry tokens, deposit=True, labels).
* Ask, recall path: the question's chat prompt tokens hash to an entry's
  recall key, or failing that the question equals an entry's problem once both
  are normalized (library_format.normalize_question: case, whitespace, spacing
  around operators, final punctuation); entries are only what LibraryAdd writes
  (library.index), so the entry's leading tokens are the question's ->
  Engine.graft(entry, answer cue), greedy, ending at EOS, at a token holding
  a newline, or after RECALL_MAX_NEW_TOKENS; the answer is compared with the
  entry's verified answer (normalized: case, spacing, framing punctuation).
* Ask, generate path: no entry matched (or no_recall), or the one that matched
  cannot be read (quarantined: DATA_LOSS would answer nothing; the log names it) ->
  Engine.generate(question prompt), which grafts any stored whole-page prefix.
* Ask, library path (library_tag; after no entry, as the generate path): the tag's
  library context is built once (Engine.generate with deposit; rebuilt when the
  tag's entries change, the stale one then deleted) and grafted; the question
  follows as a new user turn. A context counts only if it holds the tokens the
  library builds from the tag's entries. Those tokens, and which contexts were found
  to hold them, are kept by library key for the last LIBRARY_KEYS_KEPT keys (entry and
  artifact ids name immutable content), so a repeated Ask neither re-tokenizes the
  tag's entries nor reads a context's manifest again.

Wall time is perf_counter around the request; CPU seconds are
`time.process_time()` deltas, i.e. the whole daemon process (every thread):
a proxy for energy that also counts concurrent requests. Every library call
needs the model (the recall key is made of its tokens) and answers like the
engine RPCs while it loads or when there is none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgraft.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from kvgraft.tenancy import content_labels
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent
from kvgraftd.library import format as fmt
from kvgraftd.library.index import IndexedEntry, LibraryIndex

if TYPE_CHECKING:  # the engine imports torch; a store-only daemon never does
    from kvgraftd.engine.requests.engine import Engine
    from kvgraftd.engine.requests.service import EngineService

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 256
MAX_NEW_TOKENS = 4096
LIBRARY_KEYS_KEPT = 8  # libraries (tag x entries) whose tokens are kept, least recent out


@dataclass
class _Run:
    result: ResultEvent
    path: int
    entry: IndexedEntry | None = None
    library_id: str = ""
    built: bool = False


@dataclass
class _Library:
    """A library context's tokens for one set of entries (one library key, one model), and
    the artifacts found to hold them."""

    tokens: list[int]
    holders: set[str] = field(default_factory=set)  # changed under LibraryService._writes


class LibraryService:
    def __init__(self, engines: EngineService) -> None:
        self._engines = engines
        self._lock = threading.Lock()  # first use: builds the index
        self._index: LibraryIndex | None = None
        self._writes = threading.Lock()  # one LibraryAdd / library build at a time
        self._stop_ids: dict[bytes, frozenset[int]] = {}
        self._libraries: OrderedDict[tuple[bytes, str], _Library] = OrderedDict()  # _lock
        self.libraries_tokenized = 0  # library contexts' tokens built (the cache's misses)
        self.contexts_read = 0  # library contexts' manifests read to check their tokens

    def _ready(self) -> tuple[Engine, LibraryIndex]:
        engine = self._engines.engine()
        with self._lock:
            if self._index is None:
                self._index = LibraryIndex(engine.store, engine.adapter, engine.fingerprint)
            index = self._index
        index.refresh()
        return engine, index

    # ------------------------------------------------------------------
    def add(self, request: pb.LibraryAddRequest) -> pb.LibraryAddResponse:
        engine, index = self._ready()
        tags = fmt.check_entry(
            request.problem, request.solution, request.answer, request.tags, request.verified_by
        )
        model = engine.adapter
        problem_ids = fmt.problem_tokens(model, request.problem)
        context = fmt.entry_tokens(model, request.problem, request.solution, request.answer)
        labels = fmt.entry_labels(
            request.problem,
            request.solution,
            request.answer,
            request.verified_by,
            tags,
            problem_ids,
        )
        with self._writes:
            index.refresh()
            existing = index.match(engine.fingerprint, labels["problem-sha256"])
            if existing is not None:
                stored = engine.store.get_record(existing.artifact_id).manifest()
                if list(stored.token_ids) == context and content_labels(stored.labels) == labels:
                    return pb.LibraryAddResponse(entry=existing.to_proto(), already_present=True)
                raise FailedPrecondition(
                    f"the library already holds entry {existing.artifact_id[:16]} for this "
                    "problem, with another solution, answer, verifier or tags; remove it first "
                    f"(kvgraft library rm {existing.artifact_id[:16]})"
                )
            result = _last(engine.generate(context, DecodeOptions(deposit=True, labels=labels)))
            index.refresh()
        entry = index.entry(result.artifact_id)
        if entry is None:  # removed by someone else already
            raise NotFound(f"entry {result.artifact_id[:16]} was deleted as it was added")
        return pb.LibraryAddResponse(entry=entry.to_proto(), receipt=result.receipt)

    def list(self, request: pb.LibraryListRequest) -> pb.LibraryListResponse:
        engine, index = self._ready()
        if request.tag:
            fmt.check_tags([request.tag])
        entries = index.entries(engine.fingerprint, request.tag)
        return pb.LibraryListResponse(entries=[entry.to_proto() for entry in entries])

    def remove(self, request: pb.LibraryRemoveRequest) -> pb.LibraryRemoveResponse:
        engine, index = self._ready()
        full_id = engine.store.resolve(request.artifact_id)
        if index.entry(full_id) is None:
            raise InvalidArgument(
                f"artifact {full_id[:16]} is not a library entry; `kvgraft rm` deletes other "
                "artifacts"
            )
        freed, freed_bytes = engine.store.delete_artifact(full_id)
        index.refresh()
        return pb.LibraryRemoveResponse(
            artifact_id=full_id, pages_freed=freed, bytes_freed=freed_bytes
        )

    # ------------------------------------------------------------------
    def ask(self, request: pb.AskRequest) -> pb.AskResponse:
        wall, cpu = time.perf_counter(), time.process_time()
        engine, index = self._ready()
        if not request.text.strip():
            raise InvalidArgument("the question is empty: give the problem's text")
        if request.max_new_tokens > MAX_NEW_TOKENS:
            raise InvalidArgument(f"max_new_tokens is at most {MAX_NEW_TOKENS}")
        if request.library_tag:
            fmt.check_tags([request.library_tag])
        budget = request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self._engines.refuse_overlong_text(request.text, "question", chat=True)  # untokenized
        model = engine.adapter
        question = fmt.problem_tokens(model, request.text)
        if len(question) > engine.max_context_tokens:  # refused before any work on its text
            raise InvalidArgument(
                f"the question is {len(question)} tokens, more than max_context_tokens="
                f"{engine.max_context_tokens}; shorten it"
            )
        run = None
        if not request.no_recall:
            run = self._recall(engine, index, request.text, question, budget)
        if run is None and request.library_tag:
            run = self._with_library(engine, index, request.library_tag, request.text, budget)
        elif run is None:
            options = DecodeOptions(max_new_tokens=budget)
            run = _Run(_last(engine.generate(question, options)), pb.ASK_PATH_GENERATE)
        receipt = run.result.receipt
        generated = list(receipt.generated_token_ids)
        answer = _answer_text(engine, generated, run.path == pb.ASK_PATH_RECALL)
        response = pb.AskResponse(
            answer=answer,
            path=run.path,
            decode_tokens=len(generated),
            receipt=receipt,
            library_artifact_id=run.library_id,
            library_built=run.built,
        )
        if run.entry is not None:
            verified = run.entry.labels.get("answer", "")
            response.entry_id = run.entry.artifact_id
            response.verified_answer = verified
            response.matches_verified = fmt.normalize_answer(answer) == fmt.normalize_answer(
                verified
            )
        response.wall_s = time.perf_counter() - wall
        response.cpu_s = time.process_time() - cpu
        return response

    def _recall(
        self, engine: Engine, index: LibraryIndex, text: str, question: list[int], budget: int
    ) -> _Run | None:
        """The recall of the entry the question matches; None when none does, or when the
        one that does cannot be read (quarantined, or found damaged by this read): the
        question is then answered as if none matched, and the log says why."""
        entry = index.match(engine.fingerprint, fmt.problem_key(question))
        if entry is None:  # the same question in other words: case, spacing, "?"
            entry = index.match_question(engine.fingerprint, text)
        if entry is None:
            return None
        # An indexed entry starts with its problem's chat prompt (format.is_entry): the
        # question's, when their recall keys are equal; else it is recalled as its own.
        options = DecodeOptions(
            max_new_tokens=min(budget, fmt.RECALL_MAX_NEW_TOKENS),
            stop_token_ids=self._newline_ids(engine),
        )
        cue = fmt.cue_tokens(engine.adapter)
        try:
            result = _last(engine.graft(entry.artifact_id, cue, options))
        except DataLoss as exc:
            log.warning(
                "event=library_entry_unreadable entry=%s: %s; answered without it",
                entry.artifact_id[:16],
                exc,
            )
            return None
        return _Run(result, pb.ASK_PATH_RECALL, entry=entry)

    def _newline_ids(self, engine: Engine) -> frozenset[int]:
        """Tokens whose text holds a newline (computed once per model: ~0.2 s)."""
        found = self._stop_ids.get(engine.fingerprint)
        if found is None:
            vocab = engine.adapter.geometry.vocab_size
            found = frozenset(
                token for token in range(vocab) if "\n" in engine.adapter.decode([token])
            )
            self._stop_ids[engine.fingerprint] = found
        return found

    def _with_library(
        self, engine: Engine, index: LibraryIndex, tag: str, text: str, budget: int
    ) -> _Run:
        # only trusted entries' texts go into a context this daemon computes and vouches for
        entries = [
            e for e in index.entries(engine.fingerprint, tag) if index.trusted(e.artifact_id)
        ]
        if not entries:
            raise NotFound(
                f"the library has no entries tagged {tag!r} for this model "
                "(kvgraft library ls lists them; add some with kvgraft library add --tag)"
            )
        labels = [entry.labels for entry in entries]
        context_id, built = self._library_context(engine, index, tag, entries)
        continuation = fmt.question_tokens(engine.adapter, labels, text)
        options = DecodeOptions(max_new_tokens=budget)
        result = _last(engine.graft(context_id, continuation, options))
        return _Run(result, pb.ASK_PATH_LIBRARY, library_id=context_id, built=built)

    def _library_context(
        self, engine: Engine, index: LibraryIndex, tag: str, entries: list[IndexedEntry]
    ) -> tuple[str, bool]:
        """The id of the tag's library context, built first when missing or stale."""
        key = fmt.library_key(entry.artifact_id for entry in entries)
        library = self._library(engine, key, entries)
        tokens = library.tokens
        with self._writes:
            index.refresh()
            current = [
                c
                for c in index.contexts(engine.fingerprint, tag)
                if c.key == key and self._holds(engine, library, c.artifact_id)
            ]
            if current:
                return current[-1].artifact_id, False
            if len(tokens) > engine.max_context_tokens // 2:
                raise InvalidArgument(
                    f"the library of tag {tag!r} holds {len(tokens)} tokens, more than half the "
                    f"engine's max_context_tokens ({engine.max_context_tokens}); split it into "
                    "narrower tags"
                )
            labels = {
                "kind": fmt.KIND_CONTEXT,
                "library-format": fmt.FORMAT_VERSION,
                "tag": tag,
                "library-key": key,
                "entries": str(len(entries)),
            }
            result = _last(engine.generate(tokens, DecodeOptions(deposit=True, labels=labels)))
            library.holders.add(result.artifact_id)
            index.refresh()
            self._drop_stale(engine, index, tag, result.artifact_id)
        return result.artifact_id, True

    def _library(self, engine: Engine, key: str, entries: list[IndexedEntry]) -> _Library:
        """The library of `entries` (`key`: their ids), its tokens built on first use."""
        cached = (engine.fingerprint, key)
        with self._lock:
            library = self._libraries.get(cached)
            if library is not None:
                self._libraries.move_to_end(cached)
                return library
        # tokenized outside the lock: the entries' texts may be long
        library = _Library(fmt.library_tokens(engine.adapter, [e.labels for e in entries]))
        with self._lock:
            self.libraries_tokenized += 1
            library = self._libraries.setdefault(cached, library)  # a racing Ask's, if first
            while len(self._libraries) > LIBRARY_KEYS_KEPT:
                self._libraries.popitem(last=False)
        return library

    def _holds(self, engine: Engine, library: _Library, artifact_id: str) -> bool:
        """Whether a library context holds the tokens the library builds for its tag: its
        labels, which any Deposit may set, do not make it one. Called under _writes."""
        if artifact_id in library.holders:
            return True
        self.contexts_read += 1
        try:
            manifest = engine.store.get_record(artifact_id).manifest()
        except NotFound:  # deleted since the index saw it
            return False
        if list(manifest.token_ids) != library.tokens:
            return False
        library.holders.add(artifact_id)
        return True

    @staticmethod
    def _drop_stale(engine: Engine, index: LibraryIndex, tag: str, keep: str) -> None:
        """Delete the tag's older library contexts (pinned ones stay)."""
        for context in index.contexts(engine.fingerprint, tag):
            if context.artifact_id == keep:
                continue
            try:
                engine.store.delete_artifact(context.artifact_id)
            except (NotFound, FailedPrecondition):  # gone already, or pinned
                continue
        index.refresh()


def _last(events: Iterable) -> ResultEvent:
    result = None
    for event in events:
        result = event
    assert isinstance(result, ResultEvent), "an engine request ends with its result"
    return result


def _answer_text(engine: Engine, generated: list[int], first_line: bool) -> str:
    """The generated text without its end-of-sequence token, trimmed."""
    if generated and generated[-1] in engine.adapter.eos_token_ids:
        generated = generated[:-1]
    text = engine.adapter.decode(generated).strip()
    return text.split("\n", 1)[0].strip() if first_line else text
