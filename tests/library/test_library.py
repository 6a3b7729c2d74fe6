"""The knowledge library on the tiny seeded Llama, in-process, over a real LMDB store.

The tiny model has no tokenizer, so it is given a byte-level toy tokenizer with a
three-marker chat template (tests.support.toy_library): the library's text flows
(deposit, the token-exact recall key, the answer cue, library contexts) then run for
real, while what the random model answers is meaningless. What is checked: the index
(entries, recall key, tags, library contexts, deletes by any path, a rebuild from the
change feed), CRUD and its errors, which path Ask takes, that a recall is byte-identical
to a fresh replay (receipt hashes), stop tokens, and the formats. The real model's
answers are checked in test_library_real.py; what a forged entry or context gets, in
test_library_forgeries.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgraft.cli.library import read_jsonl
from kvgraft.errors import FailedPrecondition, InvalidArgument, NotFound
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions, ResultEvent
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.engine.requests.service import EngineService
from kvgraftd.library import format as fmt
from kvgraftd.library.service import LibraryService
from kvgraftd.store.artifact_store import Store
from tests.support.toy_library import add_entry, library_service, toy_engine


def test_add_stores_the_chat_context_with_labels(library: LibraryService, engine: Engine):
    response = add_entry(library, "What is six times seven?", verified_by="python", tags=["b", "a"])
    entry = response.entry
    assert not response.already_present
    assert entry.tags == ["a", "b"] and entry.verified_by == "python" and entry.answer == "42"
    manifest = engine.store.get_record(entry.artifact_id).manifest()
    problem_ids = engine.adapter.encode("What is six times seven?", chat=True)
    assert entry.problem_tokens == len(problem_ids)
    assert list(manifest.token_ids[: len(problem_ids)]) == problem_ids
    assert engine.adapter.decode(list(manifest.token_ids)) == (
        "<|u|>What is six times seven?<|e|>\n<|a|>Worked out: 42.\n" + "Final answer: 42\n" * 8
    )
    labels = dict(manifest.labels)
    assert labels["kind"] == "library-entry" and labels["verified-by"] == "python"
    assert labels["tag:a"] == labels["tag:b"] == "1"
    assert labels["problem-sha256"] == fmt.problem_key(problem_ids)
    assert response.receipt.computed_tokens == len(manifest.token_ids)
    # the same deposit again: nothing computed, the same entry
    again = add_entry(library, "What is six times seven?", verified_by="python", tags=["a", "b"])
    assert again.already_present and again.entry.artifact_id == entry.artifact_id
    # the same problem with another answer is refused until the first is removed
    with pytest.raises(FailedPrecondition, match="remove it first"):
        add_entry(library, "What is six times seven?", answer="43")


def test_add_validates_its_input(library: LibraryService) -> None:
    for kwargs, match in (
        ({"problem": " "}, "problem is empty"),
        ({"problem": "p", "answer": ""}, "answer is empty"),
        ({"problem": "p", "answer": "4\n2"}, "one line"),
        ({"problem": "p", "tags": ["no spaces"]}, "not valid"),
        ({"problem": "p", "tags": ["a,b"]}, "not valid"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            add_entry(library, **kwargs)
    assert library.list(pb.LibraryListRequest()).entries == []


def test_oversized_entries_are_refused_before_anything_is_computed(
    library: LibraryService, engine: Engine
) -> None:
    """Regression: a 4,100-character problem, a 5,000-character verifier or 60 tags were
    computed first, then refused with a message about labels the user never set."""
    computed = []
    generate = engine.generate
    engine.generate = lambda *a, **k: computed.append(a) or generate(*a, **k)  # type: ignore
    for kwargs, match in (
        ({"problem": "p" * 4100}, "the problem has 4100 characters, more than an entry holds"),
        ({"problem": "p", "solution": "s" * 5000}, "the solution has 5000 characters"),
        ({"problem": "p", "verified_by": "v" * 5000}, "verified_by has 5000 characters"),
        ({"problem": "p", "tags": [f"t{i}" for i in range(60)]}, "at most 56 tags, not 60"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            add_entry(library, **kwargs)
    assert computed == [] and library.list(pb.LibraryListRequest()).entries == []
    assert add_entry(library, "p" * 4096, tags=[f"t{i}" for i in range(56)]).entry.num_tokens > 0


def test_ask_recalls_a_token_exact_entry_and_matches_a_fresh_replay(
    library: LibraryService, engine: Engine
) -> None:
    entry = add_entry(library, "Capital of Zorvania?", answer="Quelth").entry
    response = library.ask(pb.AskRequest(text="Capital of Zorvania?", max_new_tokens=64))
    assert response.path == pb.ASK_PATH_RECALL
    assert response.entry_id == entry.artifact_id and response.verified_answer == "Quelth"
    cue = fmt.cue_tokens(engine.adapter)
    receipt = response.receipt
    assert receipt.grafted_artifact_id == entry.artifact_id
    assert receipt.reused_tokens == entry.num_tokens
    assert receipt.computed_tokens == len(cue) + response.decode_tokens
    assert 1 <= response.decode_tokens <= fmt.RECALL_MAX_NEW_TOKENS
    assert response.matches_verified == (
        fmt.normalize_answer(response.answer) == fmt.normalize_answer("Quelth")
    )
    assert response.wall_s > 0 and response.cpu_s >= 0
    # the recall is the graft of a whole artifact: a replay from nothing gives the same bits
    options = DecodeOptions(
        max_new_tokens=len(receipt.generated_token_ids),
        no_cache=True,
        stop_token_ids=library._newline_ids(engine),
    )
    fresh = [e for e in engine.graft(entry.artifact_id, cue, options) if isinstance(e, ResultEvent)]
    for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
        assert getattr(fresh[0].receipt, name) == getattr(receipt, name), name
    assert list(fresh[0].receipt.generated_token_ids) == list(receipt.generated_token_ids)


def test_ask_recalls_the_same_question_in_other_words(library: LibraryService) -> None:
    """Regression: `what is 17+25?` for an entry `What is 17 + 25?` fell back to generation
    without a word. Case, whitespace, spacing around operators and final punctuation do not
    count; the recall is the entry's own, byte for byte."""
    entry = add_entry(library, "What is 17 + 25?", answer="42").entry
    exact = library.ask(pb.AskRequest(text="What is 17 + 25?", max_new_tokens=8))
    assert exact.path == pb.ASK_PATH_RECALL and exact.entry_id == entry.artifact_id
    for text in ("what is 17+25?", "WHAT  IS 17 +25", " What is 17 + 25 ? ", "what is 17 + 25."):
        response = library.ask(pb.AskRequest(text=text, max_new_tokens=8))
        assert response.path == pb.ASK_PATH_RECALL, text
        assert response.entry_id == entry.artifact_id and response.verified_answer == "42"
        assert response.receipt == exact.receipt, text  # the same graft: the same receipt


