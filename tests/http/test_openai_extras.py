"""What llama.cpp's and vLLM's users expect of the HTTP API besides OpenAI's routes, on the
real model: aliases (served_model_name), a real `created`, the model listed while it loads,
CORS for browser apps (405 for OPTIONS without it), and llama.cpp's /tokenize and
/detokenize, checked against the tokenizer itself (transformers' AutoTokenizer on the
default model's file).

One ready daemon serves most of the module: a token, a tenant (alice), two aliases and one
CORS origin, all from its TOML file. Another daemon starts on an empty model cache, so its
model is still converting (tens of seconds) while the test asks it what it serves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx2
import openai
import pytest

from kvgraft.text.default_model import DEFAULT_MODEL_FILE, default_model_path
from kvgraft.text.gguf_tokenizer import GgufTokenizer
from kvgraftd.config import ConfigError, DaemonConfig
from kvgraftd.ops.command_line import build_parser, load_config, to_toml
from kvgraftd.testing.daemon_process import DaemonProcess
from kvgraftd.testing.tenants import write_tenants
from tests.http.model_daemon import assert_error, model_daemon

ALIASES = ["smol", "kvgraft-default"]
ORIGIN = "https://app.example"
TEXT = "Hello, world! á 🤗 <|im_end|>\ttabs\nand  spaces "  # an emoji split across tokens
EXTRA_TOML = (
    f"served_model_name = {json.dumps(ALIASES)}\nhttp_cors_origins = {json.dumps([ORIGIN])}"
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("openai-extras")
    config, token_files = write_tenants(home / "config", {"alice": {}}, EXTRA_TOML)
    with model_daemon(home / "data", ["--config", str(config)]) as started:
        started.tokens = {name: path.read_text().strip() for name, path in token_files.items()}
        yield started
    assert "Traceback" not in started.log()


@pytest.fixture(scope="module")
def api(daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=daemon.http_url + "/v1", api_key=daemon.tokens["operator"], max_retries=0
    )


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer as kvgraft.text builds it from the GGUF file (held to
    llama.cpp's own vectors in tests/text; transformers' GGUF conversion reads SmolLM's
    split as GPT-2's, which cuts "\n\n 123" otherwise than the model's tokenizer.json)."""
    return GgufTokenizer.load(default_model_path())


def post(daemon, route: str, body, token: str | None = "operator", **headers) -> httpx2.Response:
    if token is not None:
        headers["Authorization"] = f"Bearer {daemon.tokens[token]}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers["Content-Type"] = "application/json"
    return httpx2.post(daemon.http_url + route, content=content, headers=headers, timeout=120)


def test_the_settings_are_flags_and_keys_and_are_checked() -> None:
    flags = ["--served-model-name", "smol,kvgraft-default", "--http-cors-origins", "*"]
    config = load_config(build_parser().parse_args(flags))
    assert config.served_model_name == ("smol", "kvgraft-default")
    assert config.http_cors_origins == ("*",)
    printed = to_toml(config)
    assert 'served_model_name = ["smol", "kvgraft-default"]' in printed.splitlines()
    assert 'http_cors_origins = ["*"]' in printed.splitlines()
    with pytest.raises(ConfigError, match=re.escape("'https://app.example/': give an origin")):
        DaemonConfig(http_cors_origins=("https://app.example/",))  # the slash: never matches
    with pytest.raises(ConfigError, match=re.escape("'app.example': give an origin")):
        DaemonConfig(http_cors_origins=("app.example",))
    with pytest.raises(ConfigError, match="served_model_name gives a name twice"):
        DaemonConfig(served_model_name=("smol", "smol"))


