"""The `kvgraft` command line, run as a subprocess against a real daemon.

Each command (info, ls, stat, rm, pin, export, import) is checked twice:
with --json (the document is parsed and its fields compared exactly with
what the daemon stores) and as plain text (which must name the artifact).
The server comes from --server or $KVGRAFT_SERVER. Errors exit 1 with the
gRPC status code in the JSON document and a message on stderr; an
unreachable daemon tells the user how to start one; `kvgraft serve` runs
the daemon itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvgraft import Artifact, Client, __version__
from kvgraft.artifact import page_sizes
from kvgraft.cli.main import build_parser
from kvgraft.page_buffers import block_aligned
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from tests.support.factory import random_artifact
from tests.support.ports import closed_address


def kvgraft(*args: str, server: str | None = None, env: dict[str, str] | None = None):
    """Run `python -m kvgraft [--server S] ARGS` and return the finished process."""
    command = [sys.executable, "-m", "kvgraft"]
    if server is not None:
        command += ["--server", server]
    # neither the caller's daemon nor its terminal's width (ls fits $COLUMNS)
    environment = {k: v for k, v in os.environ.items() if k not in ("KVGRAFT_SERVER", "COLUMNS")}
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environment, **(env or {})},
    )


def kvgraft_json(*args: str, server: str | None = None, env: dict[str, str] | None = None):
    result = kvgraft("--json", *args, server=server, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _artifact(rng: random.Random, **labels: str) -> Artifact:
    return random_artifact(
        rng,
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        kv_dtype=pb.KV_DTYPE_FLOAT16,
        page_tokens=16,
        tokens=40,
        labels=labels,
    )


def _page_bytes(artifact: Artifact) -> int:
    """Bytes of every page entry, shared ones included (ArtifactInfo.page_bytes)."""
    sizes = page_sizes(artifact.manifest)
    return sum(sizes[d] for d in artifact.manifest.page_sha256)


# ----------------------------------------------------------------------


def test_info_from_the_environment_variable(daemon: DaemonProcess, client: Client, rng) -> None:
    artifact = _artifact(rng)
    client.put_artifact(artifact)
    env = {"KVGRAFT_SERVER": daemon.address}
    document = kvgraft_json("info", env=env)
    assert document["server"] == daemon.address
    assert document["info"]["version"] == __version__
    assert document["info"]["store_format_version"] == 4
    assert len(document["info"]["signing_key"]) == 64  # hex: others list it in [trust] keys
    assert [t["name"] for t in document["info"]["tiers"]] == ["lmdb"]
    stats = document["stats"]
    assert stats["artifacts"] == 1
    assert stats["pages"] == len(page_sizes(artifact.manifest))
    assert stats["page_bytes"] == sum(page_sizes(artifact.manifest).values())
    assert stats["last_sequence"] == 1
    assert stats["staged_pages"] == 0
    segment_bytes = sum(block_aligned(size) for size in page_sizes(artifact.manifest).values())
    assert int(stats["segment_disk_bytes"]) >= segment_bytes  # blocks: at least the pages'

    text = kvgraft("info", env=env)
    assert text.returncode == 0, text.stderr
    assert f"kvgraftd {__version__} at {daemon.address}" in text.stdout
    assert f"store: artifacts 1, distinct pages {stats['pages']} " in text.stdout
    assert "of disk free" in text.stdout  # free disk said as free disk, not a "capacity"


def test_info_says_what_the_cache_figures_mean(start_daemon) -> None:
    """Regression: a fresh daemon's device pool read "2.0 GiB used of 2.0 GiB" (it is
    allocated whole at start); info now tells allocated from holding and says what a hit
    and a miss count."""
    daemon = start_daemon(extra_args=["--model", "tiny:1", "--device-budget-bytes", "8MiB"])
    wait_model_ready(daemon.address)
    document = kvgraft_json("info", server=daemon.address)
    device = next(t for t in document["info"]["tiers"] if t["name"] == "device")
    assert int(device["used_bytes"]) == int(device["capacity_bytes"]) > 0
    assert int(device["holding_bytes"]) == 0
    text = kvgraft("info", server=daemon.address).stdout
    header = next(line for line in text.splitlines() if line.startswith("cache"))
    assert header.split() == ["cache", "holding", "allocated", "budget", "hits", "misses"]
    device_row = next(line for line in text.splitlines() if line.startswith("device "))
    assert device_row.split()[1:3] == ["0", "B"]
    assert "device: attention-block slots, allocated whole at start" in text
    assert "host: checked copies of stored pages in RAM" in text


def test_info_names_the_family_and_a_family_generates(start_daemon) -> None:
    """A daemon serving a tiny Gemma 3 (sliding windows among global layers) in its own process:
    info names the family, the products and the schedule; a generate twice with a deposit
    between gives the same receipt hashes, the second grafting the first's prompt."""
    daemon = start_daemon(extra_args=["--model", "tiny:gemma3:1"])
    wait_model_ready(daemon.address)
    info = kvgraft_json("info", server=daemon.address)["info"]
    assert (info["model_family"], info["schedule"]) == ("gemma3", "any")
    text = kvgraft("info", server=daemon.address).stdout
    assert "family: gemma3; products: row-invariant-fma rowwise=2; schedule: any" in text
    prompt = ",".join(str(7 * i % 500) for i in range(40))
    args = ("generate", "--tokens", prompt, "--max-new-tokens", "6")
    first = kvgraft_json(*args, "--deposit", server=daemon.address)
    second = kvgraft_json(*args, server=daemon.address)
    # every token of the prompt but its last (whose logits the first new token needs)
    assert (first.get("reused_tokens", 0), second["reused_tokens"]) == (0, 39)
    for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
        assert first[name] == second[name], name


