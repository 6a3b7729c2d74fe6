"""How the next token is chosen from a step's logits, its log-probabilities, and stop strings.

Every choice is a function of the logits' bits, the options and the generator's state
alone, on the CPU in float32: greedy is the argmax (the first on ties); sampling divides
by the temperature, keeps the top_k likeliest (ties with the k-th kept too), turns the
rest into probabilities, keeps the fewest likeliest whose mass reaches top_p (a stable
sort: ties in their vocabulary order) and draws one with the request's seeded
generator. So a run with the same receipt inputs and the same `Sampling` chooses the
same tokens, which is what lets a receipt cover a sampled answer.

Log-probabilities are the model's own (a log-softmax of the raw logits), before the
temperature, top-k and top-p, as OpenAI's API reports them.

Stop strings end generation once the decoded text holds one (`StopStrings`); only the
text's tail is decoded per step, so watching costs the same at any length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.requests.decoding import DecodeOptions

# A stop string is found in the decoded text of the last tokens, this many more than its
# characters (a token is at least one character, but control tokens decode to "").
STOP_WINDOW_SLACK_TOKENS = 8


def choose_token(logits: torch.Tensor, options: DecodeOptions, generator: torch.Generator) -> int:
    """The next token of a step whose logits ([vocab], float32) are `logits`."""
    if options.greedy:  # the first of the largest, as torch.argmax: numpy's is 10x faster
        values = logits.numpy() if logits.device.type == "cpu" else logits.cpu().numpy()
        return int(values.argmax())
    scaled = logits / options.temperature
    if 0 < options.top_k < scaled.numel():
        kth = torch.topk(scaled, options.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if options.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(ordered, dim=0) - ordered  # the mass of the likelier tokens
        ordered = ordered.masked_fill(before >= options.top_p, 0.0)  # the first always stays
        probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(
    logits: torch.Tensor, token: int, top: int, decode: Callable[[list[int]], str]
) -> tuple[float, list[pb.TokenLogprob]]:
    """The chosen token's log-probability and the `top` likeliest tokens with theirs."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = [
            pb.TokenLogprob(token_id=int(i), text=decode([int(i)]), logprob=float(v))
            for v, i in zip(values, ids, strict=True)
        ]
    return float(logprobs[token]), alternatives


class StopStrings:
    """Watches generated tokens for the first of some stop strings in their text."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self.stops = tuple(stops)
        self._decode = decode
        longest = max((len(stop) for stop in self.stops), default=0)
        self._window_tokens = longest + STOP_WINDOW_SLACK_TOKENS

    def reached(self, generated: Sequence[int]) -> bool:
        """Whether the text of `generated` holds a stop string (checked after each token:
        the tail suffices, since an earlier one would have been seen earlier)."""
        if not self.stops:
            return False
        tail = self._decode(list(generated[-self._window_tokens :]))
        return any(stop in tail for stop in self.stops)

    def cut(self, text: str) -> str:
        """`text` up to the first stop string in it (all of it when there is none)."""
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        return text[: min(found)] if found else text


def sampling_of(options: DecodeOptions) -> pb.Sampling | None:
    """What a receipt records of the decoding; None for plain greedy (argmax, no stops)."""
    if options.greedy and not options.stop:
        return None
    if options.greedy:
        return pb.Sampling(greedy=True, stop=options.stop)
    return pb.Sampling(
        greedy=False,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=options.seed,
        stop=options.stop,
    )