def test_ask_generates_when_no_entry_matches_and_says_so(library: LibraryService) -> None:
    add_entry(library, "Capital of Zorvania?", answer="Quelth")
    for text in ("Capital of Zorvania city?", "Capitals of Zorvania?", "Zorvania capital?"):
        response = library.ask(pb.AskRequest(text=text, max_new_tokens=3))
        assert response.path == pb.ASK_PATH_GENERATE, text
        assert response.entry_id == "" and not response.matches_verified
        assert response.decode_tokens == len(response.receipt.generated_token_ids) <= 3
    no_recall = library.ask(
        pb.AskRequest(text="Capital of Zorvania?", max_new_tokens=2, no_recall=True)
    )
    assert no_recall.path == pb.ASK_PATH_GENERATE and no_recall.decode_tokens <= 2
    with pytest.raises(InvalidArgument, match="empty"):
        library.ask(pb.AskRequest(text="  "))


@pytest.mark.parametrize(
    ("asked", "stored"),
    [
        ("what is 17+25?", "What is 17 + 25?"),
        ("  Capital   of\tZorvania ", "Capital of Zorvania?"),
        ("3 * 4 = ?", "3*4="),
        ("is 2<3.", "Is 2 < 3?"),
        ("Capital of Zorvania!", "capital of zorvania?"),
    ],
)
def test_question_normalisation(asked: str, stored: str) -> None:
    assert fmt.normalize_question(asked) == fmt.normalize_question(stored)


def test_question_normalisation_keeps_words_and_numbers() -> None:
    assert fmt.normalize_question("What is 17 + 25?") != fmt.normalize_question("What is 17+26?")
    assert fmt.normalize_question("a b") != fmt.normalize_question("ab")
    assert fmt.normalize_question("What is 5!") != fmt.normalize_question("What is 5?")


