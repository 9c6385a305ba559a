"""Chat template rendering, compatible with Hugging Face transformers.

Templates ship in downloaded model directories, so they are untrusted code: they run in
jinja2's immutable sandbox, configured as transformers' environment so a template renders
exactly as `apply_chat_template` does. A template that reads no `tools` variable is given
tools the Hermes way instead (gateway/tools/tool_fallback.py)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.tools import tool_fallback


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. via `raise_exception`) or failed to render."""


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}` tag (training masks) and renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's built-in tojson HTML-escapes '<', '>' and '&'; transformers' does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may read. `render`'s
    text already holds the special tokens the template writes: encode it without adding."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
            # Whether the template reads `tools` at all (as vLLM decides what to pass).
            self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(
                env.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens)

    def render(
        self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """`tools` in `apply_chat_template`'s form; messages may carry `tool_calls`
        (arguments as objects) and `tool` turns, as HF templates read them."""
        extra = {}
        if self.takes_tools:
            extra["tools"] = tools
        else:
            messages = tool_fallback.messages(messages, tools)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self._special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            # A template indexing what a conversation lacks: the caller's input too.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
