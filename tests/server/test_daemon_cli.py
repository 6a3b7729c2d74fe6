"""kvgraftd from its user's side: what it says at start and stop, each case a real process.

* `--version` answers; `--help` lists the flags by TOML table and shows no empty default;
* the configuration has one spelling: --print-config writes the replication, trust and
  remote settings in their tables (as the README does), a file may say them flat too, but
  not both ways; unknown tables are refused by name; a flag takes a list comma-separated;
* a --model path that cannot be a model stops the daemon at once (exit 2, one line), before
  it takes its port or its data directory;
* an address that cannot be served is said in the daemon's words, and no gRPC log line
  reaches the terminal;
* SIGTERM while the model loads: the daemon exits at once, saying the load was abandoned;
* a full disk at shutdown costs one warning line (the last uses not recorded), no traceback.
"""

from __future__ import annotations

import random
import re
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft import Client, __version__
from kvgraftd.config import ConfigError, DaemonConfig, check_model
from kvgraftd.ops.command_line import read_toml
from tests.support.factory import random_artifact

KEY = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
OTHER_KEY = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"
MODEL_CHOICES = "give a GGUF file, a Hugging Face model directory, tiny:[FAMILY:]SEED or none"
GRPC_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d")  # the C core's own format


def kvgraftd(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgraftd", *args], capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        yield holder.getsockname()[1]


def test_version_and_help() -> None:
    version = kvgraftd("--version")
    assert (version.returncode, version.stdout) == (0, f"kvgraftd {__version__}\n")
    shown = kvgraftd("--help")
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())  # argparse wraps lines at the terminal's width
    assert "(default: )" not in text and "(default: ())" not in text
    assert "--model-cache MODEL_CACHE where converted models are cached (empty: DATA/models)" in (
        text
    )
    assert "(default: 1GiB)" in text  # map_initial_bytes, in the unit one would write
    assert "[trust] table of the TOML file: --trust-keys A,B,..." in text
    assert "--trust-keys is keys under [trust]" in text


def test_one_spelling_of_the_configuration(tmp_path: Path) -> None:
    printed = kvgraftd("--print-config")
    assert printed.returncode == 0, printed.stderr
    values = tomllib.loads(printed.stdout)
    assert values["trust"] == {"keys": []} and "trust_keys" not in values
    assert values["replication"] == {"follow": [], "pull_from": []}
    assert values["remote"]["bucket"] == "" and values["listen"] == "127.0.0.1:50551"
    assert "--trust-keys is keys under [trust]" in printed.stdout  # the header says the spelling

    config = tmp_path / "kvgraftd.toml"
    as_tables = f'[trust]\nkeys = ["{KEY}"]\n[replication]\nfollow = ["10.0.0.5:50551"]\n'
    flat = f'trust_keys = ["{KEY}"]\nreplication_follow = ["10.0.0.5:50551"]\n'
    outputs = []
    for text in (as_tables, flat):
        config.write_text(text)
        done = kvgraftd("--config", str(config), "--print-config")
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]  # the same settings, printed in the tables
    assert tomllib.loads(outputs[0])["trust"] == {"keys": [KEY]}

    both = kvgraftd("--trust-keys", f"{KEY},{OTHER_KEY}", "--print-config")
    assert tomllib.loads(both.stdout)["trust"] == {"keys": [KEY, OTHER_KEY]}  # comma-separated

    config.write_text(f'trust_keys = ["{KEY}"]\n[trust]\nkeys = []\n')
    twice = kvgraftd("--config", str(config), "--print-config")
    assert (twice.returncode, twice.stdout) == (2, "")
    assert twice.stderr == (
        f"kvgraftd: config file {config}: keys in [trust] is given twice (also as trust_keys "
        "at the top): keep one\n"
    )
    refused = {  # read as kvgraftd reads it: the file's errors, without a process each
        "[store]\nbudget_bytes = 1\n": "unknown table [store] (the tables are [replication], ",
        "[trust]\nkey = []\n": "unknown key 'key' in [trust] (known keys: listen, data, ",
        '[remote]\nbucket = {name = "x"}\n': "remote_bucket = {'name': 'x'}: expected a string",
    }
    for text, expected in refused.items():
        config.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected)):
            read_toml(config)


def test_a_model_that_cannot_load_stops_the_daemon_at_once(tmp_path: Path, taken_port) -> None:
    """Was: the daemon started, logged a traceback 8 s later and served without a model."""
    data = tmp_path / "data"
    missing = tmp_path / "nowhere.gguf"
    # the port is taken: a daemon that got as far as listening would say that instead
    done = kvgraftd(
        *("--model", str(missing), "--data", str(data), "--listen", f"127.0.0.1:{taken_port}")
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"kvgraftd: model {missing} does not exist: {MODEL_CHOICES}\n",
    )
    assert not data.exists()  # the data directory was never opened

    not_hf = tmp_path / "not-hf"
    not_hf.mkdir()
    text_file = tmp_path / "notes.gguf"
    text_file.write_text("not a model\n")
    refused = {
        str(not_hf): "is a directory without config.json, not a Hugging Face model directory",
        str(text_file): f"is not a GGUF file: {MODEL_CHOICES}",
    }
    for model, expected in refused.items():
        with pytest.raises(ConfigError, match=re.escape(f"model {model} {expected}")):
            check_model(DaemonConfig(model=model))
    for tiny in ("tiny:x", "tiny:falcon:1", "tiny:gemma3:x"):
        with pytest.raises(ConfigError, match=re.escape(f"'{tiny}': use tiny:SEED (a whole")):
            DaemonConfig(model=tiny)
    DaemonConfig(model="tiny:gemma3:1")  # a family's tiny model
    with pytest.raises(ConfigError, match=re.escape("products 'int4': use int8-dot or fp32")):
        DaemonConfig(products="int4")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for model in ("", "none", "tiny:7", str(hf)):  # what may load is let through
        check_model(DaemonConfig(model=model))


