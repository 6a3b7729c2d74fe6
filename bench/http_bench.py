"""HTTP bench: the OpenAI-compatible API against gRPC, and prefix caching over a ten-turn chat.

What, on the real default model (SmolLM2-135M-Instruct, CPU), one daemon in its own
process (a fresh store), in one run:

1. `http_vs_grpc_ttft`: the same chat request (a ~400-token system prompt and a user
   message, the model's chat template rendered by the daemon) sent N times through
   HTTP (the official `openai` package, stream=True, temperature 0) and N times through
   gRPC (kvgraft.Client.generate_stream with the same `messages`, greedy), the two
   alternated pair by pair (the first of each pair alternates too). Both send no_cache
   (and HTTP keep false), so every request computes its whole prompt, as a user's first
   request does. Time to first token is from the call to the first content delta (HTTP)
   or the first token message (gRPC); decode tokens/s counts from the first token to the
   end of the answer. Medians are reported and the ratio HTTP / gRPC of the TTFT medians
   (target <= 1.15). Every answer's tokens and logits hashes must equal the first gRPC
   answer's, and both APIs must see the same prompt tokens (a fast wrong answer is not a
   result).
2. A ten-turn conversation over HTTP (each turn: the assistant's answers so far, a new user
   message of ~60 tokens, max_tokens 32, temperature 0), twice turn by turn: once with
   prefix caching (the default: the daemon keeps each turn's context, the next turn grafts
   it) and once with kvgraft.no_cache and keep false; the one that goes first alternates
   turn by turn. Both conversations send the same messages (the cached one's answers),
   and the uncached answer must equal the cached one. Reported per turn: TTFT both ways
   (medians over --conversations conversations, each with its own system prompt), prompt
   and cached tokens; `turn10_ttft_vs_no_cache` (last turn's TTFT cached / uncached, target
   <= 0.2) and `reused_fraction` (sum of usage.prompt_tokens_details.cached_tokens over sum
   of prompt_tokens, every turn of the cached conversations, target >= 0.8).
   The conversation starts with a ~400-token system prompt (the log a support assistant
   answers from) so that the last turn's prompt holds ~1,300 tokens: with a short chat,
   an uncached prompt costs little more than the fixed cost of a request and the ratio
   would say nothing about what caching saves; a long system prompt is also what chat
   applications send with every turn.
3. A peer, only where llama-cpp-python with its server is installed (never required): the
   same cached conversation against `python -m llama_cpp.server` on the same GGUF (its
   prompt cache: the longest prefix of the previous prompt is kept; `cache_prompt` sent
   too), one conversation after the kvgraft daemon has stopped.

What bounds the figures: a first token is the prompt's prefill (the products' FLOPs for
~400 tokens, the same work through both APIs); HTTP adds parsing the JSON body, the hop from
the engine's thread to the event loop, SSE framing and the `openai` package's parsing of
each chunk, which should be milliseconds against hundreds. A cached turn computes only the
new user message and the template's tokens (~70) and copies the grafted KV of the earlier
turns; the uncached one computes all ~1,300, so the ratio is bounded below by about
70 / 1,300 plus the fixed cost of a request. (A turn also recomputes the end of the
previous answer where its text tokenizes otherwise than the tokens generated, e.g. a word
cut by max_tokens.) reused_fraction is bounded by the first turn
(nothing to reuse) and the new tokens of every later one.

Run: .venv/bin/python bench/http_bench.py [--pairs 8] [--conversations 3] [--turns 10]
     [--plot bench/out/http_bench.png]
Last stdout line: one JSON object with http_vs_grpc_ttft, turn10_ttft_vs_no_cache,
reused_fraction, the medians, the per-turn arrays, answers_equal and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai

from kvgraft import Client
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "models"
UNCACHED = {"kvgraft": {"no_cache": True, "keep": False}}  # computes everything, keeps nothing
GATES = ["north", "south", "east", "west"]


@dataclass(frozen=True)
class Answer:
    """One streamed answer: when its tokens came, what it said, what the server reported."""

    ttft_s: float
    decode_tokens_per_s: float | None  # None: a single token
    text: str
    prompt_tokens: int | None  # None where the server does not report usage
    cached_tokens: int | None
    proof: tuple | None  # generated token ids and logits hashes (kvgraft only)


def decode_rate(tokens: int, first: float, end: float) -> float | None:
    return (tokens - 1) / (end - first) if tokens > 1 and end > first else None


def record(i: int) -> str:
    return (
        f"Record {i}: the ship {chr(65 + i % 26)}{i * 7 % 89} came in by the "
        f"{GATES[i % 4]} gate at {i % 24} o'clock carrying {i * 13 % 97} crates."
    )


def system_prompt(session: int, records: int) -> str:
    log = " ".join(record(i) for i in range(session * 1000, session * 1000 + records))
    return (
        f"Session {session}. You are the harbour master's assistant. Answer briefly, from "
        f"this log only: {log}"
    )


def user_message(session: int, turn: int) -> str:
    asked = session * 1000 + turn
    news = record(session * 1000 + 500 + turn)
    return f"New entry: {news} Which gate did record {asked} use, and what did it carry?"


def http_answer(api, model: str, messages: list[dict], max_tokens: int, extra: dict) -> Answer:
    """One streamed chat completion through the `openai` package."""
    began = time.perf_counter()
    stream = api.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    first = end = None
    parts, usage, receipt = [], None, None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta.content is not None:  # a role-only chunk is not a token
                first = first or now
                parts.append(choice.delta.content)
            if choice.finish_reason:
                end = now
                receipt = (chunk.model_extra or {}).get("kvgraft")
        usage = chunk.usage or usage
    end = end or time.perf_counter()
    tokens = usage.completion_tokens if usage else len(parts)
    proof = None
    if receipt:
        hashes = receipt["receipt"]
        proof = (
            tuple(hashes["generated_token_ids"]),
            bytes.fromhex(hashes["prompt_logits_sha256"]),
            bytes.fromhex(hashes["generated_logits_sha256"]),
        )
    details = usage.prompt_tokens_details if usage else None
    return Answer(
        ttft_s=first - began,
        decode_tokens_per_s=decode_rate(tokens, first, end),
        text="".join(parts),
        prompt_tokens=usage.prompt_tokens if usage else None,
        cached_tokens=details.cached_tokens if details else None,
        proof=proof,
    )


def grpc_answer(client: Client, messages: list[dict], max_tokens: int) -> Answer:
    """The same request through kvgraft.Client, greedy, without the cache."""
    began = time.perf_counter()
    stream = client.generate_stream(
        messages=messages, max_new_tokens=max_tokens, temperature=0, no_cache=True
    )
    first = None
    for _ in stream:
        first = first or time.perf_counter()
    result = stream.result()  # the result message ends the stream: read in the loop above
    end = time.perf_counter()
    receipt = result.receipt
    generated = len(receipt.generated_token_ids)
    return Answer(
        ttft_s=first - began,
        decode_tokens_per_s=decode_rate(generated, first, end),
        text=result.text,
        prompt_tokens=result.reused_tokens + result.computed_tokens - generated,
        cached_tokens=result.reused_tokens,
        proof=(
            receipt.generated_token_ids,
            receipt.prompt_logits_sha256,
            receipt.generated_logits_sha256,
        ),
    )


def api_vs_api(api, model: str, client: Client, pairs: int, records: int, decode: int) -> dict:
    """Part 1: N alternated pairs of the same uncached request, HTTP and gRPC."""
    messages = [
        {"role": "system", "content": system_prompt(0, records)},
        {"role": "user", "content": "Tell the story of the harbour's busiest day, at length."},
    ]
    run = {
        "http": lambda: http_answer(api, model, messages, decode, UNCACHED),
        "grpc": lambda: grpc_answer(client, messages, decode),
    }
    reference = run["grpc"]()  # warm-up of both, excluded; its answer is the reference
    run["http"]()
    answers: dict[str, list[Answer]] = {"http": [], "grpc": []}
    for pair in range(pairs):
        for name in ("http", "grpc") if pair % 2 == 0 else ("grpc", "http"):
            answer = run[name]()
            answers[name].append(answer)
            print(
                f"pair {pair + 1} {name:4s} TTFT {1e3 * answer.ttft_s:7.1f} ms   decode "
                f"{answer.decode_tokens_per_s or 0:5.1f} tokens/s   prompt "
                f"{answer.prompt_tokens} tokens",
                flush=True,
            )
    every = answers["http"] + answers["grpc"]
    ttft = {name: statistics.median(a.ttft_s for a in got) for name, got in answers.items()}
    rate = {
        name: statistics.median(a.decode_tokens_per_s or 0.0 for a in got)
        for name, got in answers.items()
    }
    return {
        "http_vs_grpc_ttft": round(ttft["http"] / ttft["grpc"], 3),
        "http_vs_grpc_decode": round(rate["http"] / rate["grpc"], 3),
        "ttft_ms": {name: round(1e3 * value, 1) for name, value in ttft.items()},
        "decode_tokens_per_s": {name: round(value, 1) for name, value in rate.items()},
        "prompt_tokens": reference.prompt_tokens,
        "completion_tokens": len(reference.proof[0]),
        "answers_equal": all(a.proof == reference.proof for a in every),
        "same_prompt": all(a.prompt_tokens == reference.prompt_tokens for a in every),
    }


def conversation(api, model: str, session: int, turns: int, records: int, peer=False) -> dict:
    """Part 2 (part 3 with peer=True: the cached conversation alone): turn by turn, the
    cached and the uncached conversation on the same messages."""
    messages = [{"role": "system", "content": system_prompt(session, records)}]
    rows: dict[str, list[Answer]] = {"cached": [], "uncached": []}
    extras = {"cached": {"cache_prompt": True} if peer else {}, "uncached": UNCACHED}
    equal = True
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(session, turn)})
        order = ("cached",) if peer else ("cached", "uncached")
        if (turn + session) % 2:
            order = order[::-1]
        got = {name: http_answer(api, model, messages, 32, extras[name]) for name in order}
        for name, answer in got.items():
            rows[name].append(answer)
        equal &= peer or got["cached"].proof == got["uncached"].proof
        cached = got["cached"]
        line = f"  turn {turn + 1:2d}: prompt {cached.prompt_tokens} cached {cached.cached_tokens}"
        for name, answer in got.items():
            line += f"   {name} TTFT {1e3 * answer.ttft_s:7.1f} ms"
        print(line, flush=True)
        messages.append({"role": "assistant", "content": cached.text})
    return {"rows": rows, "answers_equal": equal}


def llamacpp_peer(records: int, turns: int) -> dict | str:
    """Part 3: the cached conversation against llama-cpp-python's server, or why not."""
    try:
        import llama_cpp.server.app  # noqa: F401  (only to know the server is there)
    except ImportError as exc:
        return f"llama-cpp-python[server] is not installed ({exc}); peer skipped"
    from kvgraftd.engine.model.model_adapter import default_model_path

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path())]
    command += ["--n_ctx", "4096", "--n_threads", str(len(os.sched_getaffinity(0)))]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            return llamacpp_conversation(server, log, f"http://127.0.0.1:{port}/v1", records, turns)
        except openai.APIError as exc:
            return f"llama_cpp.server answered an error; peer skipped: {exc}"
        finally:
            server.terminate()
            server.wait(60)


