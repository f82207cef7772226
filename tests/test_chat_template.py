"""Chat templates: every template llama.cpp b11434 tests (`models/templates/*.jinja`) renders
a standard conversation, SmolLM2's own template gives ChatML, and failures are clear errors.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from lowsync.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat_template
from lowsync.tokenizer import Tokenizer, TokenizerError
from testdata import llama_cpp_models, smollm2_gguf

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first addend."},
                "b": {"type": "integer", "description": "The second addend."},
            },
            "required": ["a", "b"],
        },
    },
}

# What the templates that do not render the plain conversation need, as transformers users
# must supply it: a tool list (tool-use variants iterate `tools`), firefunction's own
# variables `functions` (its tool list as JSON text) and `datetime` (today, as text), or no
# system message (Gemma 2 raises "System role not supported").
NEEDS = {
    "CohereForAI-c4ai-command-r-plus-tool_use": "tools",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "tools",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "tools",
    "fireworks-ai-llama-3-firefunction-v2": "functions and datetime",
    "google-gemma-2-2b-it": "no system message",
}


def render_standard(template: str) -> tuple[str, str | None]:
    """The standard conversation rendered the way a caller would get it rendered: as is, then
    with what the template asks for. Returns the text and what was needed (None: nothing)."""
    common: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>"}
    try:
        return render_chat_template(template, CONVERSATION, **common), None
    except ChatTemplateError as e:
        if e.raised_by_template is not None:
            # the template refuses this conversation itself: try it without a system message
            return render_chat_template(template, CONVERSATION[1:], **common), "no system message"
        first = e
    try:
        return render_chat_template(template, CONVERSATION, tools=[TOOL], **common), "tools"
    except ChatTemplateError:
        pass
    try:
        functions = json.dumps([TOOL["function"]], indent=2)
        extra = {"functions": functions, "datetime": "1 January 2026"}
        text = render_chat_template(template, CONVERSATION, **extra, **common)
        return text, "functions and datetime"
    except ChatTemplateError:
        raise first from None


def templates() -> list[Path]:
    return sorted((llama_cpp_models() / "templates").glob("*.jinja"))


def test_every_llama_cpp_template_renders_a_standard_conversation() -> None:
    paths = templates()
    assert len(paths) == 71
    needed: dict[str, str] = {}
    for path in paths:
        template = path.read_text(encoding="utf-8")
        text, need = render_standard(template)
        if need is not None:
            needed[path.stem] = need
        # every message's content is in the prompt (a system message the template was not
        # given aside), and it ends ready for the assistant's reply
        for m in CONVERSATION[1:] if need == "no system message" else CONVERSATION:
            assert m["content"] in text, f"{path.name}: {m['content']!r} is not in the prompt"
        assert text.index("What is 2+2?") < text.index("And 3+3?"), path.name
        assert not text.endswith("And 3+3?"), f"{path.name}: no generation prompt"
    assert needed == NEEDS


def test_smollm2_template_is_chatml() -> None:
    tok = Tokenizer.from_gguf(smollm2_gguf())
    assert tok.chat_template is not None
    prompt = tok.apply_chat_template(CONVERSATION)
    assert prompt == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt == render_chat_template(CHATML_TEMPLATE, CONVERSATION)
    # without a system message, SmolLM2's template writes its own
    default = tok.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False)
    assert default == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )
    # the prompt tokenizes with its markers as the control tokens they are
    ids = tok.encode(prompt, add_special=False, parse_special=True)
    assert ids[0] == tok.bos_id == 1
    assert ids.count(1) == 5
    assert ids.count(2) == 4
    assert tok.decode(ids) == prompt


def test_a_model_without_a_template_is_a_clear_error() -> None:
    tok = Tokenizer.from_gguf(llama_cpp_models() / "ggml-vocab-llama-spm.gguf")
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match=r"llama-spm\.gguf: key `tokenizer\.chat_template`"):
        tok.apply_chat_template(CONVERSATION)
    text = tok.apply_chat_template(CONVERSATION, template=CHATML_TEMPLATE)
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------- no data needed


def test_chatml_template() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat_template(CHATML_TEMPLATE, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat_template(CHATML_TEMPLATE, messages, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_transformers_environment() -> None:
    template = (
        "{% for m in messages %}"
        "{{ m.content | tojson }}"  # no HTML escaping, non-ASCII kept
        "{% if loop.index == 1 %}{% continue %}{% endif %}"  # loopcontrols
        "{% generation %}[{{ m.role }}]{% endgeneration %}"
        "{% endfor %}"
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson(indent=1) }}|{{ extra }}|"
        "{{ strftime_now('%Y') }}"
    )
    msgs = [{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "é"}]
    out = render_chat_template(
        template, msgs, tools=[{"x": 1}], bos_token="<s>", eos_token="</s>", extra=7
    )
    year = datetime.now().year
    assert out in (
        f'"<a & b>""é"[assistant]<s>|</s>|[\n {{\n  "x": 1\n }}\n]|7|{y}' for y in (year, year + 1)
    )


def test_a_template_that_raises_names_its_message() -> None:
    template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(ChatTemplateError, match="System role not supported") as e:
        render_chat_template(template, CONVERSATION, source="model.gguf")
    assert e.value.raised_by_template == "System role not supported"
    assert str(e.value).startswith("model.gguf: ")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}", "does not parse"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ tools | length }}", "TypeError"),  # tools is None unless given
        # the sandbox: no Python internals, no changes to the caller's objects
        ("{{ messages.__class__.__mro__ }}", "SecurityError|UndefinedError|access"),
        ("{% set _ = messages[0].update({'role': 'x'}) %}", "SecurityError|unsafe"),
        ("{{ ''.__class__.__subclasses__() }}", "SecurityError|UndefinedError|access"),
    ],
)
def test_template_failures_are_clear_errors(template: str, match: str) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError, match=match) as e:
        render_chat_template(template, messages, source="t.jinja")
    assert e.value.raised_by_template is None
    assert messages == [{"role": "user", "content": "Hi"}]
