"""What a forged library entry or context gets: nothing. On the tiny seeded Llama with the toy
tokenizer (tests.support.toy_library), in-process, over a real store. An entry is what
LibraryAdd wrote (its labels and its tokens), never what an upload or a Deposit labels
itself; a library context counts only when it holds the tokens the library builds; an
entry a read or a scrub quarantined is answered around, not with DATA_LOSS."""

from __future__ import annotations

import pytest

from kvgraft import Artifact
from kvgraft.artifact import page_sizes
from kvgraft.errors import InvalidArgument
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.decoding import DecodeOptions
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.library import format as fmt
from kvgraftd.library.service import LibraryService
from kvgraftd.store.page_records import page_records_of
from tests.support.toy_library import add_entry


def test_a_forged_entry_is_never_recalled(library: LibraryService, engine: Engine) -> None:
    """An uploaded entry (untrusted: nothing vouches for its KV) with the labels of a real
    one and pages of zeros is stored, but Ask never recalls it."""
    entry = add_entry(library, "What is 17 + 25?", answer="42").entry
    genuine = engine.store.get_record(entry.artifact_id).manifest()
    pages = {digest: bytes(size) for digest, size in page_sizes(genuine).items()}
    forged = Artifact.build(
        model_fingerprint=genuine.model_fingerprint,
        layout=genuine.layout,
        profile=genuine.profile,
        token_ids=genuine.token_ids,
        page_bytes=[pages[digest] for digest in genuine.page_sha256],
        segment_ends=genuine.segment_ends,
        labels=dict(genuine.labels),
    )
    library.remove(pb.LibraryRemoveRequest(artifact_id=entry.artifact_id))
    engine.store.commit_artifact(forged.manifest, page_records_of(forged.pages))  # untrusted
    response = library.ask(pb.AskRequest(text="What is 17 + 25?", max_new_tokens=2))
    assert response.path == pb.ASK_PATH_GENERATE and response.entry_id == ""
    assert response.receipt.reused_tokens == 0


@pytest.mark.parametrize("held", ["other tokens", "another answer"])
def test_a_deposit_labelled_as_an_entry_does_not_answer_for_it(
    library: LibraryService, engine: Engine, held: str
) -> None:
    """Was: one Deposit with the library's labels for a question (computed, so trusted)
    made every Ask of it FAILED_PRECONDITION ("does not hold its tokens") and LibraryAdd
    refuse it; with the question's prompt and another answer it was recalled. An entry
    is what LibraryAdd writes (its labels and tokens), not what its labels say."""
    question = "What is 17 + 25?"
    labels = fmt.entry_labels(
        question, "Worked out: 42.", "42", "", [], fmt.problem_tokens(engine.adapter, question)
    )
    tokens = {
        "other tokens": list(range(40, 60)),
        "another answer": fmt.entry_tokens(engine.adapter, question, "Worked out: 41.", "41"),
    }[held]
    forged = list(engine.generate(tokens, DecodeOptions(deposit=True, labels=labels)))[-1]
    assert engine.store.provenance(forged.artifact_id).trust == pb.Provenance.TRUST_COMPUTED
    asked = library.ask(pb.AskRequest(text=question, max_new_tokens=2))
    assert asked.path == pb.ASK_PATH_GENERATE and asked.entry_id == ""
    assert library.list(pb.LibraryListRequest()).entries == []
    with pytest.raises(InvalidArgument, match="not a library entry"):
        library.remove(pb.LibraryRemoveRequest(artifact_id=forged.artifact_id))
    entry = add_entry(library, question, answer="42").entry  # not "already holds an entry"
    assert entry.artifact_id != forged.artifact_id
    recalled = library.ask(pb.AskRequest(text=question, max_new_tokens=8))
    assert recalled.path == pb.ASK_PATH_RECALL and recalled.entry_id == entry.artifact_id