def llamacpp_conversation(server, log, base: str, records: int, turns: int) -> dict | str:
    """Once `server` answers at `base`: a warm-up, then conversation 1, cached, alone."""
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"{base}/models", timeout=5).read()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-500:]
                return f"llama_cpp.server did not start; peer skipped: {tail}"
            time.sleep(1)
    api = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    model = api.models.list().data[0].id
    http_answer(api, model, [{"role": "user", "content": "Hello"}], 4, {})  # warm-up
    print("llama.cpp peer, cached conversation:", flush=True)
    rows = conversation(api, model, 1, turns, records, peer=True)["rows"]["cached"]
    return {"ttft_ms": [round(1e3 * a.ttft_s, 1) for a in rows]}


def per_turn(conversations: list[dict], name: str, field: str) -> list:
    values = [[getattr(a, field) for a in c["rows"][name]] for c in conversations]
    return [statistics.median(turn) for turn in zip(*values, strict=True)]


def plot(
    cached_ms: list, uncached_ms: list, peer_ms: list | None, prompt_tokens: list, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = range(1, len(cached_ms) + 1)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(turns, uncached_ms, "o-", label="kvgraft, no_cache")
    axis.plot(turns, cached_ms, "o-", label="kvgraft, prefix caching (default)")
    if peer_ms:
        axis.plot(turns, peer_ms, "s--", label="llama-cpp-python server, prompt cache")
    axis.set_xticks(list(turns), [f"{t}\n{p}" for t, p in zip(turns, prompt_tokens, strict=True)])
    axis.set(xlabel="turn / prompt tokens", ylabel="time to first token, ms")
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title("OpenAI API over HTTP, default model: a chat turn by turn")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def kvgraft_parts(args, work: Path, load: float) -> tuple[dict, list[dict]]:
    """Parts 1 and 2 on one daemon with a fresh store under `work`."""
    daemon_args = ["--model", "", "--model-cache", str(MODEL_CACHE), *args.daemon_args.split()]
    daemon = DaemonProcess.start(work / "daemon", daemon_args)
    try:
        wait_model_ready(daemon.address, 600)
        api = openai.OpenAI(
            base_url=daemon.http_url + "/v1", api_key="unused", max_retries=0, timeout=600
        )
        model = api.models.list().data[0].id
        print(f"http_bench: {model}, {os.cpu_count()} CPUs, load average {load:.2f}")
        with Client(daemon.address, timeout_s=600) as client:
            apis = api_vs_api(api, model, client, args.pairs, args.records, args.decode)
        chats = []
        for session in range(1, args.conversations + 1):
            print(f"conversation {session} (cached and no_cache, turn by turn):", flush=True)
            chats.append(conversation(api, model, session, args.turns, args.records))
    finally:
        daemon.stop()
    return apis, chats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="HTTP/gRPC pairs (default 8)")
    parser.add_argument(
        "--decode", type=int, default=64, help="tokens per answer in part 1 (default 64)"
    )
    parser.add_argument("--conversations", type=int, default=3, help="conversations (default 3)")
    parser.add_argument("--turns", type=int, default=10, help="turns of each (default 10)")
    parser.add_argument(
        "--records",
        type=int,
        default=14,
        help="log records in the system prompt (default 14: ~400 tokens)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=ROOT / "bench" / "out" / "http_bench.png",
        help="the PNG of TTFT per turn (default bench/out/http_bench.png)",
    )
    parser.add_argument("--daemon-args", default="", help="more kvgraftd flags")
    args = parser.parse_args(argv)

    began, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="http-bench-") as work:
        apis, chats = kvgraft_parts(args, Path(work), load_before[0])
    peer = llamacpp_peer(args.records, args.turns)
    if isinstance(peer, str):
        print(peer)

    cached_ms = [round(1e3 * s, 1) for s in per_turn(chats, "cached", "ttft_s")]
    uncached_ms = [round(1e3 * s, 1) for s in per_turn(chats, "uncached", "ttft_s")]
    cached_answers = [a for c in chats for a in c["rows"]["cached"]]
    reused = sum(a.cached_tokens for a in cached_answers)
    prompts = sum(a.prompt_tokens for a in cached_answers)
    peer_ms = peer["ttft_ms"] if isinstance(peer, dict) else None
    prompt_tokens = per_turn(chats, "cached", "prompt_tokens")
    plot(cached_ms, uncached_ms, peer_ms, prompt_tokens, args.plot)
    answers_equal = apis["answers_equal"] and all(c["answers_equal"] for c in chats)
    result = {
        "http_vs_grpc_ttft": apis["http_vs_grpc_ttft"],
        "turn10_ttft_vs_no_cache": round(cached_ms[-1] / uncached_ms[-1], 3),
        "reused_fraction": round(reused / prompts, 3),
        "answers_equal": answers_equal,
        "same_prompt_http_grpc": apis["same_prompt"],
        "http_vs_grpc_decode": apis["http_vs_grpc_decode"],
        "ttft_ms": apis["ttft_ms"],
        "decode_tokens_per_s": apis["decode_tokens_per_s"],
        "api_prompt_tokens": apis["prompt_tokens"],
        "api_completion_tokens": apis["completion_tokens"],
        "turn_ttft_ms_cached": cached_ms,
        "turn_ttft_ms_no_cache": uncached_ms,
        "turn_prompt_tokens": prompt_tokens,
        "turn_cached_tokens": per_turn(chats, "cached", "cached_tokens"),
        "turn10_ttft_vs_no_cache_each": [
            round(c["rows"]["cached"][-1].ttft_s / c["rows"]["uncached"][-1].ttft_s, 3)
            for c in chats
        ],
        "llamacpp_turn_ttft_ms": peer_ms,
        "turn10_ttft_vs_llamacpp": round(cached_ms[-1] / peer_ms[-1], 3) if peer_ms else None,
        "pairs": args.pairs,
        "conversations": args.conversations,
        "turns": args.turns,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_average_before": round(load_before[0], 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "elapsed_s": round(time.perf_counter() - began, 1),
        "plot": str(args.plot),
    }
    print(
        "targets: http_vs_grpc_ttft <= 1.15, turn10_ttft_vs_no_cache <= 0.2 (both lower is "
        "better), reused_fraction >= 0.8"
    )
    print(json.dumps(result))
    return 0 if answers_equal and apis["same_prompt"] else 1


if __name__ == "__main__":
    sys.exit(main())
