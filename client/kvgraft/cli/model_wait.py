"""Waiting for the daemon's model before a command that needs it, as `ollama run` does.

kvgraftd serves as soon as it starts and loads its model in the background (seconds
from its cache, minutes for a first conversion); meanwhile the engine refuses calls
with UNAVAILABLE. So every command that needs the engine (deposit, generate, graft,
verify, lookup, chat, ask, library) waits for the model (kvgraft.Client.wait_for_model)
once its arguments are checked (a usage error needs no daemon) and before its first
call, for as long as `--timeout` allows (default: the compute deadline), and says so on
stderr while it waits:

    waiting for the model to load (12 s)…

On a terminal that is one line, rewritten each second and erased when the wait ends;
elsewhere (a pipe, a log) a plain line at once and another every PLAIN_EVERY_S. A model
ready at once shows nothing, and stdout is never written (with --json it holds the
command's one document). A daemon without a model, or whose load failed, is not
waited for: the command's own call then says what to do.
"""

from __future__ import annotations

import sys
from typing import TextIO

from kvgraft.client.client import Client

# Plain lines (no terminal) that land in a log: one every 10 s says it still waits
# without filling the log (a first conversion of a model takes minutes).
PLAIN_EVERY_S = 10.0
_ERASE = "\r\033[K"  # back to the line's start, and clear it


class LoadingLine:
    """What the wait shows on `stream` (stderr): handed to wait_for_model as on_progress,
    then closed."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._terminal = self._stream.isatty()
        self._shown_s: float | None = None  # the seconds the last line showed

    def __call__(self, waited_s: float) -> None:
        text = f"waiting for the model to load ({waited_s:.0f} s)…"
        if self._terminal:
            self._stream.write(f"{_ERASE}{text}")
        elif self._shown_s is None or waited_s - self._shown_s >= PLAIN_EVERY_S:
            self._stream.write(f"{text}\n")
        else:
            return
        self._stream.flush()
        self._shown_s = waited_s

    def close(self) -> None:
        """Erase the terminal's line (what follows starts at its place)."""
        if self._terminal and self._shown_s is not None:
            self._stream.write(_ERASE)
            self._stream.flush()
        self._shown_s = None


def wait_for_model(client: Client) -> str:
    """Wait for the model of `client`'s daemon within the compute deadline (--timeout),
    showing the wait on stderr; its state once loaded ("ready", "none", "failed: ...")."""
    line = LoadingLine()
    try:
        return client.wait_for_model(on_progress=line)
    finally:
        line.close()