REFUSED_BY_LIBRARY_ADD = {  # (solution, answer, tags): each InvalidArgument in LibraryAdd
    "a second answer line": ("Worked out: 42.", "42\nor 41", []),
    "an empty solution": (" ", "42", []),
    "an invalid tag": ("Worked out: 42.", "42", ["not a tag!"]),
    "too many tags": ("Worked out: 42.", "42", [f"t{n}" for n in range(fmt.MAX_TAGS + 1)]),
}


@pytest.mark.parametrize("refused", sorted(REFUSED_BY_LIBRARY_ADD))
def test_a_deposit_of_what_library_add_refuses_is_no_entry(
    library: LibraryService, engine: Engine, refused: str
) -> None:
    """Was: a Deposit holding exactly an entry's labels and tokens for texts LibraryAdd
    refuses (check_entry) was indexed as an entry: listed, and recalled for its question.
    An entry is only what LibraryAdd could have written."""
    question = "What is 17 + 25?"
    solution, answer, tags = REFUSED_BY_LIBRARY_ADD[refused]
    with pytest.raises(InvalidArgument):
        fmt.check_entry(question, solution, answer, tags)
    problem_ids = fmt.problem_tokens(engine.adapter, question)
    labels = fmt.entry_labels(question, solution, answer, "", tags, problem_ids)
    tokens = fmt.entry_tokens(engine.adapter, question, solution, answer)
    list(engine.generate(tokens, DecodeOptions(deposit=True, labels=labels)))
    assert library.list(pb.LibraryListRequest()).entries == []
    asked = library.ask(pb.AskRequest(text=question, max_new_tokens=2))
    assert asked.path == pb.ASK_PATH_GENERATE and asked.entry_id == ""


def test_a_deposit_labelled_as_a_library_context_is_not_grafted(
    library: LibraryService, engine: Engine
) -> None:
    """Was: a Deposit labelled as the tag's current library context (its key is the hash
    of the entry ids, which anyone can list) was grafted before every question of that
    tag. A context counts only when it holds the tokens the library builds."""
    ids = [
        add_entry(library, f"Fact {n}?", answer=f"A{n}", tags=["facts"]).entry.artifact_id
        for n in (1, 2)
    ]
    labels = {
        "kind": fmt.KIND_CONTEXT,
        "library-format": fmt.FORMAT_VERSION,
        "tag": "facts",
        "library-key": fmt.library_key(ids),
        "entries": "2",
    }
    forged = list(engine.generate(list(range(40, 60)), DecodeOptions(deposit=True, labels=labels)))
    asked = library.ask(pb.AskRequest(text="New question?", library_tag="facts", max_new_tokens=2))
    assert asked.path == pb.ASK_PATH_LIBRARY and asked.library_built
    assert asked.library_artifact_id != forged[-1].artifact_id
    context = engine.store.get_record(asked.library_artifact_id).manifest()
    entries = [e.labels for e in library._index.entries(engine.fingerprint, "facts")]
    assert list(context.token_ids) == fmt.library_tokens(engine.adapter, entries)


def test_ask_answers_without_a_quarantined_entry(library: LibraryService, engine: Engine):
    """Was: DATA_LOSS for every Ask of a question whose entry a scrub or a read had
    quarantined. The question is answered as if no entry matched (the log says why)."""
    entry = add_entry(library, "Capital of Zorvania?", answer="Quelth", tags=["geo"]).entry
    add_entry(library, "Capital of Quelthia?", answer="Zorv", tags=["geo"])
    manifest = engine.store.get_record(entry.artifact_id).manifest()
    assert engine.store.quarantine([manifest.page_sha256[-1]]) == [entry.artifact_id]
    fresh = library.ask(
        pb.AskRequest(text="Capital of Zorvania?", max_new_tokens=3, no_recall=True)
    )
    asked = library.ask(pb.AskRequest(text="Capital of Zorvania?", max_new_tokens=3))
    assert asked.path == pb.ASK_PATH_GENERATE and asked.entry_id == ""
    assert asked.receipt == fresh.receipt  # what the generate path answers
    tagged = library.ask(
        pb.AskRequest(text="capital of zorvania", library_tag="geo", max_new_tokens=2)
    )
    assert tagged.path == pb.ASK_PATH_LIBRARY and tagged.entry_id == ""
