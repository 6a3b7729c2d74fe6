"""max_context_tokens defaults to the model's trained context; more is served with a warning.

Was (issue 47): the default was 32,768 whatever the model (SmolLM2 was trained on 8,192
positions), with no word of it. Now the default (0) is the model's max_position_embeddings,
at most 32,768, said at load; a setting above it is served, warned of once at load. A real
daemon serving a tiny Llama saved with 256 trained positions (a Hugging Face directory).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgraft import Client
from kvgraft.errors import InvalidArgument
from kvgraftd.engine.model import tiny_models
from kvgraftd.testing.daemon_process import wait_model_ready

PAGES = ["--page-tokens", "16", "--block-tokens", "64"]
WARNING = "max_context_tokens=1024 is more than the model was trained on (256 positions)"


@pytest.fixture(scope="module")
def trained_on_256(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama-256"
    tiny_models.build("llama", 0, max_position_embeddings=256).save_pretrained(path)
    return path


def test_the_default_is_the_models_trained_context(start_daemon, trained_on_256) -> None:
    daemon = start_daemon(extra_args=["--model", str(trained_on_256), *PAGES])
    wait_model_ready(daemon.address)
    assert "max_context_tokens 256 (the model's trained context, at most 32768)" in daemon.log()
    with Client(daemon.address) as client:
        client.generate(token_ids=[7] * 250, max_new_tokens=6)  # 256: every trained position
        with pytest.raises(InvalidArgument, match="context of 257 tokens exceeds max_context_"):
            client.generate(token_ids=[7] * 251, max_new_tokens=6)
    assert "trained on" not in daemon.log()


def test_more_than_trained_is_served_with_one_warning(start_daemon, trained_on_256) -> None:
    daemon = start_daemon(
        extra_args=["--model", str(trained_on_256), *PAGES, "--max-context-tokens", "1024"]
    )
    wait_model_ready(daemon.address)
    with Client(daemon.address) as client:
        result = client.generate(token_ids=[7] * 300, max_new_tokens=2)
        assert result.computed_tokens == 302  # past the 256 trained positions
    warned = [line for line in daemon.log_lines if WARNING in line]
    assert len(warned) == 1 and "WARNING" in warned[0], daemon.log()
