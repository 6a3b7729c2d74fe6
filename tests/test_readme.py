"""Every example of README.md runs as written, against real daemons.

The README's fenced blocks are read in order. `sh` blocks run in bash (`-euo
pipefail`), `python` blocks in this interpreter, `toml` blocks are loaded as a
kvgraftd configuration (`kvgraftd --config FILE --print-config`: unknown keys
and bad values fail). Blocks without a language (sample output, file trees) are
text. A block whose preceding line is `<!-- readme-test: skip (why) -->` is
reported as skipped with that reason: it needs root, a remote server, or starts
a daemon of its own.

The blocks run as a newcomer would run them: in a fresh directory that holds
the repository's `examples/` and `.venv` (this interpreter's environment), with
the daemon of `make serve` (the real default model, on a temporary store) at the
README's address: `127.0.0.1:50551` in a block is rewritten to that daemon's
port-0 address, `127.0.0.1:8551` to its OpenAI-compatible HTTP API, and
`127.0.0.1:50552` to a second, store-only daemon that allows pulls from the first (the
README's replication section starts one like it). Blocks share the daemons, in README
order, as a reader's shell would.

The quick start is held to its promise too, on an empty store: its receipts are
the ones the README prints (tokens reused and computed, the three hashes: a tool
sold on reproducible hashes prints its real ones), and the graft's hashes equal
the `--no-cache` run's (its speed is measured and reported, not asserted: no
timing thresholds in tests).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUNNABLE = ("sh", "python", "toml")
_SKIP = re.compile(r"<!-- readme-test: skip \((.+)\) -->")
_FENCE = re.compile(r"^```(\S*)\s*$")
ADDRESS_A, ADDRESS_B = "127.0.0.1:50551", "127.0.0.1:50552"
ADDRESS_HTTP = "127.0.0.1:8551"  # the first daemon's OpenAI-compatible API


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str  # why it does not run here; "" when it does

    @property
    def name(self) -> str:
        return f"README.md:{self.line}:{self.language}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with their skip markers."""
    blocks, lines = [], text.splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = _SKIP.fullmatch(before.strip())
        code = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(Block(index + 1, opening.group(1), code, marker.group(1) if marker else ""))
        index = end + 1
    return blocks


BLOCKS_AND_TEXT = readme_blocks(README.read_text())
BLOCKS = [block for block in BLOCKS_AND_TEXT if block.language in RUNNABLE]


def test_the_readme_has_runnable_blocks_and_reasoned_skips() -> None:
    every = readme_blocks(README.read_text())
    assert {b.language for b in every} >= set(RUNNABLE)
    assert all(b.language in (*RUNNABLE, "") for b in every), "a block in another language"
    assert sum(not b.skip for b in BLOCKS) >= 10
    assert all(b.language == "sh" for b in BLOCKS if b.skip)  # configs always load


@dataclass
class Session:
    workdir: Path
    env: dict[str, str]
    addresses: dict[str, str]

    def run(self, block: Block) -> subprocess.CompletedProcess[str]:
        code = block.code
        for written, real in self.addresses.items():
            code = code.replace(written, real)
        if block.language == "sh":
            command = ["bash", "-euo", "pipefail", "-c", code]
        elif block.language == "python":
            command = [sys.executable, "-c", code]
        else:
            config = self.workdir / f"readme-{block.line}.toml"
            config.write_text(code)
            command = [sys.executable, "-m", "kvgraftd", "--config", str(config)]
            command += ["--print-config"]
        return subprocess.run(
            command,
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )


@pytest.fixture(scope="module")
def session(tmp_path_factory, real_model_args):
    base = tmp_path_factory.mktemp("readme")
    served = DaemonProcess.start(base / "data", real_model_args)
    replica = DaemonProcess.start(
        base / "replica-data", ["--replication-pull-from", served.address]
    )
    try:
        wait_model_ready(served.address)
        workdir = base / "work"
        workdir.mkdir()
        (workdir / "examples").symlink_to(ROOT / "examples")
        (workdir / ".venv").symlink_to(Path(sys.prefix))
        bin_dir = str(Path(sys.executable).parent)
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "KVGRAFT_SERVER": served.address,
        }
        addresses = {
            ADDRESS_A: served.address,
            ADDRESS_B: replica.address,
            ADDRESS_HTTP: served.http_url.removeprefix("http://"),
        }
        yield Session(workdir, env, addresses)
    finally:
        served.stop()
        replica.stop()


