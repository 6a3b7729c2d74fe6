"""The seed's test on the real model: grafted runs are byte-identical to fresh runs.

Prefixes are cut at any token (around page edges and anywhere inside pages), and
prompts extend a stored prefix, stop inside it, or leave it at any token: with
row-invariant products the longest stored prefix is grafted to the token (the
first rows of a stored page where the prompt leaves it inside one), and the rest
computed in one pass.

Two daemons in their own processes serve SmolLM2-135M-Instruct (float32, CPU)
with 16-token pages, so short prompts cross and end inside page boundaries.
Prefixes are deposited on daemon A; then each (prefix, suffix) sample is
generated three ways: on A grafting the stored prefix, on A with no_cache,
and on B whose store is empty. The logits vectors (returned with the result)
must be equal byte for byte, hence SHA-256-equal, KL divergence 0 and argmax
agreement 100 %, and the generated tokens equal. Graft of a whole artifact
(tail page included) is checked against its fresh replay the same way.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from kvgraft import Client
from kvgraftd.config import PRODUCTS
from kvgraftd.testing.daemon_process import wait_model_ready

PAGE = 16
SAMPLES = 50
PREFIXES = 10
NEW_TOKENS = 2
TEXT = (
    "Byte-exact storage of attention state turns repeated work into a lookup. A small model "
    "reads a library of verified solutions as context, and every number it computes afterwards "
    "matches a fresh run to the last bit, which a receipt of hashes proves to anyone with the "
    "same weights. Pages of sixteen tokens are stored by content, shared between artifacts, "
    "and grafted back at the positions where they were computed. The river rose slowly during "
    "the night, and by morning the old mill stood in water up to its second window. Farmers "
    "came down from the hills with carts and ropes, while the schoolteacher counted children "
    "on the bridge and wrote their names in a notebook that later went missing. In the spring "
    "the council voted to move the market to higher ground, a decision that divided families "
    "for a generation. Prime numbers thin out as they grow, yet there is always another one: "
    "multiply all the primes you know, add one, and the result has a prime factor you missed. "
    "Water boils at a lower temperature on a mountain because the air pressure is lower there; "
    "a cook at four thousand metres waits longer for the pasta and wonders why."
)


@pytest.fixture(scope="module", params=PRODUCTS)
def daemons(request, tmp_path_factory, real_model_args):
    """Two daemons of the default model, in each products (int8-dot, fp32)."""
    from kvgraftd.testing.daemon_process import DaemonProcess

    args = [*real_model_args, "--page-tokens", str(PAGE), "--block-tokens", "64"]
    args += ["--products", request.param]
    started = [DaemonProcess.start(tmp_path_factory.mktemp(name), args) for name in ("a", "b")]
    try:
        for daemon in started:
            wait_model_ready(daemon.address)
        yield started
    finally:
        for daemon in started:
            daemon.stop()


def _logits(result) -> list[np.ndarray]:
    vectors = [result.prompt_logits, *result.generated_logits]
    return [np.frombuffer(v, "<f4").astype(np.float64) for v in vectors]


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = np.exp(p_logits - p_logits.max())
    p /= p.sum()
    q = np.exp(q_logits - q_logits.max())
    q /= q.sum()
    return float(np.sum(p * (np.log(p) - np.log(q))))


def _same(first, second) -> None:
    """Byte-equal logits, hence equal hashes, zero KL, equal argmax, equal tokens."""
    assert first.prompt_logits.tobytes() == second.prompt_logits.tobytes()  # float32 arrays
    assert first.generated_logits.tobytes() == second.generated_logits.tobytes()
    for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
        assert getattr(first.receipt, name) == getattr(second.receipt, name), name
    assert list(first.receipt.generated_token_ids) == list(second.receipt.generated_token_ids)
    for a, b in zip(_logits(first), _logits(second), strict=True):
        assert _kl(a, b) == 0.0
        assert int(a.argmax()) == int(b.argmax())
    assert hashlib.sha256(first.prompt_logits).digest() == first.receipt.prompt_logits_sha256


def test_fifty_grafted_samples_equal_fresh_runs(daemons, real_model) -> None:
    rng = random.Random(2026)
    tokens = real_model.encode(TEXT)
    a, b = (Client(d.address, timeout_s=120, transfer_timeout_s=600) for d in daemons)
    prefixes = []
    for index in range(PREFIXES):
        # cut at any token: around page edges (+-2 tokens) or anywhere in 1..3 pages
        edge = max(1, rng.choice((PAGE, 2 * PAGE, 3 * PAGE)) + rng.randint(-2, 2))
        length = rng.choice((edge, rng.randint(1, 3 * PAGE)))
        start = index * 14  # distinct starts: no two prefixes share a page
        prefix = tokens[start : start + length]
        a.deposit(token_ids=prefix, labels={"sample": str(index)})
        prefixes.append((start, prefix))
    stored = [prefix for _, prefix in prefixes]
    reused = 0
    for sample in range(SAMPLES):
        start, prefix = prefixes[sample % PREFIXES]
        way = sample % 3
        if way == 0:  # the prefix, then more of the text
            suffix_length = rng.choice((1, 2, PAGE - 1, PAGE, PAGE + 1, rng.randint(3, 2 * PAGE)))
            prompt = tokens[start : start + len(prefix) + suffix_length]
        elif way == 1:  # it stops inside the prefix
            prompt = prefix[: rng.randint(2, max(2, len(prefix)))]
        else:  # it leaves the prefix at any token, for text from elsewhere
            cut = rng.randint(0, len(prefix) - 1)
            prompt = prefix[:cut] + tokens[190 : 190 + rng.randint(1, 2 * PAGE)]
        options = {"max_new_tokens": NEW_TOKENS, "return_logits": True}
        grafted = a.generate(token_ids=prompt, **options)
        fresh = a.generate(token_ids=prompt, no_cache=True, **options)
        elsewhere = b.generate(token_ids=prompt, **options)
        # row-invariant products: the longest stored prefix, to the token (a radix tree's
        # answer), leaving the last prompt token to compute; on the fixed schedule (no
        # native kernels), whole pages of it only
        whole = not grafted.receipt.profile.products
        assert a.lookup(prompt).matched_tokens == _longest_stored(prompt, stored, whole), sample
        expected_reuse = _longest_stored(prompt[:-1], stored, whole)
        assert grafted.receipt.reused_tokens == expected_reuse, sample
        assert grafted.receipt.computed_tokens == len(prompt) - expected_reuse + NEW_TOKENS
        assert fresh.receipt.reused_tokens == elsewhere.receipt.reused_tokens == 0
        _same(grafted, fresh)
        _same(grafted, elsewhere)
        reused += grafted.receipt.reused_tokens > 0
    assert reused >= SAMPLES // 2  # most samples really grafted something
    a.close()
    b.close()


def _longest_stored(prompt: list[int], stored: list[list[int]], whole_pages: bool) -> int:
    """The longest common start of `prompt` and any stored sequence (in whole pages of it
    only, with `whole_pages`)."""
    best = 0
    for sequence in stored:
        shared = 0
        for x, y in zip(prompt, sequence, strict=False):
            if x != y:
                break
            shared += 1
        if whole_pages:
            shared = min(shared, len(sequence) // PAGE * PAGE) // PAGE * PAGE
        best = max(best, shared)
    return best


def test_graft_of_whole_artifacts_equals_replay(daemons, real_model) -> None:
    rng = random.Random(7)
    tokens = real_model.encode(TEXT)
    with Client(daemons[0].address, timeout_s=120, transfer_timeout_s=600) as a:
        for _ in range(3):
            length = rng.randint(PAGE + 1, 3 * PAGE - 1)  # a partial tail page
            start = rng.randrange(len(tokens) - length - PAGE)
            deposited = a.deposit(token_ids=tokens[start : start + length])
            continuation = tokens[start + length : start + length + rng.randint(1, PAGE)]
            options = {"max_new_tokens": NEW_TOKENS, "return_logits": True}
            grafted = a.graft(deposited.artifact_id, token_ids=continuation, **options)
            replayed = a.graft(
                deposited.artifact_id, token_ids=continuation, no_cache=True, **options
            )
            assert grafted.receipt.reused_tokens == length
            assert replayed.receipt.reused_tokens == 0
            _same(grafted, replayed)
            assert a.verify(deposited.artifact_id).ok
