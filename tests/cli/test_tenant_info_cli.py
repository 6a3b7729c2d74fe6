"""A tenant's `kvgraft info`: its own store and disk figures, never zeros, never the store's.

Was (issue 47): a tenant was told "distinct pages 0", "0 B of page files", "0 B of disk
free" whatever it held. Now its Stats count the distinct pages its artifacts reference and
the disk those take (block-aligned, as stored), and as free disk the room its own budget
leaves; `kvgraft info` says so in its words. A store-only daemon with tenants alice (a
budget of her own) and bob (none), the real `kvgraft`.
"""

from __future__ import annotations

import random

from kvgraft import Client
from kvgraft.artifact import page_sizes
from kvgraft.cli.render import human_bytes
from kvgraft.page_buffers import block_aligned
from kvgraft.tenancy import TENANT_LABEL
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.testing.tenants import write_tenants
from tests.cli.test_cli import kvgraft
from tests.support.factory import random_artifact

BUDGET = 1 << 20
GEOMETRY = {"num_layers": 2, "kv_heads": 2, "head_dim": 16, "kv_dtype": pb.KV_DTYPE_FLOAT32}


def test_a_tenants_info_shows_its_own_disk_figures(start_daemon, tmp_path) -> None:
    config, tokens = write_tenants(
        tmp_path / "etc", {"alice": {"store_budget_bytes": BUDGET}, "bob": {}}
    )
    daemon = start_daemon(extra_args=["--config", str(config)])
    rng = random.Random(47)
    first = random_artifact(rng, tokens=40, page_tokens=16, labels={TENANT_LABEL: "alice"},
                            **GEOMETRY)  # fmt: skip
    shared = {(page, layer): first.pages[first.manifest.page_sha256[page * 2 + layer]]
              for page in range(2) for layer in range(2)}  # fmt: skip
    second = random_artifact(rng, tokens=40, page_tokens=16, labels={TENANT_LABEL: "alice"},
                             shared_pages=shared, **GEOMETRY)  # fmt: skip
    bobs = random_artifact(rng, tokens=20, page_tokens=16, labels={TENANT_LABEL: "bob"}, **GEOMETRY)
    with Client(daemon.address, token_file=tokens["alice"]) as alice:
        alice.put_artifact(first)
        alice.put_artifact(second)
    with Client(daemon.address, token_file=tokens["bob"]) as bob:
        bob.put_artifact(bobs)

    sizes = {**page_sizes(first.manifest), **page_sizes(second.manifest)}  # distinct pages
    counted = sum(page_sizes(first.manifest).values()) + sum(page_sizes(second.manifest).values())
    on_disk = sum(block_aligned(size) for size in sizes.values())
    assert len(sizes) == 8  # six pages each, four of them shared
    with Client(daemon.address, token_file=tokens["alice"]) as alice:
        assert alice.stats() == pb.StatsResponse(
            artifacts=2,
            pages=8,
            page_bytes=counted,
            segment_disk_bytes=on_disk,
            disk_free_bytes=BUDGET - counted,
        )

    def info(tenant: str) -> list[str]:
        result = kvgraft("--token-file", str(tokens[tenant]), "info", server=daemon.address)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    hers = info("alice")
    assert f"store: artifacts 2, distinct pages 8 ({human_bytes(on_disk)} on disk)" in hers
    assert (
        f"disk: its budget counts {human_bytes(counted)} (a page counted in each artifact "
        f"holding it); budget {human_bytes(BUDGET)}, {human_bytes(BUDGET - counted)} left"
    ) in hers
    bob_disk = sum(block_aligned(size) for size in page_sizes(bobs.manifest).values())
    his = info("bob")
    assert f"store: artifacts 1, distinct pages 4 ({human_bytes(bob_disk)} on disk)" in his
    assert his[his.index(next(x for x in his if x.startswith("disk: ")))].endswith(
        "; no budget of its own (the store's holds)"
    )
    operators = info("operator")  # the whole store's figures, as before
    assert any(line.startswith("store: artifacts 3, distinct pages 12 (") for line in operators)
    assert any(line.endswith(" of disk free; change feed at sequence 3") for line in operators)