# the attention kernel the README's quick-start hashes were computed with (its compute profile:
# every build of it, portable, AVX2 or AVX-512, gives the same bits; with the default products)
README_KERNEL = "native"


def _receipts(stderr: str) -> list[dict[str, str]]:
    """The receipts `kvgraft generate` printed: their reuse line and hashes."""
    found: list[dict[str, str]] = []
    for line in stderr.splitlines():
        if line.startswith("receipt: "):
            reused, computed = re.search(r"reused (\d+) tokens, computed (\d+)", line).groups()
            found.append({"reused": reused, "computed": computed})
        elif found and line.strip().split(" ")[0].endswith("_sha256"):
            name, value = line.split()
            found[-1][name] = value
    return found


def test_the_quick_start_shows_a_graft_equal_to_a_fresh_run(session: Session) -> None:
    """First of the daemon's tests (pytest keeps this file's order): the quick start
    deposits into an empty store, so what it grafts is what it deposited."""
    run_ls = subprocess.run(
        ["kvgraft", "ls", "-q"], env=session.env, capture_output=True, text=True, timeout=60
    )
    assert run_ls.returncode == 0 and run_ls.stdout == "", "the store is not empty"
    quick = next(b for b in BLOCKS if not b.skip and "--no-cache" in b.code)
    lines = [line for line in quick.code.splitlines() if line.strip()]
    assert len(lines) <= 4  # with `make serve`: at most five commands
    result = session.run(quick)
    assert result.returncode == 0, result.stderr
    grafted, fresh = _receipts(result.stderr)[-2:]
    assert int(fresh["reused"]) == 0
    for name in ("input_sha256", "prompt_logits_sha256", "generated_logits_sha256"):
        assert grafted[name] == fresh[name], name
    assert "Orrun" in result.stdout  # the answer comes from the grafted guide
    # what the README says it prints (the block after the commands: the answer, the receipt)
    shown = BLOCKS_AND_TEXT[BLOCKS_AND_TEXT.index(quick) + 1]
    assert shown.language == "" and result.stdout.splitlines()[-1] == shown.code.splitlines()[0]
    (readme,) = _receipts(shown.code)
    counts = ("reused", "computed")
    assert [grafted[k] for k in counts] == [readme[k] for k in counts], result.stderr
    if f"decode={README_KERNEL}," not in result.stderr:  # another compute profile, other bits
        pytest.skip(
            f"the README's hashes are those of the {README_KERNEL} attention kernel; this CPU "
            "runs another (its profile says which), whose receipts are equal to each other"
        )
    assert [grafted] == [readme], (
        f"the README's quick start output is stale; this run printed:\n{result.stderr}"
    )


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_readme_block_runs(session: Session, block: Block) -> None:
    if block.skip:
        pytest.skip(block.skip)
    result = session.run(block)
    assert result.returncode == 0, (
        f"{block.name} failed ({result.returncode}):\n{block.code}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    if "Traceback" in result.stderr:
        pytest.fail(f"{block.name} printed a traceback:\n{result.stderr}")


def test_every_file_the_readme_names_exists() -> None:
    """Regression: the README pointed to a DESIGN.md and a solved.jsonl that did not ship,
    and to an artifact id (3995aaf4) no store could hold."""
    text = README.read_text()
    named = set(re.findall(r"\b((?:examples|docs|bench|tests|daemon|client|proto)/[\w./-]+)", text))
    named |= set(re.findall(r"\]\(([^)#:]+)\)", text))  # relative Markdown links
    missing = sorted(path for path in named if not (ROOT / path.rstrip(".")).exists())
    assert not missing, f"README.md names files that do not exist: {missing}"
    assert "DESIGN.md" not in text and "3995aaf4" not in text
    assert len(text.split()) < 3500  # a guide: the lab notes live in bench/README.md
