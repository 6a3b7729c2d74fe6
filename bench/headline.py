"""Headline: the store's and the tiers' six ratios, first in every `make bench`.

The figures a regression of the store or the tiers shows in first (issue 48):
reads, durable writes and GetArtifact against the plainest way to move the
same bytes (store_bench.py), a pull replication against raw TCP
(replication_bench.py), and a decode step over a million stored tokens against
the same step with every block resident and against the machine's read
bandwidth (long_context.py at 32K, 256K and 1M tokens: the 10M-token run is
`make bench-long`'s). Each bench runs in its own process, one after another
(never two at once: they share the cores), and measures its own baselines in
the same run, so every figure is a ratio of two timings taken side by side.

Prints a table of the six ratios with the goal each is held to, then one JSON
line with them. A bench that fails is reported (its figures null) and the
others still run; the exit status is then 1.

Run: .venv/bin/python bench/headline.py [--quick]
  (--quick: fewer trials and a half-size corpus, ~2 minutes instead of ~5)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent

# (figure, bench, its key, the goal, higher is better)
RATIOS = [
    ("read_vs_memcpy", "store", "read_vs_memcpy", 1.0, True),
    ("write_vs_fsync_file", "store", "write_vs_fsync_file", 1.0, True),
    ("grpc_get_vs_tcp", "store", "grpc_get_vs_tcp", 0.5, True),
    ("pull_vs_tcp", "replication", "pull_vs_tcp", 0.35, True),
    ("streamed_vs_resident", "long_context", "streamed_vs_resident", 1.1, False),
    ("step_vs_bandwidth_bound", "long_context", "step_vs_bandwidth_bound", 1.5, False),
]


def commands(quick: bool) -> dict[str, list[str]]:
    trials = ["--trials", "2"] if quick else []
    gib = ["--gib", "0.5"] if quick else []
    return {
        "store": ["store_bench.py", *trials, *gib],
        "replication": ["replication_bench.py", *trials, *gib, "--lag-writes", "3"],
        "long_context": [
            "long_context.py", "--lengths", "32768,262144,1048576", "--resident-max",
            "1048576", "--reference-max", "262144", "--plot", "", *trials,
        ],
    }  # fmt: skip


def run(arguments: list[str]) -> dict | None:
    """The last stdout line of one bench, as JSON (None where it failed); its output shown
    as it runs, on stderr, so that stdout holds the headline alone."""
    process = subprocess.Popen(
        [sys.executable, str(BENCH / arguments[0]), *arguments[1:]],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        sys.stderr.write(line)
        if line.strip():
            last = line
    if process.wait() != 0:
        return None
    try:
        return json.loads(last)
    except json.JSONDecodeError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials, half the corpus")
    args = parser.parse_args(argv)
    results = {name: run(arguments) for name, arguments in commands(args.quick).items()}
    figures: dict[str, float | None] = {}
    print(f"\n{'ratio':<26}{'measured':>10}  goal")
    for figure, bench, key, goal, higher in RATIOS:
        value = (results[bench] or {}).get(key)
        figures[figure] = value
        sign = ">=" if higher else "<="
        met = value is not None and (value >= goal if higher else value <= goal)
        shown = "failed" if value is None else f"{value:.3f}"
        print(f"{figure:<26}{shown:>10}  {sign} {goal}  {'met' if met else 'NOT met'}")
    print(json.dumps(figures))
    return 0 if all(result is not None for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
