"""Usage errors of the `kvgraft` command line, run as the real command.

A command line the CLI refuses before it calls a daemon exits 2: the usage of the
command it was made in, then one line `kvgraft CMD: error: MESSAGE` on stderr, and
with --json the document {"error": {"code": "INVALID_ARGUMENT", "message"}} on
stdout. Each case was a traceback or an exit 1 "from the daemon" before (issue 31):
negative or non-numeric values, a missing prompt, contradictory decoding flags, text
that is not UTF-8, file arguments that are missing, directories or not UTF-8 text.
None of them reaches a daemon (the server given is a closed port). `kvgraft` alone
lists the commands, and every argument of every command has a help text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.cli.main import COMMANDS, TEXT_COMMANDS, build_parser

NOWHERE = "127.0.0.1:1"  # nothing listens: a usage error must not need a daemon


def kvgraft(*args: str | bytes) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", NOWHERE, *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=60,
        env=environment,
    )


def assert_usage_error(result: subprocess.CompletedProcess[str], command: str, message: str):
    """Exit 2, the command's usage first, the message as the last line, no traceback;
    the JSON document when --json was given (every case here gives it)."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"usage: kvgraft {command} "), result.stderr
    assert result.stderr.splitlines()[-1] == f"kvgraft {command}: error: {message}"
    assert "Traceback" not in result.stderr
    assert json.loads(result.stdout) == {"error": {"code": "INVALID_ARGUMENT", "message": message}}


