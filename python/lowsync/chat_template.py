"""Chat templates: a GGUF file's `tokenizer.chat_template` (Jinja) rendered into prompt text.

Why: an instruction-tuned model answers well only to the exact text layout it was trained on
(role markers, BOS, the assistant's opening); the model's authors ship that layout as a Jinja
template written for Hugging Face transformers, and converters copy it into the GGUF file.
Rendering it the way transformers does is what makes a lowsync prompt the model's own.

Strategy: Jinja2's `ImmutableSandboxedEnvironment` (a template is data from a downloaded file:
it may not reach Python objects or mutate the caller's messages) set up as transformers sets
it up — `trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
block that renders its body, a `tojson` filter that does not HTML-escape, and the globals
`raise_exception` and `strftime_now`. The variables are `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, `tools` and `documents` (None unless given), plus the caller's
extras. Compiled templates are cached by their source text.

Invariants: every failure — a syntax error, an undefined name used wrongly, an exception the
template raises itself, a sandbox violation — is a `ChatTemplateError` (a `TokenizerError`)
naming where the template came from; nothing here tokenizes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lowsync.tokenizer import TokenizerError

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "render_chat_template"]

#: ChatML, the layout of Qwen, SmolLM and many fine-tunes: `<|im_start|>role\ncontent<|im_end|>\n`
#: per message, then `<|im_start|>assistant\n` when a reply is wanted. lowsync never picks it on
#: its own; pass it as `template=` for a model known to use ChatML that ships no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(TokenizerError):
    """A chat template that could not be rendered. `raised_by_template` holds the message when
    the template itself called `raise_exception` (e.g. "System role not supported"), None for
    any other failure."""

    def __init__(self, message: str, raised_by_template: str | None = None) -> None:
        super().__init__(message)
        self.raised_by_template = raised_by_template


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(message)` raises inside a template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: plain JSON, not Jinja's HTML-escaped `Markup`
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks
    in transformers; rendering it is rendering its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it a set

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    source: str = "the given chat template",
    **extra: Any,
) -> str:
    """Renders a chat template as Hugging Face transformers' `apply_chat_template` does.

    Example::

        text = render_chat_template(CHATML_TEMPLATE, [{"role": "user", "content": "Hi"}])
        # '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'

    `source` names the template in errors. Raises `ChatTemplateError`.
    """
    if not isinstance(template, str):
        raise ChatTemplateError(f"{source}: a chat template is a str, not {type(template)}")
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{source}: the chat template does not parse (line {e.lineno}: {e.message})"
        ) from e
    variables: dict[str, Any] = {
        "messages": list(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": None if tools is None else list(tools),
        "documents": None,
    }
    variables.update(extra)
    try:
        return compiled.render(**variables)
    except _TemplateRaised as e:
        raise ChatTemplateError(
            f"{source}: the chat template refused this conversation: {e.message}",
            raised_by_template=str(e.message),
        ) from e
    except Exception as e:  # a template is code from the file: any failure is its error
        raise ChatTemplateError(
            f"{source}: the chat template failed: {type(e).__name__}: {e}"
        ) from e
