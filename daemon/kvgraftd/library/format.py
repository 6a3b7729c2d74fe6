"""The knowledge library's formats: labels, recall key, chat rendering, answer cue.

A library entry is an ordinary artifact whose context is the chat prompt of
the problem and an open assistant turn holding the verified solution, then
the final-answer line repeated RECALL_REPEATS times:

    <chat prompt of the problem> <solution> "\n" ("Final answer: <answer>\n" x 8)

and whose manifest labels say what it is (all strings, since labels are a
map<string, string>):

    kind=library-entry        library-format=1
    problem, solution, answer the texts as deposited
    verified-by               who verified it (absent when nobody was named)
    tag:<name>=1              one label per tag, so `List` selects a tag exactly
    problem-tokens            how many leading tokens are the chat prompt of the problem
    problem-sha256            the recall key: SHA-256 of those tokens (problem_key)

An artifact is an entry only when its labels and tokens are exactly these for the
texts its labels name, and those texts pass LibraryAdd's checks (`is_entry`): labels
alone, which any Deposit may set, make nothing an entry. Recall is token-exact: the
question's chat prompt must equal the entry's first problem-tokens tokens. To make that
hold by construction, the entry is built by concatenating token ids (prompt ids + ids of
the assistant text), so its first tokens are exactly what the question tokenizes to,
whatever the tokenizer does at the boundary.

The answer cue is ANSWER_CUE ("Final answer:"), grafted right after the
entry: the model continues the periodic answer lines, so it copies the
verified answer and then a newline, and decoding stops at EOS, at any token
holding a newline, or after RECALL_MAX_NEW_TOKENS: answer tokens + 1. The
repetition is what makes the copy reliable on a small model. Measured on
SmolLM2-135M-Instruct (Q4_1), greedy, on generated problems (seeds 3, 7, 11,
none of them the test's or the bench's): one answer line behind the solution
and a cue opening a new assistant turn was read back 111 times in 120 (the
model re-solved the problem); the answer first, 112 in 120; one line repeated
once inside the turn, 105 in 120; three times, 479 in 480; eight times, 600
in 600.

A tag's library context is one artifact: a multi-turn conversation of all
the tag's entries (ordered by artifact id), each assistant turn in reasoning
order (the solution, then "Final answer: <answer>", what the model should
imitate on a new problem), labelled kind=library-context, tag=<name>,
library-key=SHA-256 of the sorted entry ids. The question is appended as the
next user turn plus the assistant-turn opening.

Nothing here computes or stores: kvgraftd.library.service does, with these formats.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from kvgraft.artifact import MAX_LABEL_VALUE_CHARS, MAX_LABELS
from kvgraft.errors import FailedPrecondition, InvalidArgument
from kvgraft.tenancy import content_labels

FORMAT_VERSION = "1"
KIND_ENTRY = "library-entry"
KIND_CONTEXT = "library-context"
TAG_PREFIX = "tag:"
ANSWER_CUE = "Final answer:"
ANSWER_LINE = ANSWER_CUE + " {answer}\n"
RECALL_REPEATS = 8
LIBRARY_TURN = "{solution}\n" + ANSWER_CUE + " {answer}"  # library context: reasoning first
RECALL_MAX_NEW_TOKENS = 16
# An entry's texts, verifier and tags are labels of its artifact: the label limits apply,
# and are checked before anything is computed.
MAX_TEXT_CHARS = MAX_LABEL_VALUE_CHARS
ENTRY_LABELS = 8  # kind, library-format, problem, solution, answer, problem-*, verified-by
MAX_TAGS = MAX_LABELS - ENTRY_LABELS
_TAG = re.compile(r"[A-Za-z0-9._-]{1,64}")
_FRAME = " \t\"'`*_.,;:!?()[]{}"


class ChatModel(Protocol):
    """What the formats need of kvgraftd.engine.model.model_adapter.ModelAdapter."""

    def encode(self, text: str, chat: bool = False, parse_special: bool = True) -> list[int]: ...
    def chat_tokens(
        self, messages: list[dict[str, str]], add_generation_prompt: bool
    ) -> list[int]: ...


# ----------------------------------------------------------------------
# validation and labels


def check_entry(
    problem: str, solution: str, answer: str, tags: Iterable[str], verified_by: str = ""
) -> list[str]:
    """Validate a deposit before anything is computed; returns its tags, sorted and unique."""
    for name, text in (("problem", problem), ("solution", solution), ("answer", answer)):
        if not text.strip():
            raise InvalidArgument(f"the {name} is empty: a library entry needs all three texts")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument(
                f"the {name} has {len(text)} characters, more than an entry holds "
                f"({MAX_TEXT_CHARS}); shorten it"
            )
    if len(verified_by) > MAX_TEXT_CHARS:
        raise InvalidArgument(
            f"verified_by has {len(verified_by)} characters, more than {MAX_TEXT_CHARS}; "
            "name who verified it in fewer"
        )
    if "\n" in answer.strip():
        raise InvalidArgument("the answer must be one line (it is read back in a few tokens)")
    unique = check_tags(tags)
    if len(unique) > MAX_TAGS:
        raise InvalidArgument(f"an entry takes at most {MAX_TAGS} tags, not {len(unique)}")
    return unique


def check_tags(tags: Iterable[str]) -> list[str]:
    unique = sorted(set(tags))
    bad = next((tag for tag in unique if not _TAG.fullmatch(tag)), None)
    if bad is not None:
        raise InvalidArgument(
            f"tag {bad!r} is not valid: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return unique


def problem_key(problem_ids: Sequence[int]) -> str:
    """The recall key: hex SHA-256 of the chat prompt's token ids (u32 little-endian)."""
    digest = hashlib.sha256(b"kvgraft-library-problem/1\0")
    digest.update(struct.pack(f"<{len(problem_ids)}I", *problem_ids))
    return digest.hexdigest()


