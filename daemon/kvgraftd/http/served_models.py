"""What `GET /v1/models` lists: the served model under each of its names, with its state and
its creation time, known from the configuration before the model loads.

* Names: `served_model_name`'s where given, as vLLM's --served-model-name: they replace the
  model's own name, and a request must name one of them. Otherwise the name the engine
  gives the model (the GGUF file's name, a Hugging Face directory's path, tiny:SEED). An
  answer's `model` echoes the name its request used (as vLLM's does), so a client that
  checks `response.model == requested` passes under any alias.
* State: each entry's `kvgraft.state` is the engine's ("loading", "ready", "failed" with
  `kvgraft.error`). The model is listed while it loads, so a client's first
  `models.list().data[0].id` works at once; a completion meanwhile is 503 with Retry-After
  (kvgraftd.http.openai_app). Once ready, the entry carries the fingerprint and profile.
* `created`: OpenAI's "Unix timestamp (in seconds) when the model was created", a property
  of the model, not of the server: the model file's modification time (a Hugging Face
  directory's config.json's), the closest record of when these weights were written. Not
  the time the daemon started (llama.cpp's and vLLM's choice): that changes on every
  restart and tells a client nothing about the model. A tiny test model is generated as
  it loads, so its time is the daemon's start.

Nothing here loads the model or imports the engine's model code (torch): the names and
times are read from the configuration and the file system when the app is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.errors import FailedPrecondition, ModelNotFound
from kvgraft.text.default_model import DEFAULT_MODEL_FILE, default_model_path
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.config import DaemonConfig

TINY_PREFIX = "tiny:"
OWNED_BY = "kvgraft"


@dataclass(frozen=True)
class ServedModel:
    """The model's names and creation time, fixed when the daemon starts."""

    aliases: tuple[str, ...]  # served_model_name; empty: the engine's own name
    own_name: str  # the name the engine will give the model once loaded
    created: int  # Unix seconds

    @classmethod
    def of(cls, config: DaemonConfig) -> ServedModel:
        own_name, path = _source(config.model)
        return cls(tuple(config.served_model_name), own_name, _created(path))

    def names(self, engine_name: str | None = None) -> tuple[str, ...]:
        """The names a request may use: the aliases, else the engine's name for the model
        (`engine_name`, once it is loaded; before, the one it will have)."""
        return self.aliases or (engine_name or self.own_name,)

    def check(self, requested: str, engine_name: str) -> None:
        """ModelNotFound unless a request's `model` is one of the served names."""
        names = self.names(engine_name)
        if requested not in names:
            listed = ", ".join(repr(name) for name in names)
            raise ModelNotFound(
                f"model {requested!r} is not served here (this daemon serves {listed}); "
                "GET /v1/models lists it",
                param="model",
            )

    def entries(self, info: pb.InfoResponse) -> list[dict[str, Any]]:
        """The list of GET /v1/models for the engine's description `info` (none without a
        model: a store-only daemon serves no HTTP API, so only a test sees that)."""
        if info.model_state == "none":
            return []
        state, _, error = info.model_state.partition(": ")
        extra: dict[str, Any] = {"state": state}
        if error:
            extra["error"] = error
        if state == "ready":
            extra.update(
                model_name=info.model_name,
                fingerprint=info.model_fingerprint.hex(),
                page_tokens=info.page_tokens,
                attention=info.profile.attention,
                products=info.profile.products,
            )
        return [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": OWNED_BY,
                "kvgraft": extra,
            }
            for name in self.names(info.model_name or None)
        ]


def _source(model: str) -> tuple[str, Path | None]:
    """The name the engine gives `model` (kvgraftd.engine.model.model_adapter's
    ModelAdapter.load) and the file its creation time is read from (None: none)."""
    if model.startswith(TINY_PREFIX):
        family, _, seed = model[len(TINY_PREFIX) :].rpartition(":")
        return (model if family else f"{TINY_PREFIX}{int(seed)}"), None
    if not model:
        try:
            return DEFAULT_MODEL_FILE, default_model_path()
        except FailedPrecondition:  # not installed: the load says so
            return DEFAULT_MODEL_FILE, None
    path = Path(model)
    if path.is_dir():
        return str(path), path / "config.json"
    return path.name, path


def _created(path: Path | None) -> int:
    """The file's modification time; now where there is none (a tiny model, made as it
    loads) or it cannot be read (the load then says why)."""
    if path is not None:
        try:
            return int(path.stat().st_mtime)
        except OSError:
            pass
    return int(time.time())
