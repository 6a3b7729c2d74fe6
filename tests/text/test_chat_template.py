"""Chat templates rendered by kvgraft.text exactly as transformers renders them.

The oracle is transformers' own `apply_chat_template` (a dev dependency, never the
daemon's): for every template in ../shared/vocab/templates and a set of multi-turn
conversations (with and without a system turn, ending on a user's or the assistant's
turn, with a Qwen 3 reasoning field, with and without the generation prompt), kvgraft's
rendering equals transformers' character for character, or both refuse (a template's
raise_exception: Gemma 2 has no system role). Sandbox: a template cannot reach Python's
internals, and one that does not compile is refused naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgraft.text.chat_template import ChatTemplate, TemplateFailure, stability

TEMPLATES = Path(__file__).resolve().parents[2].parent / "shared" / "vocab" / "templates"
NAMES = sorted(path.stem for path in TEMPLATES.glob("*.jinja")) if TEMPLATES.is_dir() else []
TOKENS = {"bos_token": "<BOS>", "eos_token": "<EOS>"}
EXTRA = {"date_string": "26 Jul 2024"}  # Llama 3.x writes today's date otherwise

SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "hi"}],
    "system and user": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    "three turns, system": [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "  Another, with spaces and <b>HTML</b>?\n"},
    ],
    "five turns": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "five"},
    ],
    "ends on the assistant": [
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "Yes."},
    ],
    "reasoning kept": [
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Let me see."},
        {"role": "user", "content": "Again?"},
    ],
}

needs_templates = pytest.mark.skipif(not NAMES, reason=f"{TEMPLATES} is not here")


@pytest.fixture(scope="module")
def oracle():
    """A transformers tokenizer with the same special tokens, for its renderer only."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE({"<BOS>": 0, "<EOS>": 1, "a": 2}, []))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **TOKENS)


def _rendered(render, *args, **kwargs) -> tuple[str, str]:
    """("text", the rendering) or ("refused", "") where the template raised."""
    try:
        return "text", render(*args, **kwargs)
    except Exception as refused:  # the oracle raises jinja2's, kvgraft TemplateFailure
        assert "template" in type(refused).__name__.lower() or "Template" in str(type(refused))
        return "refused", ""


@needs_templates
@pytest.mark.parametrize("name", NAMES)
def test_every_template_renders_as_transformers_renders_it(oracle, name: str) -> None:
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    ours = ChatTemplate(source, name)
    rendered = 0
    for title, messages in CONVERSATIONS.items():
        for prompt in (True, False):
            expected = _rendered(
                oracle.apply_chat_template,
                messages,
                chat_template=source,
                tokenize=False,
                add_generation_prompt=prompt,
                **EXTRA,
            )
            got = _rendered(ours.render, messages, prompt, **TOKENS, **EXTRA)
            assert got == expected, f"{name}, {title}, generation prompt {prompt}"
            rendered += got[0] == "text"
    assert rendered >= 6, f"{name} rendered too few conversations to compare"


def test_a_template_cannot_reach_pythons_internals() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateFailure):
        ChatTemplate(escape).render([{"role": "user", "content": "hi"}])
    namespace = "{% set ns = namespace(_secret=1) %}{{ ns._secret }}"
    with pytest.raises(TemplateFailure):
        ChatTemplate(namespace).render([])


def test_a_template_that_does_not_compile_or_raises_is_refused_naming_it() -> None:
    with pytest.raises(TemplateFailure, match=r"broken\.jinja.*does not compile"):
        ChatTemplate("{% for m in messages %}", "broken.jinja")
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}", "strict.jinja")
    with pytest.raises(TemplateFailure, match="roles must alternate"):
        raising.render([])
    with pytest.raises(TemplateFailure, match="has no chat template"):
        ChatTemplate("", "vocab.gguf")


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("{{ messages | length / 0 }}", "ZeroDivisionError"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ 'a' * 10000000000 }}", "repeats a sequence past"),
    ],
)
def test_a_template_whose_code_fails_is_refused_not_an_internal_error(source, said) -> None:
    """Regression (review): only jinja2's own errors became a TemplateFailure; a template's
    ZeroDivisionError reached the caller as an internal error (and broke Info for good)."""
    with pytest.raises(TemplateFailure, match=said):
        ChatTemplate(source, "t.jinja").render([{"role": "user", "content": "x"}])
    assert stability(source, "t.jinja").startswith("the probe conversation was refused")


def test_the_stability_probe_names_a_template_that_drops_turns() -> None:
    """Regression (review): a later rendering that is a prefix of the earlier one raised
    StopIteration."""
    said = stability("{{ messages[0]['content'] }}", "first.jinja")
    assert said.startswith("it renders answer 1 otherwise") and "to ''" in said
    assert stability("", "none.jinja") == "none"
    loop = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert stability(loop, "plain.jinja") == "stable"


def test_transformers_generation_blocks_render_their_content() -> None:
    source = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    assert ChatTemplate(source).render([{"role": "assistant", "content": "yes"}]) == "yes"