def library_key(entry_ids: Iterable[str]) -> str:
    """Identity of a tag's library context: hex SHA-256 of its sorted entry ids."""
    return hashlib.sha256("\n".join(sorted(entry_ids)).encode()).hexdigest()


def entry_labels(
    problem: str,
    solution: str,
    answer: str,
    verified_by: str,
    tags: Sequence[str],
    problem_ids: Sequence[int],
) -> dict[str, str]:
    labels = {
        "kind": KIND_ENTRY,
        "library-format": FORMAT_VERSION,
        "problem": problem,
        "solution": solution,
        "answer": answer.strip(),
        "problem-tokens": str(len(problem_ids)),
        "problem-sha256": problem_key(problem_ids),
    }
    if verified_by:
        labels["verified-by"] = verified_by
    labels.update({TAG_PREFIX + tag: "1" for tag in tags})
    return labels


def is_entry(model: ChatModel, token_ids: Sequence[int], labels: Mapping[str, str]) -> bool:
    """Whether an artifact holding `token_ids` with `labels` is exactly what LibraryAdd
    writes for the problem, solution and answer its labels name: an entry is recognised
    by what the library writes, not by labels any caller can set (a Deposit labelled as
    an entry of a question, holding other tokens, would otherwise answer for it)."""
    if labels.get("kind") != KIND_ENTRY or not {"problem", "solution", "answer"} <= set(labels):
        return False
    problem, solution, answer = labels["problem"], labels["solution"], labels["answer"]
    verified_by = labels.get("verified-by", "")
    try:  # what LibraryAdd would refuse (a second answer line, bad tags) it never wrote
        check_entry(problem, solution, answer, tags_of(labels), verified_by)
    except InvalidArgument:
        return False
    problem_ids = problem_tokens(model, problem)
    expected = entry_labels(problem, solution, answer, verified_by, tags_of(labels), problem_ids)
    if content_labels(labels) != expected:  # whoever owns it (kvgraft.tenancy)
        return False
    return list(token_ids) == problem_ids + _text_tokens(model, entry_text(solution, answer))


