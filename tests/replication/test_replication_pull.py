"""One-shot pulls (the Replicate RPC, `kvgraft replicate --pull`): the target daemon copies
straight from the source, two real daemons in their own processes.

* 30 artifacts pulled: the replica holds exactly them, whole (store audit), every exported
  bundle byte-identical to the source's; a second pull moves nothing; a delete on the
  source propagates with the next pull.
* A caller that goes away ends the pull: the target stops copying, holds only whole
  artifacts, and the next pull completes the copy.
* A target stopped (SIGTERM) in the middle of a pull exits cleanly, its caller hears
  UNAVAILABLE, and restarted it holds only whole artifacts; the next pull completes.
* The CLI prints the pull's summary (--json and text) and refuses --pull with --follow.
* Bad input is refused with a clear error and changes nothing: a source that is not
  host:port (INVALID_ARGUMENT; the configuration and the CLI refuse it too), one the
  operator did not allow (FAILED_PRECONDITION), one the target cannot reach
  (UNAVAILABLE, saying so).
* The daemon's credentials go only to sources its configuration names: a host a caller
  chose under `pull_from = "*"` gets no token (a recording server shows it), and one
  that asks for credentials is FAILED_PRECONDITION (replicate_to then relays).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent import futures

import grpc
import pytest

from kvgraft import Artifact, Client
from kvgraft.cli.main import main as cli_main
from kvgraft.cli.replication import add_replicate_arguments
from kvgraft.client.channel import Security
from kvgraft.errors import FailedPrecondition, InvalidArgument, KvgraftError, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import ConfigError, DaemonConfig
from tests.support.factory import random_artifact
from tests.support.ports import closed_address
from tests.support.replica_audit import export_digests, ids
from tests.support.store_audit import audit_store, distinct_page_sizes, multi_mib_artifact


class Progress:
    """tqdm's `total` and `update(n)`, recorded."""

    def __init__(self) -> None:
        self.total = 0
        self.done = 0

    def update(self, n: int) -> None:
        self.done += n


def _source_and_replica(start_daemon, artifacts: list[Artifact]):
    """A source daemon holding `artifacts`, and an empty replica allowed to pull from it."""
    source = start_daemon()
    with Client(source.address) as a:
        for artifact in artifacts:
            a.put_artifact(artifact)
    return source, start_daemon(extra_args=["--replication-pull-from", source.address])


def _whole_then_completed(b: Client, source, expected: dict[str, Artifact]) -> None:
    """After a cut pull, `b` holds whole artifacts only (the pages of those in flight staged
    for the next pull), and the next pull completes the copy."""
    staged = b.stats().staged_pages
    audit_store(b, {aid: expected[aid] for aid in ids(b)}, staged_pages=staged)
    summary = b.pull_from(source.address)
    assert summary.artifacts_added + summary.artifacts_present == len(expected)
    audit_store(b, expected)


def test_a_pull_copies_straight_from_the_source(start_daemon, rng, tmp_path) -> None:
    artifacts = [random_artifact(rng) for _ in range(30)]
    source, replica = _source_and_replica(start_daemon, artifacts)
    with Client(source.address) as a, Client(replica.address) as b:
        progress = Progress()
        summary = b.pull_from(source.address, progress=progress)
        assert (summary.artifacts_added, summary.artifacts_failed) == (30, 0)
        assert summary.bytes_moved == sum(distinct_page_sizes(artifacts).values())
        assert (summary.source, summary.target) == (source.address, replica.address)
        assert summary.last_sequence == 30
        assert progress.done == progress.total == summary.bytes_moved
        expected = {artifact.id: artifact for artifact in artifacts}
        audit_store(b, expected)
        on_source = export_digests(a, set(expected), tmp_path / "a")
        assert export_digests(b, set(expected), tmp_path / "b") == on_source

        again = b.pull_from(source.address)
        assert (again.artifacts_added, again.artifacts_present, again.bytes_moved) == (0, 30, 0)
        a.delete(artifacts[0].id)
        after = b.pull_from(source.address, from_sequence=31)
        assert (after.artifacts_deleted, after.last_sequence) == (1, 31)
        assert ids(b) == ids(a)


def test_a_pull_ends_when_its_caller_goes_away(start_daemon, rng) -> None:
    artifacts = [multi_mib_artifact(rng) for _ in range(120)]
    source, replica = _source_and_replica(start_daemon, artifacts)
    with Client(replica.address) as b:
        call = b._stub.Replicate(pb.ReplicateRequest(source=source.address))
        for progress in call:  # about every 0.5 s
            if 0 < progress.bytes_done < progress.bytes_planned:
                break
        call.cancel()
        replica.wait_for_log("ended early: its caller went away", timeout_s=30)
        held = b.stats().artifacts
        time.sleep(1.0)
        assert b.stats().artifacts == held < len(artifacts)  # it stopped copying
        _whole_then_completed(b, source, {artifact.id: artifact for artifact in artifacts})
    # Regression: the pass's threads, whose client was closed under them, logged a
    # "Cannot invoke RPC on closed channel" traceback.
    assert "Traceback" not in replica.log() and "closed channel" not in replica.log()


