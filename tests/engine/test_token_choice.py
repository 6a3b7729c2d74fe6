"""Token choice: greedy, top-k, top-p, seeds, log-probabilities and stop strings, exactly."""

from __future__ import annotations

import math

import pytest
import torch

from kvgraftd.engine.requests.decoding import DecodeOptions
from kvgraftd.engine.requests.token_choice import (
    StopStrings,
    choose_token,
    sampling_of,
    token_logprobs,
)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (logits are their logs)
PROBS = torch.tensor([0.0625, 0.5, 0.125, 0.25, 0.0625])
LOGITS = torch.log(PROBS)


def _draws(options: DecodeOptions, n: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(options.seed)
    return {choose_token(LOGITS, options, generator) for _ in range(n)}


def test_greedy_is_the_argmax() -> None:
    assert choose_token(LOGITS, DecodeOptions(), torch.Generator()) == 1


def test_top_k_keeps_only_the_k_likeliest() -> None:
    assert _draws(DecodeOptions(greedy=False, top_k=2)) == {1, 3}
    assert _draws(DecodeOptions(greedy=False, top_k=1)) == {1}
    assert _draws(DecodeOptions(greedy=False)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_fewest_whose_mass_reaches_it() -> None:
    # 0.5 reaches 0.45: only the first; 0.7 needs two; 0.8 needs three
    assert _draws(DecodeOptions(greedy=False, top_p=0.45)) == {1}
    assert _draws(DecodeOptions(greedy=False, top_p=0.7)) == {1, 3}
    assert _draws(DecodeOptions(greedy=False, top_p=0.8)) == {1, 2, 3}
    assert _draws(DecodeOptions(greedy=False, top_p=0.8, top_k=2)) == {1, 3}


def test_the_same_seed_draws_the_same_tokens() -> None:
    options = DecodeOptions(greedy=False, temperature=1.7, top_p=0.95, top_k=4, seed=11)

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [choose_token(LOGITS, options, generator) for _ in range(64)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_logprobs_are_the_models_own() -> None:
    logprob, top = token_logprobs(LOGITS, 2, 3, lambda ids: f"t{ids[0]}")
    assert logprob == pytest.approx(math.log(0.125), abs=1e-6)  # float32 of a known value
    assert [t.token_id for t in top] == [1, 3, 2]
    assert [t.text for t in top] == ["t1", "t3", "t2"]
    assert top[0].logprob >= top[1].logprob >= top[2].logprob
    assert token_logprobs(LOGITS, 2, 0, str)[1] == []


def test_stop_strings_watch_the_tail_and_cut_at_the_first() -> None:
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731  a token per character
    stops = StopStrings(["cd", "xyz"], decode)
    text = [ord(c) for c in "ab" * 50 + "c"]
    assert not stops.reached(text)
    assert stops.reached([*text, ord("d")])
    assert stops.cut("abxyzcdxyz") == "ab"
    assert stops.cut("nothing") == "nothing"
    assert not StopStrings([], decode).reached(text)


def test_receipts_record_sampling_only_where_it_matters() -> None:
    assert sampling_of(DecodeOptions()) is None
    greedy_stop = sampling_of(DecodeOptions(stop=("\n",)))
    assert greedy_stop.greedy and list(greedy_stop.stop) == ["\n"]
    sampled = sampling_of(DecodeOptions(greedy=False, temperature=0.5, top_k=3, seed=9))
    assert (sampled.greedy, sampled.temperature, sampled.top_k, sampled.seed) == (
        False,
        0.5,
        3,
        9,
    )
    assert sampled.top_p == 1.0