@pytest.mark.parametrize(
    ("args", "command", "message"),
    [
        (
            ["generate", "--text", "x", "--max-new-tokens", "-3"],
            "generate",
            "argument --max-new-tokens: -3 is negative: give 0 or more",
        ),
        (
            ["ask", "--text", "x", "--max-new-tokens", "-1"],
            "ask",
            "argument --max-new-tokens: -1 is negative: give 0 or more",
        ),
        (
            ["graft", "abcdef12", "--text", "x", "--seed", "2e3"],
            "graft",
            "argument --seed: '2e3' is not a whole number",
        ),
        (
            ["generate", "--tokens", "1,a,3"],
            "generate",
            "argument --tokens: 'a' is not a whole number; token ids are whole numbers "
            "separated by commas, e.g. 1,2,3",
        ),
        (
            ["lookup", "--tokens", "1,4294967296"],
            "lookup",
            "argument --tokens: 4294967296 is too large: at most 4294967295; token ids are "
            "whole numbers separated by commas, e.g. 1,2,3",
        ),
        (
            ["generate", "--text", "x", "--temperature", "nan"],
            "generate",
            "argument --temperature: nan is not a temperature: give 0 (greedy) or a number "
            "from 0.0001 to 10000, e.g. 0.7",
        ),
        (  # Regression: 0 on the wire (a float32), which the daemon samples at 1.0
            ["generate", "--text", "x", "--temperature", "1e-46"],
            "generate",
            "argument --temperature: 1e-46 is not a temperature: give 0 (greedy) or a number "
            "from 0.0001 to 10000, e.g. 0.7",
        ),
        (  # Regression: the daemon's refusal, in its API's words ("leave greedy set"), exit 1
            ["graft", "abcdef12", "--text", "x", "--temperature", "0.00001"],
            "graft",
            "argument --temperature: 0.00001 is not a temperature: give 0 (greedy) or a number "
            "from 0.0001 to 10000, e.g. 0.7",
        ),
        (
            ["replicate", "--from", "a:1", "--to", "b:1", "--from-sequence", "-5"],
            "replicate",
            "argument --from-sequence: -5 is negative: give 0 or more",
        ),
        (
            ["replicate", "--from", "a:1", "--to", "b:1", "--workers", "0"],
            "replicate",
            "argument --workers: 0 is not enough: give 1 or more",
        ),
        (
            ["ls", "--timeout", "0"],
            "ls",
            "argument --timeout: 0 is not a duration: give seconds above 0",
        ),
        (["deposit", "--chat"], "deposit", "give the prompt: --text, --file or --tokens"),
        (
            ["verify"],
            "verify",
            "give an artifact id, or --untrusted to verify every untrusted one",
        ),
        (
            ["generate", "--text", "x", "--sample", "--temperature", "0"],
            "generate",
            "--sample with --temperature 0: a temperature of 0 is greedy decoding; leave out "
            "--sample, or give a temperature above 0",
        ),
        (
            ["generate", "--text", "x", "--seed", "3"],
            "generate",
            "--seed picks the samples: add --sample or --temperature T",
        ),
        (  # Regression: past the wire's uint64, protobuf's ValueError came as a traceback
            ["pin", "abcdef12", "--ttl", "999999999999999999999999999d"],
            "pin",
            "argument --ttl: '999999999999999999999999999d' is too long: a pin's TTL is at "
            "most 3650d",
        ),
        (  # Regression: the daemon's refusal named its API field ("Pin ttl_s is at most")
            ["pin", "abcdef12", "--ttl", "3651d"],
            "pin",
            "argument --ttl: '3651d' is too long: a pin's TTL is at most 3650d",
        ),
        (
            ["scrub", "--rate", "99999999999999999999TB"],
            "scrub",
            "argument --rate: '99999999999999999999TB' is too large: give e.g. 200MB or 1GiB",
        ),
        (
            ["pin", "abcdef12", "--off", "--ttl", "1h"],
            "pin",
            "--ttl goes with a pin: give --off or --ttl, not both",
        ),
        (["lookup", "--text", b"caf\xe9"], "lookup", "--text: the value is not UTF-8 text"),
        (["ls", "--label", b"team=\xff"], "ls", "--label: the value is not UTF-8 text"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_usage_errors_exit_2_with_the_commands_usage(args, command: str, message: str) -> None:
    assert_usage_error(kvgraft("--json", *args), command, message)


def test_file_arguments_are_checked_before_any_call(tmp_path: Path) -> None:
    """Regression: a prompt or library file that is not UTF-8 raised UnicodeDecodeError,
    `export -o DIR` fetched the artifact then raised IsADirectoryError."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Veltria est une île".encode("latin-1"))
    not_utf8 = f"{latin} is not UTF-8 text (at byte 16): give a text file"
    for command, extra in (
        ("deposit", []),
        ("generate", []),
        ("graft", ["abcdef12"]),
        ("lookup", []),
    ):
        result = kvgraft("--json", command, *extra, "--file", str(latin))
        assert_usage_error(result, command, not_utf8)
    assert_usage_error(
        kvgraft("--json", "library", "import", str(latin)), "library import", not_utf8
    )

    missing = tmp_path / "missing.txt"
    result = kvgraft("--json", "generate", "--file", str(missing))
    assert_usage_error(result, "generate", f"{missing} does not exist or is not a file")
    result = kvgraft("--json", "import", str(tmp_path))
    assert_usage_error(result, "import", f"{tmp_path} does not exist or is not a file")
    result = kvgraft("--json", "export", "abcdef12", "-o", str(tmp_path))
    message = f"{tmp_path} is a directory: give a file name, e.g. {tmp_path / 'NAME'}"
    assert_usage_error(result, "export", message)
    nowhere = tmp_path / "no-such-dir" / "out.safetensors"
    result = kvgraft("--json", "export", "abcdef12", "-o", str(nowhere))
    message = f"cannot write {nowhere}: {nowhere.parent} is not a directory"
    assert_usage_error(result, "export", message)

    # A file that is there but whose content is wrong is an error of the work: exit 1.
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10" + b"\0" * 7 + b"{}" + b" " * 14)
    result = kvgraft("import", str(corrupt))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"INVALID_ARGUMENT: {corrupt} is not a kvgraft-bundle/1 bundle" in result.stderr


def test_kvgraft_alone_lists_the_commands() -> None:
    """Regression: `kvgraft` alone said "the following arguments are required: COMMAND"
    and listed none."""
    result = kvgraft()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: kvgraft ")
    listed = {  # argparse indents the commands by 4, the lines of their help by more
        line.split()[0] for line in result.stderr.splitlines() if re.match(r"    \S", line)
    }
    assert listed == {"serve", *COMMANDS, *TEXT_COMMANDS}


def _parsers(parser: argparse.ArgumentParser, name: str = "kvgraft"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_has_help() -> None:
    """Regression: `rm`'s ids, `export`'s id and -o, `import`'s file had no help text."""
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in _parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not action.help
    ]
    assert missing == []