def test_a_target_stopped_during_a_pull_exits_cleanly(start_daemon, rng) -> None:
    artifacts = [multi_mib_artifact(rng) for _ in range(120)]
    source, replica = _source_and_replica(start_daemon, artifacts)
    errors: list[Exception] = []

    def pull() -> None:
        with Client(replica.address) as b:
            try:
                b.pull_from(source.address)
            except KvgraftError as exc:
                errors.append(exc)

    puller = threading.Thread(target=pull)
    puller.start()
    with Client(replica.address) as b:
        deadline = time.monotonic() + 60
        while b.stats().artifacts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert replica.terminate(60) == 0, replica.log()
    puller.join(60)
    assert len(errors) == 1 and isinstance(errors[0], Unavailable), errors
    replica.launch()
    with Client(replica.address) as b:
        assert 0 < len(ids(b)) < len(artifacts)
        _whole_then_completed(b, source, {artifact.id: artifact for artifact in artifacts})


def test_cli_pull_prints_a_summary(start_daemon, rng, capsys) -> None:
    artifacts = [random_artifact(rng) for _ in range(3)]
    source, replica = _source_and_replica(start_daemon, artifacts)
    with Client(source.address) as a, Client(replica.address) as b:
        argv = ["--json", "replicate", "--from", source.address, "--to", replica.address]
        assert cli_main([*argv, "--pull"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert (document["artifacts_added"], document["target"]) == (3, replica.address)
        assert ids(b) == ids(a)
        argv = ["replicate", "--from", source.address, "--to", replica.address, "--pull"]
        assert cli_main(argv) == 0
        assert "0 added, 0 repaired, 3 already there" in capsys.readouterr().out
        with pytest.raises(SystemExit):
            cli_main([*argv, "--follow"])
        assert "--pull copies once" in capsys.readouterr().err


def test_a_pull_from_a_bad_source_is_refused_and_changes_nothing(start_daemon) -> None:
    source = start_daemon()
    with Client(start_daemon().address) as strict:  # no [replication] pull_from
        with pytest.raises(FailedPrecondition, match=r"add it to \[replication\] pull_from"):
            strict.pull_from(source.address)
        assert not ids(strict)
    replica = start_daemon(extra_args=["--replication-pull-from", "*"])
    with Client(replica.address) as b:
        # port 99999 was accepted (and gRPC reached another port)
        for bad in ("", "no-port", "host:port", "127.0.0.1:99999", "127.0.0.1:0", "::1:5"):
            with pytest.raises(InvalidArgument, match="host:port"):
                b.pull_from(bad)
        # nothing listens there, held by the test (issue 47: not a fixed port such as 9)
        with closed_address() as nowhere, pytest.raises(Unavailable) as caught:
            b.pull_from(nowhere)
        assert f"could not reach the source {nowhere} " in str(caught.value)
        assert not ids(b)
        assert b.stats().last_sequence == 0


def test_a_source_is_host_and_port_wherever_it_enters(capsys) -> None:
    """The configuration and the command line refuse what the Replicate RPC refuses (the
    command line gives a bare host or IPv6 address the daemon's port, as everywhere)."""
    for bad in ("h:99999", "h:0", "h:", "h", "a b:1", "::1:5"):
        for setting in ("replication_follow", "replication_pull_from"):
            with pytest.raises(ConfigError, match=f"{setting} .*host:port"):
                DaemonConfig(**{setting: (bad,)})
    for bad in ("h:99999", "h:0", "h:", "a b:1", "[::1:5"):
        for flag in ("--from", "--to"):
            argv = ["replicate", "--from", "127.0.0.1:1", "--to", "127.0.0.1:2", flag, bad]
            with pytest.raises(SystemExit) as exited:
                cli_main(argv)
            assert exited.value.code == 2
            assert f"argument {flag}: not a daemon's host:port" in capsys.readouterr().err
    assert DaemonConfig(replication_pull_from=("*", "[::1]:50551", "replica-2.lan:50551"))
    for bad in ("dns:///h:99999", "dns:///", "unix:", "ipv4:10.0.0.5:0", "vsock:3"):
        with pytest.raises(ConfigError, match=r"replication_follow .*unix:PATH"):
            DaemonConfig(replication_follow=(bad,))


TARGETS = (  # gRPC targets kvgraft.Client connects to as they are (with_default_port)
    "unix:/run/kvgraft/daemon.sock",
    "unix:///run/kvgraft/daemon.sock",
    "unix-abstract:kvgraft",
    "dns:///replica-2.lan:50551",
    "dns://10.0.0.1/replica-2.lan:50551",
    "dns:replica-2.lan",
    "ipv4:10.0.0.5:50551,10.0.0.6:50551",
    "ipv6:[::1]:50551",
    "vsock:3:50551",
)


def test_a_source_may_be_any_target_the_client_takes() -> None:
    """Was: unix:PATH and dns:/// targets, which kvgraft.Client (and so the daemon) connects
    to, were refused by the configuration (a follow config that started the daemon then
    stopped it) and by --from/--to."""
    assert DaemonConfig(replication_follow=TARGETS, replication_pull_from=TARGETS)
    parser = argparse.ArgumentParser()
    add_replicate_arguments(parser)
    for target in TARGETS:
        parsed = parser.parse_args(["--from", target, "--to", target])
        assert (parsed.source, parsed.to) == (target, target)


def test_a_pull_reaches_a_unix_socket_source(start_daemon, tmp_path) -> None:
    """Was: Replicate refused a unix:PATH source (INVALID_ARGUMENT), though the daemon
    connects to one: it reaches it now (a recorder there asks for credentials)."""
    recorder = CredentialsRecorder(f"unix:{tmp_path / 'source.sock'}")
    try:
        anywhere = start_daemon(extra_args=["--replication-pull-from", "*"])
        with (
            Client(anywhere.address) as b,
            pytest.raises(FailedPrecondition, match="asks for credentials"),
        ):
            b.pull_from(recorder.address)
        assert len(recorder.metadata) == 1  # the daemon's Info call reached the socket
    finally:
        recorder.server.stop(0)


class CredentialsRecorder:
    """A host a caller names: it records the metadata of each call, and wants a token."""

    def __init__(self, bind: str = "127.0.0.1:0") -> None:
        self.metadata: list[dict[str, str]] = []
        handler = grpc.method_handlers_generic_handler(
            "kvgraft.v1.Kvgraft",
            {"Info": grpc.unary_unary_rpc_method_handler(self.info)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
        port = self.server.add_insecure_port(bind)
        self.address = bind if bind.startswith("unix:") else f"127.0.0.1:{port}"
        self.server.start()

    def info(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "a token, please")


def test_a_pull_sends_credentials_only_to_sources_the_configuration_names(
    start_daemon, tmp_path, rng
) -> None:
    """Was: with pull_from = "*", the daemon connected to any host a caller named with the
    operator's bearer token. Now a source allowed only by "*" gets none; one the
    configuration names gets it, as follow peers do."""
    token = tmp_path / "token"
    token.write_text("operator-token-0123456789\n")
    token.chmod(0o600)
    operator = {"KVGRAFT_TOKEN_FILE": str(token)}  # the daemons' own credentials
    source = start_daemon(extra_args=["--token-file", str(token)])
    with Client(source.address, token_file=token) as a:
        artifact = random_artifact(rng)
        a.put_artifact(artifact)
    anywhere = start_daemon(extra_args=["--replication-pull-from", "*"], env=operator)
    recorder = CredentialsRecorder()
    try:
        with Client(anywhere.address) as b:
            with pytest.raises(KvgraftError) as refused:
                b.pull_from(recorder.address)
            assert [call.get("authorization") for call in recorder.metadata] == [None]
            assert isinstance(refused.value, FailedPrecondition)
            assert "asks for credentials" in str(refused.value) and "pull_from" in str(
                refused.value
            )
            with pytest.raises(FailedPrecondition, match=r"asks for credentials.*pull_from"):
                b.pull_from(source.address)  # the real source: it never saw the token
            assert not ids(b)
        with Client(source.address, token_file=token) as a:
            summary = a.replicate_to(anywhere.address)  # refused the pull: relayed
            assert (summary.mode, summary.artifacts_added) == ("relay", 1)
    finally:
        recorder.server.stop(0)
    named = start_daemon(
        extra_args=["--replication-pull-from", f"*,{source.address}"], env=operator
    )
    with Client(named.address) as c:
        assert c.pull_from(source.address).artifacts_added == 1
        assert ids(c) == {artifact.id}


def test_a_source_allowed_by_any_gets_the_same_tls_and_no_credentials() -> None:
    """What a pull from a source allowed only by "*" is reached with: the environment's TLS
    (its CA, the name checked), neither its token nor its client certificate, whatever
    KVGRAFT_* says when the client is made."""
    environ = {
        "KVGRAFT_TOKEN_FILE": "/nonexistent/token",  # not even read
        "KVGRAFT_TLS_CERT": "client.pem",
        "KVGRAFT_TLS_KEY": "client.key",
        "KVGRAFT_TLS_SERVER_NAME": "kvgraft.internal",
    }
    anonymous = Security.anonymous(environ)
    assert anonymous == Security(tls=True, tls_server_name="kvgraft.internal")
    assert Security.resolve(**anonymous.client_options(), environ=environ) == anonymous
