"""Tenants on the real default model: a prompt never grafts another tenant's pages.

One daemon (module-scoped: the model loads once) with tenants alice and bob (bob's
share of the engine: one running request, one waiting). Alice deposits a document;
bob's generate of it reuses nothing and answers the fresh receipt, byte for byte;
his Lookup reports nothing stored; his Verify and Graft of her id answer NOT_FOUND
as for an id nobody stored; a published artifact is grafted by both, the receipts
naming its owner; through the HTTP API his bearer token makes him bob there too; and
his flood is refused in his own line while alice's request is served.
"""

from __future__ import annotations

import concurrent.futures
import random

import httpx2
import pytest

from kvgraft import Client
from kvgraft.errors import KvgraftError, NotFound, ResourceExhausted
from kvgraft.tenancy import TENANT_LABEL
from kvgraftd.testing.tenants import write_tenants
from tests.http.model_daemon import model_daemon

DOC = (
    "Exact prefix reuse keeps the key and value state of a prompt so that a later request "
    "starting with the same tokens computes only what follows. "
) * 6


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    config, tokens = write_tenants(root / "etc", {"alice": {}, "bob": {"max_running_contexts": 1}})
    with model_daemon(root / "data", ["--config", str(config)]) as process:
        clients = {name: Client(process.address, token_file=path) for name, path in tokens.items()}
        yield process, clients, tokens
        for client in clients.values():
            client.close()


def hashes(result) -> tuple:
    r = result.receipt
    return (r.input_sha256, r.prompt_logits_sha256, r.generated_logits_sha256,
            r.generated_token_ids)  # fmt: skip


def test_a_prompt_never_grafts_another_tenants_pages(daemon) -> None:
    _, c, _ = daemon
    deposited = c["alice"].generate(DOC, max_new_tokens=4, deposit=True)
    prompt = DOC + "It follows that"
    fresh = c["alice"].generate(prompt, max_new_tokens=8, no_cache=True)
    hers = c["alice"].generate(prompt, max_new_tokens=8)
    his = c["bob"].generate(prompt, max_new_tokens=8)
    assert hers.reused_tokens > 0 and his.reused_tokens == 0
    assert hashes(his) == hashes(fresh) == hashes(hers)  # the same bytes, reused or not
    lookup = c["bob"].lookup(text=prompt)
    assert (lookup.matched_tokens, lookup.untrusted_tokens, lookup.untrusted_artifact_id) == (
        0,
        0,
        "",
    )
    assert c["alice"].lookup(text=prompt).matched_tokens == hers.reused_tokens
    aid = deposited.deposited_artifact_id
    unknown = f"{random.Random(9).getrandbits(256):064x}"
    for call in (
        lambda client, x: client.verify(x),
        lambda client, x: client.graft(x, " and so", max_new_tokens=2),
    ):
        with pytest.raises(KvgraftError) as theirs:
            call(c["bob"], aid)
        with pytest.raises(KvgraftError) as nobodys:
            call(c["bob"], unknown)
        assert type(theirs.value) is type(nobodys.value) is NotFound
        assert str(theirs.value).replace(aid, "ID") == str(nobodys.value).replace(unknown, "ID")
    assert c["alice"].verify(aid).ok


def test_a_published_artifact_is_grafted_by_both_and_receipts_name_its_owner(daemon) -> None:
    _, c, _ = daemon
    system = "You are a terse assistant who answers in one sentence. " * 8
    own = c["alice"].generate(system, max_new_tokens=1, deposit=True).deposited_artifact_id
    shared = c["alice"].publish(own)
    for tenant in ("alice", "bob"):
        grafted = c[tenant].graft(shared.artifact_id, " What is KV?", max_new_tokens=4)
        assert grafted.reused_tokens == shared.num_tokens
        named = [(g.artifact_id, g.owner) for g in grafted.receipt.raw.grafted]
        assert named == [(shared.artifact_id, "alice")]
    # and a prompt of bob's that starts with it reuses its pages (the shared namespace)
    his = c["bob"].generate(system + "Then answer.", max_new_tokens=2)
    assert his.reused_tokens >= shared.num_tokens // 64 * 64 > 0
    assert {g.owner for g in his.receipt.raw.grafted} == {"alice"}


def test_the_http_api_answers_each_bearer_token_as_its_tenant(daemon) -> None:
    process, _, tokens = daemon
    url = process.http_url + "/v1/chat/completions"
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "Summarize."}]

    def bearer(tenant: str) -> dict[str, str]:
        return {"Authorization": "Bearer " + tokens[tenant].read_text().strip()}

    models = httpx2.get(process.http_url + "/v1/models", headers=bearer("bob"), timeout=30)
    model = models.json()["data"][0]["id"]

    def chat(tenant: str) -> dict:
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        answer = httpx2.post(url, json=body, headers=bearer(tenant), timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    first = chat("alice")  # kept (chat_cache = auto): alice's next turn grafts it
    again = chat("alice")
    his = chat("bob")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert his["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert his["kvgraft"]["receipt"] == first["kvgraft"]["receipt"]  # fresh: the same bytes
    wrong = httpx2.post(url, json={}, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401


def test_a_tenants_flood_is_refused_in_its_own_line(daemon) -> None:
    _, c, _ = daemon
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        flood = [
            # each holds its place for seconds (a long prompt computed afresh): the flood
            # arrives while the first still runs (regression: short ones, done fast under a
            # loaded machine's delays, let every request through)
            pool.submit(
                c["bob"].generate, DOC * 4 + f"Count slowly: {n}", max_new_tokens=16, no_cache=True
            )
            for n in range(6)
        ]
        hers = pool.submit(c["alice"].generate, "Say hello.", max_new_tokens=4)
        assert hers.result(timeout=600).token_ids  # served while bob's line is full
        outcomes = []
        for future in flood:
            try:
                outcomes.append(future.result(timeout=600).finish_reason)
            except ResourceExhausted as exc:
                assert "engine is busy" in str(exc) and "max_running_contexts=1" in str(exc)
                outcomes.append("refused")
    assert outcomes.count("refused") >= 1  # one running and one waiting at most
    assert len(outcomes) - outcomes.count("refused") >= 1


def test_a_tenants_library_is_its_own(daemon) -> None:
    _, c, _ = daemon
    problem = "What is the capital of the island of Nakosa?"
    added = c["alice"].library_add(
        problem, "The island of Nakosa: capital Methsi.", "Methsi", tags=["facts"]
    )
    assert [e.problem for e in c["alice"].library_list("facts")] == [problem]
    assert c["bob"].library_list("facts") == []
    assert c["alice"].ask(problem).path == "recall"
    theirs = c["bob"].ask(problem, max_new_tokens=4)
    assert theirs.path == "generate" and not theirs.matched_entry
    with pytest.raises(NotFound):
        c["bob"].library_remove(added.entry.artifact_id)


def test_a_graft_with_keep_keeps_its_context_as_the_tenants(daemon) -> None:
    """Regression: Graft ignored `keep` (found by the isolation property's counts)."""
    _, c, _ = daemon
    base = c["alice"].generate(DOC, max_new_tokens=1, deposit=True).deposited_artifact_id
    kept = c["alice"].graft(base, " Kept?", max_new_tokens=2, keep=True)
    assert kept.deposited_artifact_id
    info = c["alice"].stat(kept.deposited_artifact_id).info
    assert info.labels[TENANT_LABEL] == "alice"
    with pytest.raises(NotFound):
        c["bob"].stat(kept.deposited_artifact_id)