def test_ls_lists_and_filters_by_label(daemon: DaemonProcess, client: Client, rng) -> None:
    a = _artifact(rng, team="red", kind="chat")
    b = _artifact(rng, team="red", kind="doc")
    c = _artifact(rng, team="blue")
    for artifact in (a, b, c):
        client.put_artifact(artifact)

    listed = kvgraft_json("ls", server=daemon.address)["artifacts"]
    assert [d["artifact_id"] for d in listed] == sorted(x.id for x in (a, b, c))
    by_id = {d["artifact_id"]: d for d in listed}
    for artifact in (a, b, c):
        document = by_id[artifact.id]
        assert document["num_tokens"] == 40
        assert document["num_segments"] == len(artifact.manifest.segment_ends)
        assert document["num_pages"] == 6
        assert document["page_bytes"] == _page_bytes(artifact)
        assert document["labels"] == dict(artifact.manifest.labels)
        assert document["pinned"] is False

    red = kvgraft_json("ls", "--label", "team=red", server=daemon.address)["artifacts"]
    assert sorted(d["artifact_id"] for d in red) == sorted([a.id, b.id])
    both = kvgraft_json("ls", "--label", "team=red", "--label", "kind=doc", server=daemon.address)
    assert [d["artifact_id"] for d in both["artifacts"]] == [b.id]
    assert kvgraft_json("ls", "--label", "team=green", server=daemon.address) == {"artifacts": []}

    text = kvgraft("ls", "--label", "team=red", server=daemon.address)
    assert text.returncode == 0, text.stderr
    assert a.id[:16] in text.stdout and b.id[:16] in text.stdout
    assert c.id[:16] not in text.stdout
    assert "team=red" in text.stdout
    none = kvgraft("ls", "--label", "team=green", server=daemon.address)
    assert none.stdout.strip() == "no artifacts"

    bad = kvgraft("ls", "--label", "team", server=daemon.address)
    assert bad.returncode == 2
    assert "--label takes KEY=VALUE" in bad.stderr


