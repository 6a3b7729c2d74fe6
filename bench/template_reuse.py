"""Template reuse bench: how much of a five-turn conversation each real chat template reuses.

For every template in ../shared/vocab/templates, a daemon in its own process serves the
default model (SmolLM2-135M-Instruct, real text) with that template (`--chat-template`,
cache auto), and the official `openai` package holds a five-turn conversation with it
(max_tokens 16, temperature 0; each turn sends the answers so far). Per template:

* `reused` (over HTTP): usage.prompt_tokens_details.cached_tokens summed over turns 2-5,
  over what the earlier turns left to reuse (each previous turn's prompt and answer,
  its stop token included), so 1.0 is every earlier turn grafted; also against the
  prompt tokens of turns 2-5 (`of_prompt`). The templates' markers are SmolLM2's control
  tokens only for the ChatML ones (Qwen, SmolLM3); elsewhere they are text to SmolLM2's
  vocabulary, and where a template's text before an answer ends in whitespace that merges
  otherwise with the answer's first word (Llama 3's "\n\n" under GPT-2's split), reuse
  stops a token short of the answer: a fact of the vocabulary, not the template.
* `plain_ids` and `reasoning_ids` (in-process, the daemon's own code:
  kvgraft.text.chat_tokens): with the template's own family's vocabulary where
  ../shared/vocab has it (Llama 3, Qwen, Phi-3; SmolLM2's for the others), the fraction
  of each earlier turn's ids (the conversation rendered to the end of its answer) that
  the next prompt's ids begin with, for
  plain answers and for answers that open with a reasoning block (`<think>...</think>`,
  as a reasoning model writes). A template that drops earlier reasoning (Qwen 3) reuses
  only up to that answer.
* `info`: what `kvgraft info` says of the template (stable, or how it rewrites turns).

What bounds a fraction below 1: a template that renders an earlier turn otherwise once
the conversation goes on, or an answer whose text tokenizes to other ids than the model
chose (at its edges, next to the template's text). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import openai

from kvgraft import Client
from kvgraft.text.chat_template import first_difference
from kvgraft.text.chat_tokens import ChatTokens, TransformersText
from kvgraft.text.default_model import default_model_path
from kvgraft.text.gguf_tokenizer import GgufTokenizer
from kvgraftd.testing.daemon_process import DaemonProcess, wait_model_ready

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT.parent / "shared" / "vocab" / "templates"
QUESTIONS = [
    "Name three birds.",
    "And three trees?",
    "Which of them lives longest?",
    "Say it in one sentence.",
    "Thanks. One more fact?",
]
REASONING = "<think>\nLet me see.\n</think>\n\n"
CONTEXT = {"date_string": "26 Jul 2024"}
VOCAB = ROOT.parent / "shared" / "vocab"
VOCABULARY = {  # template -> its family's vocabulary in ../shared/vocab
    "meta-llama-Llama-3.1-8B-Instruct": "llama-bpe",
    "meta-llama-Llama-3.2-3B-Instruct": "llama-bpe",
    "Qwen-Qwen2.5-7B-Instruct": "qwen2",
    "Qwen-Qwen3-0.6B": "qwen2",
    "microsoft-Phi-3.5-mini-instruct": "phi-3",
}


def over_http(template: Path, cache: Path, work: Path) -> dict:
    args = ["--model", "", "--model-cache", str(cache), "--cache", "auto"]
    daemon = DaemonProcess.start(work, [*args, "--chat-template", str(template)], timeout_s=600)
    try:
        wait_model_ready(daemon.address, 600)
        api = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="-", max_retries=0)
        model = api.models.list().data[0].id
        messages: list[dict] = []
        usages = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            answer = api.chat.completions.create(
                model=model, messages=messages, max_tokens=16, temperature=0
            )
            usages.append(answer.usage)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        with Client(daemon.address) as client:
            info = client.info().chat_template
    finally:
        daemon.stop()
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages[1:])
    left = sum(u.prompt_tokens + u.completion_tokens for u in usages[:-1])
    prompts = sum(u.prompt_tokens for u in usages[1:])
    turns = [
        [u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens]
        for u in usages
    ]
    return {"reused": cached / left, "of_prompt": cached / prompts, "info": info, "turns": turns}


def own_vocabulary(template: Path) -> GgufTokenizer:
    """The template's family's tokenizer where ../shared/vocab has it, else SmolLM2's."""
    name = VOCABULARY.get(template.stem)
    return GgufTokenizer.load(VOCAB / f"ggml-vocab-{name}.gguf" if name else default_model_path())


def in_process(template: Path, tokenizer: GgufTokenizer, answer_prefix: str) -> float:
    """Over four turns, the fraction of each earlier turn's ids (the conversation rendered
    up to the end of its answer, as the model's context holds it) that the next prompt's
    ids begin with."""
    source = template.read_text()

    def render(messages: list, prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=prompt, chat_template=source, **CONTEXT
        )

    chat = ChatTokens(TransformersText(tokenizer), render, source)
    messages: list[dict] = [{"role": "user", "content": QUESTIONS[0]}]
    kept = offered = 0
    for number, question in enumerate(QUESTIONS[1:], 1):
        messages.append({"role": "assistant", "content": f"{answer_prefix}Answer {number}."})
        earlier = chat.ids(messages, False)
        messages.append({"role": "user", "content": question})
        later = chat.ids(messages, True)
        kept += first_difference(earlier, later)
        offered += len(earlier)
    return kept / offered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-cache", type=Path, default=ROOT / ".cache" / "models")
    parser.add_argument("--only", nargs="*", default=None, help="template names to run")
    args = parser.parse_args(argv)
    if not TEMPLATES.is_dir():
        print(f"template_reuse: {TEMPLATES} is not here", file=sys.stderr)
        return 2
    results = {}
    for template in sorted(TEMPLATES.glob("*.jinja")):
        if args.only and template.stem not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix="kvgraft-reuse-") as work:
            found = over_http(template, args.model_cache, Path(work))
        tokenizer = own_vocabulary(template)
        found["own_vocabulary"] = VOCABULARY.get(template.stem, "smollm2")
        found["plain_ids"] = in_process(template, tokenizer, "")
        found["reasoning_ids"] = in_process(template, tokenizer, REASONING)
        results[template.stem] = found
        print(
            f"{template.stem:<37} http {found['reused']:.3f} (of prompts "
            f"{found['of_prompt']:.3f}); ids with {found['own_vocabulary']}: plain "
            f"{found['plain_ids']:.3f}, reasoning {found['reasoning_ids']:.3f}; "
            f"info: {found['info'][:40]}",
            flush=True,
        )
    print(json.dumps({"bench": "template_reuse", "templates": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