def tags_of(labels: Mapping[str, str]) -> list[str]:
    return sorted(key[len(TAG_PREFIX) :] for key in labels if key.startswith(TAG_PREFIX))


def normalize_answer(text: str) -> str:
    """Compare answers without case, spacing, framing punctuation or a leading "the"."""
    words = text.strip().strip(_FRAME).lower().split()
    if len(words) > 1 and words[0] == "the":
        words = words[1:]
    return " ".join(words).replace(",", "") if _numeric(words) else " ".join(words)


def normalize_question(text: str) -> str:
    """A question as a person would call it the same: case, runs of whitespace, spacing
    around operators and final punctuation do not count ("what is 17+25" is "What is
    17 + 25?")."""
    text = " ".join(text.casefold().split())
    text = re.sub(r" ?([-+*/=^%<>×÷]) ?", r"\1", text)
    text = text.rstrip(" ?.;:")
    # a final "!" is punctuation, except after a digit, where it is a factorial (5!); by
    # hand, as a regex (?<!\d)!+$ takes time quadratic in the run of "!" (37 s for 100,000)
    bangs = len(text) - len(text.rstrip("!"))
    if bangs:
        factorial = text[: len(text) - bangs][-1:].isdigit()
        text = text[: len(text) - bangs + factorial]
    return text.rstrip(" ?.;:")


def _numeric(words: list[str]) -> bool:
    return len(words) == 1 and bool(re.fullmatch(r"-?[\d,]+(\.\d+)?", words[0]))


# ----------------------------------------------------------------------
# token sequences


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def entry_text(solution: str, answer: str) -> str:
    """The assistant text of an entry: the solution, then the answer line repeated."""
    return solution.strip() + "\n" + ANSWER_LINE.format(answer=answer.strip()) * RECALL_REPEATS


def library_turn(solution: str, answer: str) -> str:
    """An entry's assistant turn in a library context: the solution, then the answer."""
    return LIBRARY_TURN.format(answer=answer.strip(), solution=solution.strip())


def _extension(before: list[int], after: list[int]) -> list[int]:
    if after[: len(before)] != before:
        raise FailedPrecondition(
            "the model's chat template does not render a longer conversation as an extension "
            "of a shorter one; the knowledge library cannot serve this model"
        )
    return after[len(before) :]


def problem_tokens(model: ChatModel, problem: str) -> list[int]:
    """The chat prompt of a question (what Ask and the recall key use)."""
    return model.encode(problem, chat=True)


def entry_tokens(model: ChatModel, problem: str, solution: str, answer: str) -> list[int]:
    """The stored context of an entry; it starts with problem_tokens(problem)."""
    return problem_tokens(model, problem) + _text_tokens(model, entry_text(solution, answer))


def cue_tokens(model: ChatModel) -> list[int]:
    """The answer cue grafted after an entry: the next answer line's opening."""
    return model.encode(ANSWER_CUE)


def _conversation(entries: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for labels in entries:
        solution = library_turn(labels["solution"], labels["answer"])
        messages += [_user(labels["problem"]), _assistant(solution)]
    return messages


def library_tokens(model: ChatModel, entries: Sequence[Mapping[str, str]]) -> list[int]:
    """A tag's library context: all its entries (labels) as one conversation."""
    return model.chat_tokens(_conversation(entries), False)


def question_tokens(
    model: ChatModel, entries: Sequence[Mapping[str, str]], question: str
) -> list[int]:
    """The continuation after a library context: the question's user turn, then the
    assistant-turn opening."""
    messages = _conversation(entries)
    before = model.chat_tokens(messages, False)
    after = model.chat_tokens([*messages, _user(question)], True)
    return _extension(before, after)


def _text_tokens(model: ChatModel, text: str) -> list[int]:
    """An entry's solution and answer, the assistant's words: text, never control tokens."""
    return model.encode(text, parse_special=False)
