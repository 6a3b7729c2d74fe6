"""llama.cpp as a peer of engine_bench, in a process of its own (never beside torch).

Runs with the peer's virtual environment (`make bench-peers` builds llama-cpp-python 0.3.36
into .venv-peers; ~10 minutes, from source): `.venv-peers/bin/python bench/llamacpp_peer.py
IDS.json`, where the JSON file holds {"model": GGUF path, "prefill": [token ids],
"decode_prompt": [token ids], "decode": N, "threads": T}. It times a prefill of the first
ids from nothing (one `eval`, batches of 512) and N greedy tokens after the second's, and
prints one JSON line: prefill_s, decode_tokens_per_s, rss_bytes (this process, at the end).

It imports nothing of kvgraft's: the peer's environment has llama-cpp-python alone (a run
with llama-cpp-python in the same process as torch ended with a segmentation fault).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from llama_cpp import Llama

    job = json.loads(Path(argv[0]).read_text())
    context = max(len(job["prefill"]), len(job["decode_prompt"]) + job["decode"]) + 16
    llm = Llama(job["model"], n_ctx=context, n_threads=job["threads"], n_batch=512, verbose=False)
    started = time.perf_counter()
    llm.eval(job["prefill"])
    prefill = time.perf_counter() - started
    llm.reset()
    llm.eval(job["decode_prompt"])
    started = time.perf_counter()
    for _ in range(job["decode"]):
        llm.eval([llm.sample(temp=0.0)])
    decode = job["decode"] / (time.perf_counter() - started)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, bytes
    print(json.dumps({"prefill_s": prefill, "decode_tokens_per_s": decode, "rss_bytes": rss}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
