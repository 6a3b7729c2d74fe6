"""The text a stream sends: never half a character, never any part of a stop string."""

from __future__ import annotations

from kvgraftd.http.openai_responses import TextDeltas


def _decode(ids: list[int]) -> str:
    """A byte-level tokenizer: each token is one byte of UTF-8."""
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stops: list[str], final: str) -> list[str]:
    deltas = TextDeltas(_decode, stops)
    pieces = [deltas.add(byte) for byte in text.encode()]
    return [*pieces, deltas.rest(final)]


def test_characters_split_across_tokens_arrive_whole() -> None:
    pieces = _stream("né€", [], "né€")
    assert "".join(pieces) == "né€"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[:2] == ["n", ""]  # é's first byte alone shows nothing


def test_a_stop_string_is_never_sent() -> None:
    # the engine stops after the token that completes "STOP" and cuts the text before it
    pieces = _stream("abc STOP", ["STOP"], "abc ")
    assert "".join(pieces) == "abc "
    assert all("S" not in piece for piece in pieces)


def test_a_held_prefix_that_turns_out_not_to_stop_is_sent() -> None:
    pieces = _stream("a STAR b", ["STOP"], "a STAR b")
    assert "".join(pieces) == "a STAR b"
    assert pieces[2:4] == ["", ""]  # "S", then "ST", could begin STOP: held
    assert pieces[4] == "STA"  # "A" settles it