def test_ls_heads_every_column_cuts_labels_and_shows_a_ttl(daemon, client, rng) -> None:
    """Regression: the state column had no header, a library entry's labels made lines
    of 250 characters, and a TTL pin looked like any pin."""
    long_label = "x" * 300
    labelled, plain = _artifact(rng, note=long_label), _artifact(rng)
    client.put_artifact(labelled)
    client.put_artifact(plain)
    client.pin(labelled.id, ttl_s=7200)
    client.pin(plain.id)
    env = {"COLUMNS": "140"}
    lines = kvgraft("ls", server=daemon.address, env=env).stdout.splitlines()
    assert lines[0].split() == [
        "id", "tokens", "pages", "bytes", "created", "(UTC)", "trust", "state", "labels"
    ]  # fmt: skip
    assert max(map(len, lines)) == 140, lines  # the labels take what the line has left
    rows = {line[:16]: line for line in lines[1:]}
    assert "  untrusted  pinned, 2h00m left  note=xxx" in rows[labelled.id[:16]]
    assert rows[labelled.id[:16]].endswith("x…")
    assert rows[plain.id[:16]].endswith("  untrusted  pinned")
    listed = kvgraft_json("ls", server=daemon.address)["artifacts"]
    assert {d["artifact_id"]: d["labels"] for d in listed}[labelled.id] == {"note": long_label}
    stat = kvgraft("stat", labelled.id, server=daemon.address).stdout.splitlines()
    assert f"label note={long_label}" in stat
    created = next(line for line in stat if line.startswith("created "))
    assert ", pinned until " in created and created.endswith(" UTC (2h00m left), then deleted")


def test_ls_and_stat_escape_what_a_label_would_do_to_a_terminal(daemon, client, rng) -> None:
    """Regression: an artifact's labels (anyone's who uploads, imports or replicates one)
    reached the terminal as they were: escape sequences, bidirectional overrides."""
    hostile = "\x1b[2J\u202eevil\x07"
    artifact = _artifact(rng, note=hostile)
    client.put_artifact(artifact)
    listed = kvgraft("ls", server=daemon.address).stdout
    stat = kvgraft("stat", artifact.id, server=daemon.address).stdout
    for shown in (listed, stat):
        assert all(c.isprintable() for line in shown.splitlines() for c in line), repr(shown)
    row = next(line for line in listed.splitlines() if line.startswith(artifact.id[:16]))
    assert row.endswith("note=\\x1b[2J\\u202eevil\\x07")
    assert "label note=\\x1b[2J\\u202eevil\\x07" in stat.splitlines()
    assert kvgraft_json("stat", artifact.id, server=daemon.address)["labels"] == {"note": hostile}


def test_verify_untrusted_without_a_model_fails_saying_what_waits(daemon, client, rng) -> None:
    """Regression: on a daemon serving no model, `verify --untrusted` answered "0 of 0
    untrusted artifacts verified" with exit 0 while uploads waited untrusted."""
    for _ in range(2):
        client.put_artifact(_artifact(rng))  # uploads: untrusted until verified
    result = kvgraft("--json", "verify", "--untrusted", server=daemon.address)
    assert result.returncode == 1, result.stderr
    message = (
        f"2 untrusted artifacts wait, and kvgraftd at {daemon.address} serves no model "
        "(--model none), so it cannot recompute them: run this against a daemon that "
        "serves their model"
    )
    assert json.loads(result.stdout) == {
        "error": {"code": "FAILED_PRECONDITION", "message": message}
    }
    assert result.stderr == f"kvgraft: error: FAILED_PRECONDITION: {message}\n"


def test_stat_accepts_a_prefix(daemon: DaemonProcess, client: Client, rng) -> None:
    artifact = _artifact(rng, source="test")
    client.put_artifact(artifact)
    document = kvgraft_json("stat", artifact.id[:10], server=daemon.address)
    layout = artifact.manifest.layout
    assert document["artifact_id"] == artifact.id
    assert document["num_tokens"] == 40
    assert document["num_pages"] == 6
    assert document["page_bytes"] == _page_bytes(artifact)
    assert document["layout"] == {
        "num_layers": layout.num_layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "kv_dtype": "KV_DTYPE_FLOAT16",
    }
    assert document["model_fingerprint"] == artifact.manifest.model_fingerprint.hex()
    assert document["labels"] == {"source": "test"}
    assert (document["pinned"], document["sequence"]) == (False, 1)
    assert "manifest" not in document

    with_manifest = kvgraft_json("stat", "--manifest", artifact.id[:10], server=daemon.address)
    manifest = with_manifest["manifest"]
    assert manifest["page_sha256"] == [d.hex() for d in artifact.manifest.page_sha256]
    assert manifest["token_ids"] == list(artifact.manifest.token_ids)
    assert manifest["segment_ends"] == list(artifact.manifest.segment_ends)

    text = kvgraft("stat", artifact.id[:10], server=daemon.address)
    assert text.returncode == 0, text.stderr
    assert f"artifact {artifact.id}" in text.stdout
    assert f"tokens 40 in {len(artifact.manifest.segment_ends)} segment(s); 6 pages" in text.stdout
    assert "label source=test" in text.stdout
    assert "token ids" not in text.stdout

    # Regression: `stat --manifest` printed the same text as `stat`.
    full = kvgraft("stat", artifact.id[:10], "--manifest", server=daemon.address)
    assert full.returncode == 0, full.stderr
    assert full.stdout.startswith(text.stdout.rstrip("\n"))
    lines = full.stdout.splitlines()
    assert "token ids " + " ".join(map(str, artifact.manifest.token_ids)) in lines
    assert "segment ends " + " ".join(map(str, artifact.manifest.segment_ends)) in lines
    for digest in artifact.manifest.page_sha256:
        assert digest.hex() in full.stdout