def test_an_address_that_cannot_be_served_is_said_in_words(tmp_path: Path, taken_port) -> None:
    """Was: gRPC's own log line ("add_port.cc:83] Failed to add port to server"), then
    "the address is in use or not local"."""
    cases = {
        f"127.0.0.1:{taken_port}": (
            f"127.0.0.1:{taken_port} is already in use: stop what listens there (another "
            "kvgraftd?) or pick another --listen"
        ),
        "192.0.2.1:50551": (  # TEST-NET-1: an address of no machine
            "cannot listen on 192.0.2.1:50551: 192.0.2.1 is not an address of this machine; "
            "give one of its addresses (127.0.0.1, or 0.0.0.0 for all)"
        ),
    }
    for listen, expected in cases.items():
        done = kvgraftd(
            *("--model", "none", "--insecure", "--listen", listen),
            *("--data", str(tmp_path / "data")),
        )
        assert done.returncode == 1, done.stderr
        lines = done.stderr.splitlines()
        assert lines[-1].endswith(f" ERROR kvgraftd: {expected}"), done.stderr
        assert not [line for line in lines if GRPC_LOG_LINE.match(line)], done.stderr
        assert "Traceback" not in done.stderr


def test_an_http_address_in_use_is_said_in_words(tmp_path: Path, taken_port) -> None:
    done = kvgraftd(
        *("--model", "tiny:0", "--listen", "127.0.0.1:0"),
        *("--http-listen", f"127.0.0.1:{taken_port}", "--data", str(tmp_path / "data")),
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1].endswith(
        f" ERROR kvgraftd: 127.0.0.1:{taken_port} is already in use: stop what listens there "
        "(another kvgraftd?) or pick another --http-listen"
    ), done.stderr
    assert "Traceback" not in done.stderr


# kvgraftd with an exit handler that says when the interpreter's teardown runs
TEARDOWN_SPEAKS = (
    "import atexit, sys; atexit.register(print, 'teardown ran', file=sys.stderr, flush=True); "
    "from kvgraftd.main import main; main(sys.argv[1:])"
)


def test_a_stop_while_the_model_loads_exits_at_once(tmp_path: Path) -> None:
    """Was: the process stayed alive for seconds after "store closed" (the interpreter's
    teardown under a model load). The default model, into an empty cache: its conversion
    takes tens of seconds, so the stop lands while it loads. The teardown is skipped: an
    exit handler (which a teardown runs) never speaks, whatever the machine's speed."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-c", TEARDOWN_SPEAKS, "--listen", "127.0.0.1:0"),
            *("--http-listen", "127.0.0.1:0"),  # not the default 8551 (issue 47)
            *("--data", str(tmp_path / "data"), "--model", ""),
            *("--model-cache", str(tmp_path / "models")),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if "serving on" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, rest
    after_stop = rest.split(" INFO kvgraftd: store closed\n", 1)[1]
    assert re.fullmatch(
        r"\S+ \S+ INFO kvgraftd: stopped while the model was loading: its load is abandoned\n",
        after_stop,
    ), rest
    assert "engine ready" not in rest


def test_a_full_disk_at_shutdown_costs_one_line(start_daemon, tmp_path: Path) -> None:
    """Was: a traceback ("could not record the artifacts' last uses") at every stop."""
    data = tmp_path / "store"
    daemon = start_daemon(data)
    artifact = random_artifact(random.Random(3))
    with Client(daemon.address, timeout_s=30) as client:
        client.put_artifact(artifact)
    assert daemon.terminate() == 0
    # every write refused now, as on a full disk; reading (a use, to be recorded) still works
    full = start_daemon(data, ["--min-free-bytes", "1000TB"])
    with Client(full.address, timeout_s=30) as client:
        assert client.get_artifact(artifact.id).id == artifact.id
    assert full.terminate() == 0
    full.wait_for_log("store closed")  # the last line: anything close() logged came before
    assert "Traceback" not in full.log(), full.log()
    warned = [line for line in full.log_lines if "last uses" in line]
    assert len(warned) == 1 and " WARNING " in warned[0], full.log()
    assert (
        "could not record the artifacts' last uses: the uses since the last write (at most 30 s "
        "of them) are forgotten; no data is lost (the disk holding"
    ) in warned[0]
