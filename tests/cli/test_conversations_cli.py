"""`kvgraft ls` and the conversation contexts the daemon keeps by itself.

Was (issue 47): with chat_cache = "auto" (the default) every chat left an artifact that
`kvgraft ls` listed among the user's deposits, with nothing telling them apart. Now they
carry the label kvgraft.kind=conversation and `ls` leaves them out, saying how many;
`--all` lists them too, `--conversations` only them. A real daemon (the tiny model, cache =
"auto": every Generate keeps its context as a chat's is kept) and the real `kvgraft`.
"""

from __future__ import annotations

from kvgraft import Client
from kvgraftd.testing.daemon_process import wait_model_ready
from tests.cli.test_cli import kvgraft, kvgraft_json

TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64", "--cache", "auto"]


def test_ls_hides_the_conversation_contexts_unless_asked(start_daemon) -> None:
    daemon = start_daemon(extra_args=TINY)
    wait_model_ready(daemon.address)
    with Client(daemon.address) as client:
        deposit = client.deposit(token_ids=list(range(100, 140)), labels={"doc": "a"}).artifact_id
        chats = sorted(
            client.generate(token_ids=[n, *range(10, 49)], max_new_tokens=2).deposited_artifact_id
            for n in (1, 2)
        )

    def ls(*args: str) -> list[str]:
        result = kvgraft("ls", *args, server=daemon.address)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    header, row, note = ls()
    assert header.split()[0] == "id" and row.startswith(deposit[:16])
    assert row.endswith("  doc=a")
    assert note == (
        "(2 conversation contexts that chat_cache or cache = auto kept not listed: "
        "kvgraft ls --all lists them)"
    )
    assert ls("-q") == [deposit]
    assert kvgraft_json("ls", server=daemon.address)["artifacts"][0]["artifact_id"] == deposit
    assert len(kvgraft_json("ls", server=daemon.address)["artifacts"]) == 1

    header, *rows = ls("--all")
    assert sorted(row[:16] for row in rows) == sorted([deposit[:16], *(c[:16] for c in chats)])
    kinds = {row[:16]: row.rsplit(maxsplit=1)[-1] for row in rows}
    assert kinds == {
        deposit[:16]: "doc=a",
        **{chat[:16]: "kvgraft.kind=conversation" for chat in chats},
    }
    assert ls("-a", "-q") == sorted([deposit, *chats])
    assert ls("--conversations", "-q") == chats
    assert ls("--label", "kvgraft.kind=conversation", "-q") == chats
    listed = kvgraft_json("ls", "--conversations", server=daemon.address)["artifacts"]
    assert [a["labels"] for a in listed] == [{"kvgraft.kind": "conversation"}] * 2

    both = kvgraft("ls", "--all", "--conversations", server=daemon.address)
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr


def test_ls_says_nothing_of_contexts_where_there_are_none(daemon) -> None:
    assert kvgraft("ls", server=daemon.address).stdout == "no artifacts\n"


def test_ls_help_says_what_it_leaves_out() -> None:
    text = " ".join(kvgraft("ls", "--help").stdout.split())
    assert "-a, --all list the conversation contexts too" in text
    assert "left out by default" in text
    assert "--conversations list only the conversation contexts" in text