def test_models_lists_every_alias_and_a_request_may_name_any(api) -> None:
    listed = api.models.list().data
    assert [m.id for m in listed] == ALIASES
    created = int(default_model_path().stat().st_mtime)  # when the model's file was written
    for entry in listed:
        assert (entry.object, entry.owned_by, entry.created) == ("model", "kvgraft", created)
        assert entry.model_extra["kvgraft"]["state"] == "ready"
        assert entry.model_extra["kvgraft"]["model_name"] == DEFAULT_MODEL_FILE
    assert api.models.retrieve("kvgraft-default").id == "kvgraft-default"
    for alias in ALIASES:  # the answer echoes the name the request used (as vLLM's)
        answer = api.chat.completions.create(
            model=alias, messages=[{"role": "user", "content": "Hi."}], max_tokens=2
        )
        assert answer.model == alias
    text = api.completions.create(model="smol", prompt="One, two,", max_tokens=2, temperature=0)
    assert text.model == "smol"
    # the aliases replace the file's name, as vLLM's --served-model-name does
    with pytest.raises(openai.NotFoundError) as refused:
        api.chat.completions.create(
            model=DEFAULT_MODEL_FILE, messages=[{"role": "user", "content": "Hi."}], max_tokens=2
        )
    assert "'smol', 'kvgraft-default'" in refused.value.body["message"]


def test_tokenize_gives_the_tokenizers_own_ids(daemon, tokenizer) -> None:
    expected = tokenizer.encode(TEXT, add_special_tokens=False)
    assert 2 in expected  # <|im_end|>: parse_special is on by default, as llama.cpp's
    tokens = post(daemon, "/tokenize", {"content": TEXT})
    assert (tokens.status_code, tokens.json()) == (200, {"tokens": expected})
    as_text = post(daemon, "/tokenize", {"content": TEXT, "parse_special": False}).json()
    assert as_text == {
        "tokens": tokenizer.encode(TEXT, add_special_tokens=False, split_special_tokens=True)
    }
    assert 2 not in as_text["tokens"]
    special = post(daemon, "/tokenize", {"content": TEXT, "add_special": True}).json()
    assert special == {"tokens": tokenizer.encode(TEXT, add_special_tokens=True)}
    # the tokenizer is the model's: a tenant's token serves as well
    assert post(daemon, "/tokenize", {"content": TEXT}, token="alice").json() == tokens.json()


