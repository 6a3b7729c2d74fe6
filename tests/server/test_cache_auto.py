"""cache = "auto": a daemon that keeps every generated context is a prefix cache with no
explicit deposits, its receipts those of a fresh run, and a full store never fails a request.

Real daemons with the tiny model (seconds each).
"""

from __future__ import annotations

import threading

import pytest

from kvgraft import Client
from kvgraftd.testing.daemon_process import wait_model_ready

TINY = ["--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"]
PROMPT = list(range(5, 45))  # 40 tokens: two whole pages and a tail


def _hashes(result) -> tuple:
    r = result.receipt
    return (r.input_sha256, r.prompt_logits_sha256, r.generated_logits_sha256,
            r.generated_token_ids)  # fmt: skip


@pytest.fixture
def auto(start_daemon):
    daemon = start_daemon(extra_args=[*TINY, "--cache", "auto"])
    wait_model_ready(daemon.address)
    return daemon


def test_every_generate_is_kept_and_reused_exactly(auto) -> None:
    with Client(auto.address) as client:
        first = client.generate(token_ids=PROMPT, max_new_tokens=4)
        assert first.reused_tokens == 0 and first.deposited_artifact_id
        assert client.stat(first.deposited_artifact_id).info.provenance.trust  # computed here
        longer = [*PROMPT, *range(50, 59)]
        again = client.generate(token_ids=longer, max_new_tokens=4)
        fresh = client.generate(token_ids=longer, max_new_tokens=4, no_cache=True)
        assert again.reused_tokens >= 32  # the first request's whole pages, kept by itself
        assert _hashes(again) == _hashes(fresh)
        usage = client.stat(first.deposited_artifact_id).info
        assert usage.reused_tokens == again.reused_tokens and usage.last_used_unix_ms
        cache = client.info().cache
        assert (cache.mode, cache.auto_deposits, cache.auto_deposits_skipped) == ("auto", 3, 0)


def test_a_full_store_skips_the_deposit_never_the_request(start_daemon) -> None:
    daemon = start_daemon(extra_args=[*TINY, "--cache", "auto", "--store-budget-artifacts", "1"])
    wait_model_ready(daemon.address)
    with Client(daemon.address) as client:
        kept = client.deposit(token_ids=list(range(100, 140))).artifact_id
        client.pin(kept)  # the budget's one artifact, pinned: nothing can make room
        result = client.generate(token_ids=PROMPT, max_new_tokens=4)
        fresh = client.generate(token_ids=PROMPT, max_new_tokens=4, no_cache=True)
        assert _hashes(result) == _hashes(fresh) and not result.deposited_artifact_id
        cache = client.info().cache
        assert (cache.auto_deposits, cache.auto_deposits_skipped) == (0, 2)
        assert [i.artifact_id for i in client.list_artifacts()] == [kept]
    assert "Traceback" not in daemon.log()


def test_explicit_is_the_default(client) -> None:
    assert client.info().cache.mode == "explicit"


def test_deposits_and_grafts_under_a_budget(start_daemon) -> None:
    """Two clients deposit eight budgets' worth while two others graft a pinned artifact
    and generate from what was just deposited: the store stays within its budget plus one
    artifact, every graft and generate succeeds with a fresh run's receipt, the pin stays."""
    artifact_bytes = 4 * 2 * 4096  # 64 tokens of the tiny model: 4 pages x 2 layers
    budget = 8 * artifact_bytes
    daemon = start_daemon(extra_args=[*TINY, "--store-budget-bytes", str(budget)])
    wait_model_ready(daemon.address)
    errors, peaks, deposited, reused = [], [], [], []
    with Client(daemon.address) as client:
        pinned = client.deposit(token_ids=list(range(300, 364))).artifact_id
        client.pin(pinned)
        graft_fresh = _hashes(
            client.graft(pinned, token_ids=[1, 2], max_new_tokens=2, no_cache=True)
        )

    def deposit(offset: int) -> None:
        with Client(daemon.address) as c:
            for n in range(offset, 64, 2):
                prompt = [n, *range(10, 73)]  # 64 distinct tokens each
                c.deposit(token_ids=prompt)
                deposited.append(prompt)
                peaks.append(c.stats().page_bytes)

    def graft() -> None:
        with Client(daemon.address) as c:
            for round_ in range(12):
                try:
                    got = c.graft(pinned, token_ids=[1, 2], max_new_tokens=2)
                    assert _hashes(got) == graft_fresh and got.reused_tokens == 64
                    if deposited:  # its prefix grafted, or computed if evicted meanwhile
                        prompt = [*deposited[-1], round_ + 1]
                        got = c.generate(token_ids=prompt, max_new_tokens=1)
                        fresh = c.generate(token_ids=prompt, max_new_tokens=1, no_cache=True)
                        assert _hashes(got) == _hashes(fresh)
                        reused.append(got.reused_tokens)
                except Exception as exc:  # collected, asserted empty below
                    errors.append(exc)

    threads = [threading.Thread(target=deposit, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=graft) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with Client(daemon.address) as client:
        cache = client.info().cache
        assert not errors
        assert any(reused)  # some prefixes were grafted
        assert max(peaks) <= budget + artifact_bytes
        assert cache.evicted_artifacts >= 20
        assert pinned in {i.artifact_id for i in client.list_artifacts()}
    assert "Traceback" not in daemon.log()