def test_pin_blocks_rm_until_unpinned(daemon: DaemonProcess, client: Client, rng) -> None:
    kept, doomed = _artifact(rng), _artifact(rng)
    client.put_artifact(kept)
    client.put_artifact(doomed)
    address = daemon.address

    pinned = kvgraft_json("pin", doomed.id[:12], server=address)
    assert (pinned["artifact_id"], pinned["pinned"]) == (doomed.id, True)
    text = kvgraft("pin", doomed.id, server=address)
    assert text.returncode == 0 and text.stdout.strip() == f"pinned {doomed.id}"

    refused = kvgraft("--json", "rm", doomed.id, server=address)
    assert refused.returncode == 1
    error = json.loads(refused.stdout)["error"]
    assert error["code"] == "FAILED_PRECONDITION"
    assert "kvgraft pin --off" in error["message"]
    assert "FAILED_PRECONDITION" in refused.stderr
    assert client.stats().artifacts == 2

    unpinned = kvgraft_json("pin", "--off", doomed.id, server=address)
    assert (unpinned["artifact_id"], unpinned["pinned"]) == (doomed.id, False)
    text = kvgraft("pin", "--off", doomed.id[:8], server=address)
    assert text.stdout.strip() == f"unpinned {doomed.id}"

    removed = kvgraft_json("rm", doomed.id[:12], server=address)
    pages = len(page_sizes(doomed.manifest))
    assert removed == {
        "deleted": {
            doomed.id: {
                "pages_freed": pages,
                "bytes_freed": sum(page_sizes(doomed.manifest).values()),
            }
        }
    }
    text = kvgraft("rm", kept.id, server=address)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"deleted {kept.id[:16]}: {pages} pages freed")
    assert client.stats().artifacts == 0


def test_export_then_import_into_another_daemon(start_daemon, rng, tmp_path: Path) -> None:
    source, target = start_daemon(), start_daemon()
    artifact = _artifact(rng)
    with Client(source.address) as client:
        client.put_artifact(artifact)
        reference = tmp_path / "reference.safetensors"
        client.export_bundle(artifact.id, reference)

    bundle = tmp_path / "cli.safetensors"
    exported = kvgraft_json("export", artifact.id[:8], "-o", str(bundle), server=source.address)
    assert exported == {
        "artifact_id": artifact.id,
        "path": str(bundle),
        "bytes": bundle.stat().st_size,
    }
    assert hashlib.sha256(bundle.read_bytes()).digest() == (
        hashlib.sha256(reference.read_bytes()).digest()
    )
    again = tmp_path / "text.safetensors"
    text = kvgraft("export", artifact.id, "-o", str(again), server=source.address)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"exported {artifact.id[:16]} to {again}")
    assert again.read_bytes() == bundle.read_bytes()

    imported = kvgraft_json("import", str(bundle), server=target.address)
    sizes = page_sizes(artifact.manifest)
    assert imported == {
        "artifact_id": artifact.id,
        "already_present": False,
        "pages_written": len(sizes),
        "bytes_written": sum(sizes.values()),
    }
    repeated = kvgraft_json("import", str(bundle), server=target.address)
    assert repeated == {
        "artifact_id": artifact.id,
        "already_present": True,
        "pages_written": 0,
        "bytes_written": 0,
    }
    text = kvgraft("import", str(again), server=target.address)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"imported {artifact.id} (already present): 0 pages written")
    with Client(target.address) as client:
        fetched = client.get_artifact(artifact.id)
    assert {d: bytes(v) for d, v in fetched.pages.items()} == {
        d: bytes(v) for d, v in artifact.pages.items()
    }


