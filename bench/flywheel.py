"""Flywheel bench: recurring problems answered from a knowledge library, and held-out transfer.

What: the seed's two claims on the real default model (SmolLM2-135M-Instruct,
float32, CPU), through a real daemon over gRPC, with problem sets this
project generates itself (kvgraftd/testing/flywheel_problems.py: arithmetic word
problems and unit conversions whose answers Python computes, and facts about
invented islands that no model can know). Nothing is tuned to the model: the
sets come from fixed seeds and are reported whatever the model does.

1. Recurring (default 54 problems, 18 of each kind). Every problem is
   deposited once with its verified solution (`LibraryAdd`, tags = its kind),
   then asked again:
   * with the library: `Ask` recalls the token-exact entry (graft + answer
     cue, a few decode tokens). Correct = path recall and the decoded answer
     equals the Python answer (normalized: case, spacing, framing punctuation).
   * without it (the baseline, measured in the same run): `Ask` with
     no_recall, the plain model solving the problem from scratch with a
     512-token budget (greedy; it stops at its end-of-turn token). Correct =
     the last number of its text equals the answer (numeric answers), or the
     answer appears in its text as a word (names); lenient on purpose.
   Reported: accuracy both ways, decode tokens (totals, per problem, ratio),
   the daemon's wall and CPU seconds (CPU = process_time of the whole daemon
   process, an energy proxy) and their ratios, on the same problems. With
   --baseline-subset N the baseline runs on a seeded random subset of N
   problems (it costs ~50 ms per token: up to ~25 s a problem); the ratios
   then compare the same N problems both ways and the output says so.
2. Held-out (default 24 problems, 8 of each kind): new problems of the same
   kinds, never deposited: arith and units with new numbers (the library only
   shows worked examples), facts asking another attribute of an island whose
   record is quoted in a library entry's verified solution. Each is asked
   without a library (plain generation) and with the library of its kind
   grafted as context (`Ask` with library_tag: one artifact per tag, built
   once), both with a --heldout-budget token budget (default 256), scored by
   the lenient rule above.

Run: .venv/bin/python bench/flywheel.py [--recurring 54] [--heldout 24]
     [--baseline-subset N] [--heldout-budget 256]
Last stdout line: one JSON object with recurring_accuracy_with,
recurring_accuracy_without, decode_tokens_with, decode_tokens_without,
heldout_accuracy_with, heldout_accuracy_without, and the other figures.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from kvgraft import AskResult, Client
from kvgraftd.library.format import normalize_answer
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready
from kvgraftd.testing.flywheel_problems import KINDS, Problem, heldout, recurring

ROOT = Path(__file__).resolve().parent.parent

MODEL_CACHE = ROOT / ".cache" / "models"
BASELINE_BUDGET = 512
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def solved(text: str, answer: str) -> bool:
    """Lenient scoring of free text: the last number, or the answer as a word."""
    if _NUMBER.fullmatch(answer):
        numbers = _NUMBER.findall(text)
        return bool(numbers) and numbers[-1].replace(",", "").rstrip(".") == answer
    return re.search(rf"\b{re.escape(answer)}\b", text, re.IGNORECASE) is not None


def recalled(response: AskResult, problem: Problem) -> bool:
    return response.path == "recall" and normalize_answer(response.answer) == normalize_answer(
        problem.answer
    )


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def totals(responses: list[AskResult]) -> dict[str, float]:
    return {
        "decode_tokens": sum(r.decode_tokens for r in responses),
        "wall_s": sum(r.wall_s for r in responses),
        "cpu_s": sum(r.cpu_s for r in responses),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recurring", type=int, default=54)
    parser.add_argument("--heldout", type=int, default=24)
    parser.add_argument("--baseline-subset", type=int, default=0, help="0: every problem")
    parser.add_argument("--heldout-budget", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    problems = recurring(args.recurring, args.seed)
    new_problems = heldout(problems, args.heldout, args.seed + 1)
    subset = list(range(len(problems)))
    if args.baseline_subset and args.baseline_subset < len(problems):
        subset = sorted(random.Random(args.seed).sample(subset, args.baseline_subset))
    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-"))
    model_args = ["--model", "", "--model-cache", str(MODEL_CACHE)]
    daemon = DaemonProcess.start(work / "data", model_args)
    result: dict[str, object] = {}
    try:
        wait_model_ready(daemon.address, 600)
        with Client(daemon.address, timeout_s=600, transfer_timeout_s=3600) as client:
            started = time.perf_counter()
            for problem in problems:
                client.library_add(
                    problem.problem,
                    problem.solution,
                    problem.answer,
                    verified_by="python",
                    tags=[problem.kind, "flywheel"],
                )
            deposit_s = time.perf_counter() - started
            log(f"deposited {len(problems)} verified solutions in {deposit_s:.1f} s")

            with_library = []
            for problem in problems:
                response = client.ask(problem.problem)
                with_library.append(response)
                if not recalled(response, problem):
                    log(f"  recall MISSED: {problem.problem!r} -> {response.answer!r}")
            log("recurring with the library: done")

            without = {}
            for number, index in enumerate(subset, 1):
                problem = problems[index]
                response = client.ask(
                    problem.problem, max_new_tokens=BASELINE_BUDGET, no_recall=True
                )
                without[index] = response
                log(
                    f"  baseline {number}/{len(subset)}: {response.decode_tokens} tokens, "
                    f"{'solved' if solved(response.answer, problem.answer) else 'wrong'}"
                )

            held = {"with": [], "without": []}
            for number, problem in enumerate(new_problems, 1):
                plain = client.ask(
                    problem.problem, max_new_tokens=args.heldout_budget, no_recall=True
                )
                grafted = client.ask(
                    problem.problem, max_new_tokens=args.heldout_budget, library_tag=problem.kind
                )
                assert grafted.path == "library" and plain.path == "generate"
                held["without"].append(solved(plain.answer, problem.answer))
                held["with"].append(solved(grafted.answer, problem.answer))
                log(
                    f"  held-out {number}/{len(new_problems)} ({problem.kind}): without "
                    f"{held['without'][-1]}, with {held['with'][-1]} "
                    f"({plain.decode_tokens} / {grafted.decode_tokens} tokens)"
                )
                result.setdefault("library_context_tokens", {})[problem.kind] = (
                    grafted.receipt.reused_tokens
                )
    finally:
        daemon.stop()

    correct_with = [recalled(r, p) for r, p in zip(with_library, problems, strict=True)]
    correct_without = {i: solved(r.answer, problems[i].answer) for i, r in without.items()}
    same_with = totals([with_library[i] for i in subset])
    same_without = totals([without[i] for i in subset])
    all_with = totals(with_library)
    n, m = len(problems), len(subset)
    result.update(
        recurring_accuracy_with=round(sum(correct_with) / n, 4),
        recurring_accuracy_without=round(sum(correct_without.values()) / m, 4),
        decode_tokens_with=all_with["decode_tokens"],
        decode_tokens_without=same_without["decode_tokens"],
        heldout_accuracy_with=round(sum(held["with"]) / len(new_problems), 4),
        heldout_accuracy_without=round(sum(held["without"]) / len(new_problems), 4),
        recurring_problems=n,
        baseline_problems=m,
        baseline_budget_tokens=BASELINE_BUDGET,
        decode_tokens_per_problem_with=round(all_with["decode_tokens"] / n, 3),
        decode_tokens_per_problem_without=round(same_without["decode_tokens"] / m, 3),
        decode_token_ratio=round(same_without["decode_tokens"] / same_with["decode_tokens"], 2),
        wall_s_with=round(same_with["wall_s"], 3),
        wall_s_without=round(same_without["wall_s"], 3),
        wall_ratio=round(same_without["wall_s"] / same_with["wall_s"], 2),
        cpu_s_with=round(same_with["cpu_s"], 3),
        cpu_s_without=round(same_without["cpu_s"], 3),
        cpu_ratio=round(same_without["cpu_s"] / same_with["cpu_s"], 2),
        max_decode_tokens_with=max(r.decode_tokens for r in with_library),
        deposit_s=round(deposit_s, 2),
        heldout_problems=len(new_problems),
        heldout_budget_tokens=args.heldout_budget,
    )
    for kind in KINDS:
        picked = [i for i, p in enumerate(new_problems) if p.kind == kind]
        for way in ("with", "without"):
            hits = sum(held[way][i] for i in picked)
            result[f"heldout_{kind}_{way}"] = f"{hits}/{len(picked)}"
    scope = "every problem" if m == n else f"a seeded random subset of {m} of {n} problems"
    print(f"recurring: {n} problems deposited once, asked again (baseline on {scope})")
    print(
        f"  with the library:    accuracy {sum(correct_with)}/{n}, "
        f"{all_with['decode_tokens']} decode tokens ({all_with['decode_tokens'] / n:.2f} per "
        f"problem, max {result['max_decode_tokens_with']})"
    )
    print(
        f"  without (512 budget): accuracy {sum(correct_without.values())}/{m}, "
        f"{same_without['decode_tokens']} decode tokens ({same_without['decode_tokens'] / m:.1f} "
        "per problem)"
    )
    print(
        f"  same {m} problems: decode tokens x{result['decode_token_ratio']}, wall "
        f"{same_without['wall_s']:.1f} s vs {same_with['wall_s']:.2f} s (x{result['wall_ratio']}),"
        f" daemon CPU {same_without['cpu_s']:.1f} s vs {same_with['cpu_s']:.2f} s "
        f"(x{result['cpu_ratio']})"
    )
    print(
        f"held-out: {len(new_problems)} new problems, budget {args.heldout_budget} tokens: "
        f"accuracy with the library as context {sum(held['with'])}/{len(new_problems)}, "
        f"without {sum(held['without'])}/{len(new_problems)}"
    )
    for kind in KINDS:
        print(
            f"  {kind}: with {result[f'heldout_{kind}_with']}, "
            f"without {result[f'heldout_{kind}_without']}"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