def test_list_by_tag_and_remove(library: LibraryService, engine: Engine) -> None:
    ids = {
        name: add_entry(library, f"Problem {name}?", tags=tags).entry.artifact_id
        for name, tags in (("one", ["x"]), ("two", ["x", "y"]), ("three", []))
    }
    listed = library.list(pb.LibraryListRequest()).entries
    assert [e.artifact_id for e in listed] == sorted(ids.values())
    assert {e.artifact_id for e in library.list(pb.LibraryListRequest(tag="x")).entries} == {
        ids["one"],
        ids["two"],
    }
    assert [e.artifact_id for e in library.list(pb.LibraryListRequest(tag="y")).entries] == [
        ids["two"]
    ]
    removed = library.remove(pb.LibraryRemoveRequest(artifact_id=ids["one"][:12]))
    assert removed.artifact_id == ids["one"] and removed.pages_freed > 0
    assert library.ask(pb.AskRequest(text="Problem one?", max_new_tokens=1)).path == (
        pb.ASK_PATH_GENERATE
    )
    with pytest.raises(NotFound):
        library.remove(pb.LibraryRemoveRequest(artifact_id=ids["one"]))
    plain = [e for e in engine.generate([5, 6, 7], DecodeOptions(deposit=True))][-1]
    with pytest.raises(InvalidArgument, match="not a library entry"):
        library.remove(pb.LibraryRemoveRequest(artifact_id=plain.artifact_id))
    # a delete by another path (kvgraft rm) leaves the index too
    engine.store.delete_artifact(ids["two"])
    assert [e.artifact_id for e in library.list(pb.LibraryListRequest()).entries] == [ids["three"]]


def test_index_is_rebuilt_from_the_change_feed(library: LibraryService, engine: Engine) -> None:
    kept = add_entry(library, "Kept?", tags=["t"]).entry.artifact_id
    gone = add_entry(library, "Gone?").entry.artifact_id
    library.remove(pb.LibraryRemoveRequest(artifact_id=gone))
    # an entry deposited by the plain Deposit path with the library's labels counts too
    problem_ids = fmt.problem_tokens(engine.adapter, "Deposited?")
    labels = fmt.entry_labels("Deposited?", "s", "7", "", ["t"], problem_ids)
    tokens = fmt.entry_tokens(engine.adapter, "Deposited?", "s", "7")
    deposited = list(engine.generate(tokens, DecodeOptions(deposit=True, labels=labels)))[-1]
    restarted = library_service(engine)  # a new daemon on the same store
    found = [e.artifact_id for e in restarted.list(pb.LibraryListRequest(tag="t")).entries]
    assert found == sorted([kept, deposited.artifact_id])
    assert restarted.ask(pb.AskRequest(text="Deposited?")).entry_id == deposited.artifact_id


def test_library_context_is_built_once_and_rebuilt_when_the_tag_changes(
    library: LibraryService, engine: Engine
) -> None:
    for n in range(3):
        add_entry(library, f"Fact {n}?", answer=f"A{n}", tags=["facts"])
    add_entry(library, "Other?", tags=["other"])
    with pytest.raises(NotFound, match="no entries tagged"):
        library.ask(pb.AskRequest(text="q", library_tag="none"))
    first = library.ask(pb.AskRequest(text="New question?", library_tag="facts", max_new_tokens=2))
    assert first.path == pb.ASK_PATH_LIBRARY and first.library_built
    context = engine.store.get_record(first.library_artifact_id).manifest()
    entries = [e.labels for e in library._index.entries(engine.fingerprint, "facts")]
    assert list(context.token_ids) == fmt.library_tokens(engine.adapter, entries)
    assert dict(context.labels)["entries"] == "3"
    assert first.receipt.reused_tokens == len(context.token_ids)
    question = fmt.question_tokens(engine.adapter, entries, "New question?")
    assert first.receipt.computed_tokens == len(question) + first.decode_tokens
    second = library.ask(pb.AskRequest(text="Another?", library_tag="facts", max_new_tokens=2))
    assert not second.library_built
    assert second.library_artifact_id == first.library_artifact_id
    # a recall still wins for a token-exact question
    assert library.ask(pb.AskRequest(text="Fact 1?", library_tag="facts")).path == (
        pb.ASK_PATH_RECALL
    )
    add_entry(library, "Fact 3?", tags=["facts"])
    third = library.ask(pb.AskRequest(text="Another?", library_tag="facts", max_new_tokens=2))
    assert third.library_built and third.library_artifact_id != first.library_artifact_id
    with pytest.raises(NotFound):  # the stale context was deleted
        engine.store.get_record(first.library_artifact_id)