# ----------------------------------------------------------------------
# errors


def test_unknown_id_is_not_found(daemon: DaemonProcess) -> None:
    for command in (["stat", "deadbeef"], ["rm", "deadbeef"], ["pin", "deadbeef"]):
        result = kvgraft("--json", *command, server=daemon.address)
        assert result.returncode == 1
        document = json.loads(result.stdout)
        assert document == {
            "error": {
                "code": "NOT_FOUND",
                "message": "no artifact id starts with deadbeef (kvgraft ls lists them)",
            }
        }
        assert result.stderr.strip() == (
            "kvgraft: error: NOT_FOUND: no artifact id starts with deadbeef (kvgraft ls lists them)"
        )
    text = kvgraft("stat", "deadbeef", server=daemon.address)
    assert text.returncode == 1
    assert text.stdout == ""
    assert "NOT_FOUND: no artifact id starts with deadbeef" in text.stderr


@pytest.mark.parametrize("via", ["flag", "environment"])
def test_unreachable_server_says_to_start_the_daemon(via: str) -> None:
    with closed_address() as address:  # held: no one else can listen there meanwhile
        if via == "flag":
            result = kvgraft("--json", "ls", server=address)
        else:
            result = kvgraft("--json", "ls", env={"KVGRAFT_SERVER": address})
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "UNAVAILABLE"
    for message in (error["message"], result.stderr):
        assert f"cannot reach kvgraftd at {address}" in message
        assert "is it running? Start it with `make serve` or `kvgraft serve`" in message
    assert "Traceback" not in result.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(daemon: DaemonProcess) -> None:
    """Regression: `kvgraft info | head -1` ended with a BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        result = subprocess.run(
            [sys.executable, "-m", "kvgraft", "--server", daemon.address, "--json", "info"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""


# ----------------------------------------------------------------------
# serve


def test_serve_runs_the_daemon(tmp_path: Path) -> None:
    """Regression: `kvgraft serve --listen ...` was refused by the CLI's own parser. Port 0
    for the HTTP API too (issue 47: it took the default 8551, taken on a busy machine)."""
    data = tmp_path / "data"
    listen = ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgraft", "serve", *listen, "--data", str(data)],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    found = threading.Event()
    address: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"serving on (\S+:\d+)", line)
            if match and not found.is_set():
                address.append(match.group(1))
                found.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert found.wait(60), "".join(lines)
        document = kvgraft_json("info", server=address[0])
        assert document["info"]["version"] == __version__
        assert (data / "kvgraftd.lock").read_text() == f"{proc.pid}\n"  # exec'd, same pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    reader.join(10)
    assert any("store closed" in line for line in lines)


def test_serve_passes_every_argument_to_the_daemon(tmp_path: Path) -> None:
    printed = kvgraft("serve", "--print-config", "--data", str(tmp_path), "--workers", "3")
    assert printed.returncode == 0, printed.stderr
    assert f'data = "{tmp_path}"' in printed.stdout
    assert "workers = 3" in printed.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["info", "--json"],
        ["ls", "--json"],
        ["library", "ls", "--json"],
        ["remote", "--json", "status"],
    ],
)
def test_json_is_accepted_after_the_command_too(args: list[str]) -> None:
    """Regression: `kvgraft info --json` was refused (only `kvgraft --json info` worked)."""
    assert build_parser().parse_args(args).json is True
    assert build_parser().parse_args([a for a in args if a != "--json"]).json is False


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "--server", "H:1"],
        ["ls", "--server=H:1"],
        ["library", "ls", "--server", "H:1"],
        ["replicate", "--from", "A:1", "--to", "B:1", "--server", "H:1"],
        ["remote", "status", "--server", "H:1"],
    ],
)
def test_global_options_are_accepted_after_the_command(args: list[str]) -> None:
    """Regression: --server (and the TLS and token options) worked only before the command."""
    parsed = build_parser().parse_args([*args, "--timeout", "5", "--tls-ca", "ca.pem"])
    assert (parsed.server, parsed.timeout, parsed.tls_ca) == ("H:1", 5.0, "ca.pem")
    before = build_parser().parse_args(["--server", "X:2", *args])
    assert before.server == "H:1"  # given after the command: that one counts
    assert build_parser().parse_args(["--server", "X:2", "ls"]).server == "X:2"


def test_global_options_after_the_command_reach_the_daemon(daemon: DaemonProcess) -> None:
    after = kvgraft("info", "--server", daemon.address)
    assert after.returncode == 0, after.stderr
    assert f"at {daemon.address}" in after.stdout


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["ls", "--bogus"], "usage: kvgraft ls"),
        (["stat", "abcdef12", "--manfest"], "usage: kvgraft stat"),
        (["library", "add", "--problem", "p", "--bogus"], "usage: kvgraft library add"),
        (["generate", "--text", "x", "--max-tokens", "3"], "usage: kvgraft generate"),
        (["ls", "--label", "novalue"], "usage: kvgraft ls"),
    ],
)
def test_a_mistyped_flag_shows_the_commands_usage(args: list[str], usage: str) -> None:
    """Regression: a mistyped flag printed the top-level usage, not the command's."""
    result = kvgraft(*args, server="127.0.0.1:1")
    assert result.returncode == 2
    assert result.stderr.startswith(usage), result.stderr
    assert "Traceback" not in result.stderr


