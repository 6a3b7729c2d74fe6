"""The Makefile's developer targets say what they do: `make help` names the target CI runs
(.ci/run's steps are `make check`'s), and every benchmark in bench/ has a `make` target
(its own line, or one of those bench/headline.py runs)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
# bench/gpu_check.py needs a CUDA device: bench/gpu_check.sh runs it on a lent machine;
# bench/llamacpp_peer.py is engine_bench's peer, which it runs in the peer's environment
BY_HAND = {"bench/gpu_check.py", "bench/llamacpp_peer.py"}


def _recipe(target: str) -> str:
    """The rule of `target`: its line and the tab-indented lines after it."""
    match = re.search(rf"^{re.escape(target)}:.*\n(?:\t.*\n)*", MAKEFILE, re.MULTILINE)
    assert match, f"no rule for {target}"
    return match.group(0)


def test_make_help_names_what_ci_runs() -> None:
    listed = subprocess.run(
        ["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    described = dict(re.findall(r"^  make (\S+)\s+(.*)$", listed, re.MULTILINE))
    ci_targets = {name for name, text in described.items() if "what CI runs" in text}
    assert ci_targets == {"check"}, listed
    steps = re.findall(r"^make ([a-z -]+)$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    ran_by_ci = " ".join(steps).split()
    assert _recipe("check").split("##")[0].split(":")[1].split() == ran_by_ci


def test_every_benchmark_has_a_make_target() -> None:
    """Run by a recipe, or by bench/headline.py (the six ratios `make bench` prints first)."""
    run = set(re.findall(r"bench/\w+\.py", _recipe("bench") + _recipe("bench-long")))
    spec = importlib.util.spec_from_file_location("headline", ROOT / "bench" / "headline.py")
    assert spec and spec.loader
    headline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headline)
    assert "bench/headline.py" in run
    run |= {f"bench/{arguments[0]}" for arguments in headline.commands(quick=False).values()}
    scripts = {f"bench/{path.name}" for path in (ROOT / "bench").glob("*.py")}
    assert run == scripts - BY_HAND