def test_stop_tokens_end_decoding_and_are_counted(engine: Engine) -> None:
    prompt = list(range(10, 30))
    free = list(engine.generate(prompt, DecodeOptions(max_new_tokens=6)))[-1]
    tokens = list(free.receipt.generated_token_ids)
    stopped = list(
        engine.generate(
            prompt, DecodeOptions(max_new_tokens=6, stop_token_ids=frozenset({tokens[2]}))
        )
    )[-1]
    end = tokens.index(tokens[2]) + 1
    assert list(stopped.receipt.generated_token_ids) == tokens[:end]


def test_library_calls_need_the_model() -> None:
    library = LibraryService(EngineService(None))
    with pytest.raises(FailedPrecondition, match="without a model"):
        library.list(pb.LibraryListRequest())


def test_models_without_a_chat_template_are_refused(store: Store) -> None:
    bare = ModelAdapter.load("tiny:0", Path("/nonexistent"))
    library = library_service(toy_engine(bare, store))
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        add_entry(library, "p")


@pytest.mark.parametrize(
    ("given", "stored", "same"),
    [
        ("286", "286", True),
        (" 286.", "286", True),
        ("1,250", "1250", True),
        ("Quelmar", "quelmar", True),
        ("the fidou", "fidou", True),
        ("**Foumu**", "Foumu", True),
        ("14.5", "14.5", True),
        ("14.5", "145", False),
        ("286 loaves", "286", False),
        ("", "0", False),
    ],
)
def test_answers_are_compared_normalized(given: str, stored: str, same: bool) -> None:
    assert (fmt.normalize_answer(given) == fmt.normalize_answer(stored)) == same


def test_jsonl_import_is_checked_line_by_line(tmp_path: Path) -> None:
    good = {"problem": "p", "solution": "s", "answer": 42, "tags": "t", "verified_by": "me"}
    path = tmp_path / "lib.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "tags": ["u"]}) + "\n")
    entries = read_jsonl(path, ["extra"], "default")
    assert entries == [
        {
            "problem": "p",
            "solution": "s",
            "answer": "42",
            "tags": ["extra", "t"],
            "verified_by": "me",
        },
        {
            "problem": "p",
            "solution": "s",
            "answer": "42",
            "tags": ["extra", "u"],
            "verified_by": "me",
        },
    ]
    for line, match in (
        ("{not json", ":1: not JSON"),
        ("[1]", ":1: expected an object"),
        (json.dumps({**good, "answer": ""}), ":1: 'answer'"),
        (json.dumps({**good, "tags": [1]}), ":1: 'tags'"),
        # Regression: JSON's lone-surrogate escapes raised UnicodeEncodeError (a traceback)
        (json.dumps({**good, "problem": "p\ud800"}), ":1: 'problem' is not UTF-8 text"),
        (json.dumps({**good, "tags": ["t", "\udfff"]}), ":1: 'tags' is not UTF-8 text"),
        (json.dumps({**good, "verified_by": "\ud83d"}), ":1: 'verified_by' is not UTF-8"),
    ):
        path.write_text(line + "\n")
        with pytest.raises(InvalidArgument, match=match):
            read_jsonl(path, [], "")


def test_a_repeated_library_ask_neither_tokenizes_nor_reads_again(
    library: LibraryService, engine: Engine
) -> None:
    """Was: every Ask with a tag re-tokenized all of the tag's entries and read each candidate
    context's manifest. They are kept by library key: a new entry makes a new one."""
    for n in range(2):
        add_entry(library, f"Fact {n}?", answer=f"A{n}", tags=["facts"])
    first = library.ask(pb.AskRequest(text="New question?", library_tag="facts", max_new_tokens=2))
    assert first.library_built
    assert (library.libraries_tokenized, library.contexts_read) == (1, 0)  # built, not read
    for question in ("Another?", "And another?"):
        again = library.ask(pb.AskRequest(text=question, library_tag="facts", max_new_tokens=2))
        assert again.library_artifact_id == first.library_artifact_id
        assert not again.library_built
    assert (library.libraries_tokenized, library.contexts_read) == (1, 0)
    fresh = library_service(engine)  # a restart: the store's context, read
    fresh.ask(pb.AskRequest(text="Another?", library_tag="facts", max_new_tokens=2))
    fresh.ask(pb.AskRequest(text="And another?", library_tag="facts", max_new_tokens=2))
    assert (fresh.libraries_tokenized, fresh.contexts_read) == (1, 1)
    add_entry(library, "Fact 2?", answer="A2", tags=["facts"])
    third = library.ask(pb.AskRequest(text="Another?", library_tag="facts", max_new_tokens=2))
    assert third.library_built and library.libraries_tokenized == 2