def _commands() -> list[list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = [[name] for name in sub.choices]
    library = sub.choices["library"]
    actions = next(a for a in library._actions if isinstance(a, argparse._SubParsersAction))
    return [[], *commands, *(["library", name] for name in actions.choices)]


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "kvgraft")
def test_every_command_has_help(command: list[str]) -> None:
    """Regression: `kvgraft serve --help` (and `kvgraftd --help`) exited 1 with a traceback."""
    result = kvgraft(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "Traceback" not in result.stderr


def test_the_daemon_has_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvgraftd", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "usage: kvgraftd" in result.stdout and "M_TOP_PAD" in result.stdout


def test_json_after_the_command_prints_the_same_document(daemon: DaemonProcess) -> None:
    after = kvgraft("ls", "--json", server=daemon.address)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == kvgraft_json("ls", server=daemon.address)


def test_pin_with_a_ttl_scrub_and_info_say_the_cache(daemon: DaemonProcess, client, rng) -> None:
    artifact = _artifact(rng)
    client.put_artifact(artifact)
    address = daemon.address
    pinned = kvgraft_json("pin", artifact.id[:12], "--ttl", "2h", server=address)
    expires = int(pinned["pin_expires_unix_ms"])
    assert pinned["pinned"] and abs(expires - time.time() * 1000 - 7_200_000) < 60_000
    text = kvgraft("pin", artifact.id, "--ttl", "90m", server=address).stdout
    assert text.startswith(f"pinned {artifact.id} until ") and text.strip().endswith("deleted")
    bad = kvgraft("pin", artifact.id, "--ttl", "soon", server=address)
    assert bad.returncode == 2 and "not a duration" in bad.stderr
    both = kvgraft("pin", artifact.id, "--off", "--ttl", "1h", server=address)
    assert both.returncode == 2 and "--ttl goes with a pin" in both.stderr  # said in flags

    scrub = kvgraft("scrub", "--rate", "100MB", server=address)
    pages = len(page_sizes(artifact.manifest))
    assert scrub.returncode == 0, scrub.stderr
    assert scrub.stdout.startswith(f"scrubbed {pages} pages (")
    assert ": 0 corrupt, 0 artifacts quarantined" in scrub.stdout
    assert kvgraft("scrub", "--rate", "1KB", server=address).returncode == 1  # under 1 MiB/s

    info = kvgraft("info", server=address).stdout
    assert "cache: budget none, lru eviction, deposits explicit; evicted 0" in info
    assert "scrub: finished " in info and f"{pages} of {pages} pages, 0 corrupt" in info
