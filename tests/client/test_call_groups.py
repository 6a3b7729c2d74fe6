"""The Client's groups of calls and the connection they run on: each group needs only
what kvgraft.client.connection.Connected declares, and Connection implements all of it.
None of them needs a daemon."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from kvgraft import Client
from kvgraft.client.connection import Connected, Connection
from kvgraft.client.engine_calls import EngineCalls
from kvgraft.client.library_calls import LibraryCalls
from kvgraft.client.replication_calls import ReplicationCalls
from kvgraft.client.store_calls import StoreCalls
from tests.support.protocols import mismatches, protocol_members

GROUPS = (StoreCalls, EngineCalls, LibraryCalls, ReplicationCalls)
NOWHERE = "127.0.0.1:1"


def test_the_connection_implements_what_the_groups_need() -> None:
    with Connection(NOWHERE) as connection:
        assert mismatches(Connection, Connected, connection) == []


@pytest.mark.parametrize("group", GROUPS, ids=lambda group: group.__name__)
def test_a_group_uses_only_its_own_calls_and_the_declared_connection(group: type) -> None:
    """What a group reads on `self` is its own, or declared by Connected: a group written
    against Connection's other parts would break when the Client is assembled otherwise."""
    methods, data = protocol_members(Connected)
    tree = ast.parse(textwrap.dedent(inspect.getsource(group)))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    assert sorted(used - set(vars(group)) - methods - data) == []


def test_a_group_alone_cannot_be_made() -> None:
    """The groups' needs are abstract until a Connection provides them."""
    for group in GROUPS:
        with pytest.raises(TypeError, match="abstract"):
            group()


def test_the_client_is_every_group_over_a_connection() -> None:
    assert all(issubclass(Client, group) for group in (*GROUPS, Connection))
    with Client(NOWHERE) as client:
        assert mismatches(Client, Connected, client) == []
