"""What the `kvgraft` command line accepts: its parser, the kinds of value its flags take,
the files it reads and writes, and its usage errors.

A usage error is a command line refused before any daemon is called: a value of the
wrong kind (`--max-new-tokens -3`, `--tokens 1,a,3`), a missing or contradictory
option, text that is not UTF-8, a file argument that names no file of the kind the
command needs (missing, a directory, not UTF-8 text). `UsageError` carries it to
kvgraft.cli.main, which prints the usage of the command it was made in and one line
saying what to change, and exits 2 (with --json, one JSON document too). What goes
wrong while the work is done (the daemon's errors, a bundle whose bytes are not a
bundle, a file that cannot be written) is a kvgraft.errors class and exits 1.

Integers are bounded by the wire's types (uint32 counts and token ids, uint64
seeds), so protobuf never sees a value it would refuse with a traceback.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import NoReturn

from kvgraft.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_TOP_LOGPROBS = 20  # the daemon's bound on GenerateOptions.top_logprobs


class UsageError(Exception):
    """A command line the CLI refuses; `parser` is the (sub)command it was made in, when
    known (kvgraft.cli.main falls back to the command being run)."""

    def __init__(self, message: str, parser: argparse.ArgumentParser | None = None) -> None:
        super().__init__(message)
        self.parser = parser


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are raised as UsageError rather than printed on
    the spot, so one place reports every usage error alike (JSON with --json)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self)


def _whole_number(text: str, most: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    if value > most:
        raise argparse.ArgumentTypeError(f"{value} is too large: at most {most}")
    return value


def uint32(text: str) -> int:
    """A count sent as a uint32 (tokens to generate): 0 or more."""
    return _whole_number(text, UINT32_MAX)


def uint64(text: str) -> int:
    """A number sent as a uint64 (a sampling seed, a feed sequence): 0 or more."""
    return _whole_number(text, UINT64_MAX)


def positive(text: str) -> int:
    """A count of at least 1 (workers, ...)."""
    value = _whole_number(text, UINT32_MAX)
    if value == 0:
        raise argparse.ArgumentTypeError("0 is not enough: give 1 or more")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy decoding), or one the daemon samples at
    (MIN_TEMPERATURE..MAX_TEMPERATURE: below, a temperature rounds to 0 on the wire and
    would sample at 1.0; outside, the daemon refuses it in its API's words)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:  # nan too
        raise argparse.ArgumentTypeError(
            f"{text} is not a temperature: give 0 (greedy) or a number from "
            f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}, e.g. 0.7"
        )
    return value


def top_p(text: str) -> float:
    """A nucleus mass: above 0, at most 1 (1 keeps every token)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:  # nan too
        raise argparse.ArgumentTypeError(
            f"{text} is not a top-p: give a number above 0 and at most 1, e.g. 0.9"
        )
    return value


def logprob_alternatives(text: str) -> int:
    """How many likeliest alternatives to show per token: 0 to MAX_TOP_LOGPROBS."""
    return _whole_number(text, MAX_TOP_LOGPROBS)


def seconds(text: str) -> float:
    """A duration in seconds, above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a duration: give seconds above 0")
    return value


def token_ids(text: str) -> list[int]:
    """Token ids separated by commas (or spaces): "1,2,3"."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("give at least one token id, e.g. 1,2,3")
    ids = []
    for part in parts:
        try:
            ids.append(_whole_number(part, UINT32_MAX))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"{exc}; token ids are whole numbers separated by commas, e.g. 1,2,3"
            ) from None
    return ids


def read_text(path: Path) -> str:
    """The text of a file argument; UsageError unless it names a readable UTF-8 text file."""
    if not path.is_file():
        raise UsageError(f"{path} does not exist or is not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{path} is not UTF-8 text (at byte {exc.start}): give a text file"
        ) from None


def existing_file(path: Path) -> Path:
    """A file argument read by the client library (a bundle): it must be a file."""
    if not path.is_file():
        raise UsageError(f"{path} does not exist or is not a file")
    return path


def output_file(path: Path) -> Path:
    """A file to write: not a directory, in a directory that exists (checked before any
    work, so nothing is fetched for nothing)."""
    if path.is_dir():
        raise UsageError(f"{path} is a directory: give a file name, e.g. {path / 'NAME'}")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {path}: {path.parent} is not a directory")
    return path


def check_text_values(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """UsageError for any text value that is not UTF-8 (bytes the shell passed through:
    Python keeps them as surrogates, which no protobuf string may carry). Paths may be
    any bytes: the file system takes them as they are."""
    names = {action.dest: action for action in parser._actions}
    for dest, value in vars(args).items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and not is_utf8(item):
                action = names.get(dest)
                flag = (action.option_strings or [action.metavar or dest])[-1] if action else dest
                raise UsageError(f"{flag}: the value is not UTF-8 text", parser)


def is_utf8(text: str) -> bool:
    """Whether `text` can be sent: no lone surrogate (what undecodable bytes become)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
