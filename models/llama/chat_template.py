"""Chat templates (the jinja2 ``chat_template`` of ``tokenizer_config.json``) rendered the way HF transformers renders
them (``transformers.utils.chat_template_utils``): a sandboxed environment with ``trim_blocks``/``lstrip_blocks``,
the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), ``{% generation %}`` blocks rendered as their
body, a ``tojson`` filter that keeps non-ASCII characters and key order (``ensure_ascii=False``,
``sort_keys=False``; ``indent``/``separators`` optional; jinja's own would HTML-escape), and the globals
``raise_exception(message)`` (raises :class:`TemplateRefused`) and ``strftime_now(format)`` (local time). The
variables are HF's: ``messages``, ``tools`` and ``documents`` (None unless given), ``add_generation_prompt``, and
the named special tokens the tokenizer config sets (``bos_token``, ``eos_token``, ``pad_token``, ...; a token it
does not set is undefined, not "").
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRefused(jinja2.exceptions.TemplateError, ValueError):
    """The template called ``raise_exception`` (the messages break its rules, e.g. roles that do not alternate): a
    TemplateError as in HF, and a ValueError so that a request carrying such messages is a 400."""


def _raise_exception(message: str) -> None:
    raise TemplateRefused(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF marks assistant tokens for training with it): the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in HF's environment (module docstring); TemplateSyntaxError for a broken template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(template: jinja2.Template, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                         special_tokens: dict[str, str], tools: list[dict] | None = None,
                         documents: list[dict] | None = None) -> str:
    """``template`` rendered with HF's variables; a ``TemplateError`` raised by the template propagates."""
    return template.render(messages=messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **special_tokens)