def test_pieces_are_each_tokens_bytes_and_detokenize_round_trips(daemon, tokenizer) -> None:
    pieces = post(daemon, "/tokenize", {"content": TEXT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokenizer.encode(TEXT, add_special_tokens=False)
    raw = [
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    ]
    assert b"".join(raw) == TEXT.encode()
    split = [p["piece"] for p in pieces if isinstance(p["piece"], list)]
    assert split, "the emoji's bytes span tokens: some piece is not UTF-8 alone"
    for piece in split:  # a list only where the bytes are not valid UTF-8
        assert all(isinstance(b, int) and 0 <= b < 256 for b in piece)
        with pytest.raises(UnicodeDecodeError):
            bytes(piece).decode()
    assert {"id": 2, "piece": "<|im_end|>"} in pieces
    ids = [p["id"] for p in pieces]
    back = post(daemon, "/detokenize", {"tokens": ids}, token="alice")
    assert (back.status_code, back.json()) == (200, {"content": TEXT})
    assert post(daemon, "/detokenize", {"tokens": []}).json() == {"content": ""}


BAD_BODIES = {
    "no content": ("/tokenize", {}, "content"),
    "content a number": ("/tokenize", {"content": 5}, "content"),
    "a lone surrogate": ("/tokenize", b'{"content": "\\ud800x"}', "content"),
    "with_pieces a word": ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    "add_special a number": ("/tokenize", {"content": "x", "add_special": 1}, "add_special"),
    "parse_special a list": ("/tokenize", {"content": "x", "parse_special": []}, "parse_special"),
    "not an object": ("/tokenize", ["x"], "JSON object"),
    "no tokens": ("/detokenize", {}, "tokens"),
    "tokens a string": ("/detokenize", {"tokens": "1 2"}, "tokens"),
    "a negative id": ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    "an id past the vocabulary": ("/detokenize", {"tokens": [49152]}, "tokens[0]"),
    "a fraction": ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
    "a boolean": ("/detokenize", {"tokens": [True]}, "tokens[0]"),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_a_bad_token_body_is_400_naming_the_field(daemon, case) -> None:
    route, body, named = BAD_BODIES[case]
    error = assert_error(post(daemon, route, body), 400, named)
    assert error["type"] == "invalid_request_error"


def test_the_token_routes_need_the_token(daemon) -> None:
    for route, body in (("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_error(post(daemon, route, body, token=None), 401, "token")
        bad = httpx2.post(
            daemon.http_url + route, json=body, headers={"Authorization": "Bearer wrong"}
        )
        assert_error(bad, 401, "token")


def test_a_browser_preflight_is_answered_for_the_allowed_origin(daemon) -> None:
    asked = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    preflight = httpx2.options(daemon.http_url + "/v1/chat/completions", headers=asked)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert {"authorization", "content-type", "x-stainless-os"} <= {
        h.strip() for h in allowed.split(",")
    }
    other = httpx2.options(
        daemon.http_url + "/v1/chat/completions",
        headers={**asked, "Origin": "https://evil.example"},
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # answers to the origin carry the header, errors too (a browser app can read them)
    listed = httpx2.get(
        daemon.http_url + "/v1/models",
        headers={"Origin": ORIGIN, "Authorization": f"Bearer {daemon.tokens['operator']}"},
    )
    assert listed.status_code == 200
    assert listed.headers["access-control-allow-origin"] == ORIGIN
    refused = post(daemon, "/tokenize", {"content": "x"}, token=None, Origin=ORIGIN)
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    # an OPTIONS that is no preflight is still no method of the route
    bare = httpx2.options(daemon.http_url + "/v1/models")
    assert_error(bare, 405, "OPTIONS")


def test_while_the_model_loads_it_is_listed_and_generation_is_503(tmp_path: Path) -> None:
    """The default model into an empty cache: its conversion takes tens of seconds, and
    /health says "loading" after every question below (so each was asked while it loaded).
    No CORS here: OPTIONS, like any method a route does not take, is 405 with Allow."""
    daemon = DaemonProcess.start(
        tmp_path / "data", ["--model", "", "--model-cache", str(tmp_path / "empty-cache")]
    )
    try:
        base = daemon.http_url
        api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        listed = api.models.list().data  # the README's models.list().data[0].id
        assert [m.id for m in listed] == [DEFAULT_MODEL_FILE]
        assert listed[0].created == int(default_model_path().stat().st_mtime)
        assert listed[0].model_extra["kvgraft"] == {"state": "loading"}
        assert api.models.retrieve(DEFAULT_MODEL_FILE).model_extra["kvgraft"]["state"] == (
            "loading"
        )
        with pytest.raises(openai.APIStatusError) as refused:
            api.chat.completions.create(
                model=DEFAULT_MODEL_FILE, messages=[{"role": "user", "content": "Hi."}]
            )
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "5"
        assert "loading" in refused.value.body["message"]
        tokens = httpx2.post(base + "/tokenize", json={"content": "x"}, timeout=30)
        assert assert_error(tokens, 503, "loading") and tokens.headers["retry-after"] == "5"
        preflight = httpx2.options(
            base + "/v1/chat/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
        )
        error = assert_error(preflight, 405, "OPTIONS", "http_cors_origins")
        assert error["type"] == "invalid_request_error"
        assert preflight.headers["allow"] == "POST"
        assert "access-control-allow-origin" not in preflight.headers
        wrong = httpx2.get(base + "/v1/chat/completions", timeout=30)
        assert assert_error(wrong, 405, "GET") and wrong.headers["allow"] == "POST"
        assert httpx2.get(base + "/health", timeout=30).json() == {"status": "loading"}
    finally:
        daemon.stop()
