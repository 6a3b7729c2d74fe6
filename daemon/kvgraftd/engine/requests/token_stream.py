"""A request's generated tokens: chosen inside the batcher's steps, read by the request.

`TokenStream` is the Decoder of a decoding pass (kvgraftd.engine.scheduling.batcher): on the
compute thread, after each step, `advance` takes that step's logits at the context's
last token, ends the request where its last token was an end of turn, a stop token,
completed a stop string or was the last it asked for, and otherwise chooses the next
token (kvgraftd.engine.requests.token_choice: argmax, or seeded sampling from the request's own
generator, so the choice depends on the logits and the seed alone). Each step hands
the request's thread one `Step`: the logits the step computed at the last token chosen
(none before the first), and the token chosen from them (none at the end). The request's
thread reads them with `events()`, which ends when the pass does (and raises its error:
Cancelled, DataLoss...).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvgraftd.engine.requests.decoding import DecodeOptions
from kvgraftd.engine.requests.token_choice import StopStrings, choose_token


@dataclass(frozen=True)
class Step:
    """What a step gave a decoding request: `computed`, the logits at the token chosen last
    (None at the first: the prompt's were known), and `token`, the next one, chosen from
    `logits` (None: the request has its tokens)."""

    computed: torch.Tensor | None
    token: int | None
    logits: torch.Tensor


class TokenStream:
    def __init__(
        self, options: DecodeOptions, end_of_turn: frozenset[int], text: Callable[[list], str]
    ) -> None:
        self._options = options
        self._generator = torch.Generator().manual_seed(options.seed)
        self._ends = end_of_turn | options.stop_token_ids
        self._stops = StopStrings(options.stop, text)
        self._tokens: list[int] = []  # the compute thread's
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.finish_reason = "length"  # "stop" once an end of turn, stop token or string ended it

    # on the compute thread ------------------------------------------------
    def advance(self, logits: torch.Tensor) -> int | None:
        """The next token from the logits at the last one, or None: no more."""
        computed = logits if self._tokens else None
        token = None
        if self._tokens and (self._tokens[-1] in self._ends or self._stops.reached(self._tokens)):
            self.finish_reason = "stop"
        elif len(self._tokens) < self._options.max_new_tokens:
            token = choose_token(logits, self._options, self._generator)
            self._tokens.append(token)
        if computed is not None or token is not None:
            self._events.put(Step(computed, token, logits))
        return token

    def ended(self, future: Future) -> None:
        """The pass is over (a done-callback of its future)."""
        self._events.put(future)

    # on the request's thread ----------------------------------------------
    def events(self) -> Iterator[Step]:
        """Each step's Step as it comes; raises the pass's error at its end."""
        while True:
            event = self._events.get()
            if isinstance(event, Future):
                event.result()  # its error, if it failed
                return
            yield event
