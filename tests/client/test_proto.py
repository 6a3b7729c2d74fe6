"""The committed stubs are what the proto generates, and the proto documents everything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = "kvgraft/v1/kvgraft.proto"
STUBS = ("kvgraft_pb2.py", "kvgraft_pb2.pyi", "kvgraft_pb2_grpc.py")


def _protoc(*args: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            *args,
            str(ROOT / "proto" / PROTO),
        ],
        check=True,
    )


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    _protoc(f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}")
    for name in STUBS:
        generated = (tmp_path / "kvgraft/v1" / name).read_bytes()
        committed = (ROOT / "client/kvgraft/v1" / name).read_bytes()
        assert generated == committed, f"client/kvgraft/v1/{name} is stale: run `make proto`"


def _declarations(file: descriptor_pb2.FileDescriptorProto):
    """(source path, name) of every service, RPC, message, field, enum and enum value."""

    def enum(path, e):
        yield path, e.name
        for i, value in enumerate(e.value):
            yield (*path, 2, i), f"{e.name}.{value.name}"

    def message(path, m):
        yield path, m.name
        for i, field in enumerate(m.field):
            yield (*path, 2, i), f"{m.name}.{field.name}"
        for i, nested in enumerate(m.nested_type):
            if not nested.options.map_entry:
                yield from message((*path, 3, i), nested)
        for i, e in enumerate(m.enum_type):
            yield from enum((*path, 4, i), e)

    for i, m in enumerate(file.message_type):
        yield from message((4, i), m)
    for i, e in enumerate(file.enum_type):
        yield from enum((5, i), e)
    for i, service in enumerate(file.service):
        yield (6, i), service.name
        for j, method in enumerate(service.method):
            yield (6, i, 2, j), f"{service.name}.{method.name}"


def test_every_rpc_message_and_field_is_commented(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    _protoc("--include_source_info", f"--descriptor_set_out={out}")
    file = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    comments = {
        tuple(loc.path): (loc.leading_comments + loc.trailing_comments).strip()
        for loc in file.source_code_info.location
    }
    undocumented = [name for path, name in _declarations(file) if not comments.get(path)]
    assert undocumented == []
