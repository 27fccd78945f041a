"""Tool calls in the model's own output format (docs/architecture.md §9): which format a served model writes, the
grammar that makes it write calls (``tool_choice`` "required" or a named function), and the parser that splits its
text into content and calls, token by token as it streams or whole.

Formats, by vLLM's ``--tool-call-parser`` names:
  * ``hermes`` (Qwen 2.5 / 3, Hermes, and every ChatML model whose template teaches it):
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, text before them is
    content;
  * ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): an answer that starts with a JSON object (after an optional
    ``<|python_tag|>``) is calls, ``{"name": ..., "parameters": {...}}`` separated by ``"; "``; any other answer is
    content.
Both accept either ``arguments`` or ``parameters`` for the arguments when parsing. A deployment chooses with
``server.tool_call_parser`` (default "auto": from the chat template; "none": tools are refused).

A call's ``arguments`` are the exact text the model wrote for the arguments object, streamed as it is written (the
``delta.tool_calls`` chunks concatenate to the whole call's), so the streamed and the whole answers agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from mstar_dist.config.deployment import TOOL_CALL_PARSER_SETTINGS

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""The tool-call formats this server parses."""
PARSER_SETTINGS = TOOL_CALL_PARSER_SETTINGS
"""Values of ``server.tool_call_parser``: "auto", "none" and ``TOOL_CALL_PARSERS``."""
ARGUMENT_KEYS = ("arguments", "parameters")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How a forced call's JSON is laid out (llguidance's options in the schema's ``x-guidance``): ``json.dumps``'s
layout, as the structured outputs' (engine/grammar.py), so the model cannot spend its tokens on whitespace."""
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""The arguments schema of a function that declares none."""


@dataclass(frozen=True)
class ToolFormat:
    """How one family of models writes its calls."""

    name: str
    args_key: str
    """The arguments' key in the grammar of a forced call (the parser accepts both ``ARGUMENT_KEYS``)."""
    open_tag: str
    """What precedes each call ("" for none)."""
    close_tag: str
    """What follows each call ("" for none)."""
    separator: str
    """Between two calls in a forced answer."""


FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n"),
    "llama3_json": ToolFormat("llama3_json", "parameters", "", "", "; "),
}
PYTHON_TAG = "<|python_tag|>"
"""Llama 3's marker before a call (a special token: present only when special tokens are kept)."""


def default_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, or None when it shows none (then tools are refused)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or ("<|start_header_id|>" in chat_template and "tools" in chat_template):
        return "llama3_json"
    return None


def resolve_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser a deployment uses: ``setting`` (``server.tool_call_parser``), "auto" read from the chat template;
    None: tools are refused. ValueError naming the key for a value not in ``PARSER_SETTINGS``."""
    if setting not in PARSER_SETTINGS:
        raise ValueError(f"server.tool_call_parser: {setting!r} is not one of {', '.join(PARSER_SETTINGS)}")
    if setting == "auto":
        return default_parser(chat_template)
    return None if setting == "none" else setting


def forced_grammar(parser: str, tools: list[dict[str, Any]], only: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are calls in ``parser``'s format of the functions of
    ``tools`` (``only``: that one function, exactly one call), their arguments following each function's
    ``parameters`` schema; ``parallel`` False: exactly one call."""
    fmt = FORMATS[parser]
    calls = []
    for tool in tools:
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        calls.append({"type": "object", "properties": {
            "name": {"const": function["name"]}, fmt.args_key: function.get("parameters") or EMPTY_PARAMETERS},
            "required": ["name", fmt.args_key], "additionalProperties": False})
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_LAYOUT
    call = " ".join(part for part in (_lark_text(fmt.open_tag), "body", _lark_text(fmt.close_tag)) if part)
    start = "call" if only is not None or not parallel else f"call ({_lark_text(fmt.separator)} call)*"
    return f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


def _lark_text(text: str) -> str:
    return json.dumps(text) if text else ""


@dataclass
class CallDelta:
    """What one step of parsing adds to call ``index``: its ``id`` and ``name`` (the first time, with
    ``arguments`` "") or more of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def chunk(self) -> dict[str, Any]:
        """The ``delta.tool_calls[]`` entry of a streamed chunk (OpenAI's shape)."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def message(self) -> dict[str, Any]:
        """``message.tool_calls[]`` of a whole response."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = str | CallDelta
"""What the parser hands on: content text, or a step of a call."""


class CallScanner:
    """One JSON object as it is written, character by character: its ``name`` as soon as the value is complete, the
    raw text of its arguments' value as far as it has come, and where the object ends."""

    def __init__(self) -> None:
        self.raw = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.key_start: int | None = None
        self.key: str | None = None
        self.value_key: str | None = None
        """The key whose value is being read (at the object's top level)."""
        self.value_start: int | None = None
        self.name: str | None = None
        self.args: tuple[int, int | None] | None = None
        """(start, end) of the arguments' raw text in ``raw``; end None while it is being written."""
        self.args_quoted = False
        """The arguments were written as a JSON string holding the object (some models do): decoded at the end."""
        self.done = False

    def feed(self, text: str) -> int:
        """Take ``text`` up to the end of the object; how many characters were taken."""
        for i, c in enumerate(text):
            self.raw += c
            self._step(c, len(self.raw) - 1)
            if self.done:
                return i + 1
        return len(text)

    def _step(self, c: str, p: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.key_start is not None:
                    self.key, self.key_start = json.loads(self.raw[self.key_start:p + 1]), None
                elif self.depth == 1 and self.value_start is not None:
                    self._value_ends(p + 1)
            return
        top = self.depth == 1
        if c == '"':
            self.in_string = True
            if top and self.value_key is None:
                self.key_start = p
            elif top:
                self._value_starts(p)
        elif c in "{[":
            if top and self.value_key is not None:
                self._value_starts(p)
            self.depth += 1
        elif c in "}]":
            if top and self.value_key is not None and self.value_start is not None:
                self._value_ends(p)  # a number, true, false or null just ended
            self.depth -= 1
            if self.depth == 1 and self.value_start is not None:
                self._value_ends(p + 1)
            self.done = self.depth <= 0
        elif top and c == ":" and self.key is not None:
            self.value_key, self.key = self.key, None
        elif top and c == ",":
            if self.value_start is not None:
                self._value_ends(p)
            self.value_key = None
        elif top and self.value_key is not None and self.value_start is None and not c.isspace():
            self._value_starts(p)

    def _value_starts(self, p: int) -> None:
        if self.value_start is None:
            self.value_start = p
            if self.value_key in ARGUMENT_KEYS:
                self.args, self.args_quoted = (p, None), self.raw[p] == '"'

    def _value_ends(self, end: int) -> None:
        start, key = self.value_start, self.value_key
        text = self.raw[start:end].rstrip()
        if key == "name":
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
        elif key in ARGUMENT_KEYS:
            self.args = (start, start + len(text))
        self.value_start = None
        self.value_key = None

    def arguments(self) -> str:
        """The arguments' text so far ("" before they start; a quoted one only once it is whole)."""
        if self.args is None:
            return ""
        start, end = self.args
        if self.args_quoted:
            if end is None:
                return ""
            try:
                value = json.loads(self.raw[start:end])
            except ValueError:
                return self.raw[start:end]
            return value if isinstance(value, str) else self.raw[start:end]
        return self.raw[start:end if end is not None else len(self.raw)]

    def valid(self) -> bool:
        """Whether the whole object is JSON with a name."""
        try:
            json.loads(self.raw)
        except ValueError:
            return False
        return self.name is not None


@dataclass
class ToolCallParser:
    """Splits one choice's text into content and calls of ``parser``'s format as it comes (``feed``, then
    ``close``); the pieces of a whole text are those of its deltas."""

    parser: str
    calls: list[ParsedCall] = field(default_factory=list)
    """The calls begun so far (a call is begun once its name is known)."""
    _buf: str = ""
    _state: str = "start"
    _scanner: CallScanner | None = None
    _sent: int = 0
    """Characters of the current call's arguments handed on."""
    _scanner_call: bool = False
    """Whether the object being scanned has begun a call (its name is known)."""
    _lead: str = ""
    """The whitespace between the current call's tag and its object (content again if it is no call)."""

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            taken = self._advance(out)
            if not taken:
                break
        return _joined(out)

    def close(self) -> list[Piece]:
        """What is held back at the end: a partial tag or an unfinished call that never named its function are
        content."""
        out: list[Piece] = []
        if self._state == "call" and self._scanner is not None and self._current() is None:
            out.append(self._call_text(self._scanner.raw + self._buf))
        elif self._state in ("content", "after_content", "plain", "start") and self._buf:
            out.append(self._buf)
        self._buf = ""
        return _joined([p for p in out if not (isinstance(p, str) and p == "")])

    def _current(self) -> ParsedCall | None:
        """The call the scanner reads, once begun."""
        return self.calls[-1] if self._scanner is not None and self._scanner_call else None

    def _call_text(self, raw: str) -> str:
        return ("<tool_call>" if self.parser == "hermes" else "") + self._lead + raw

    def _advance(self, out: list[Piece]) -> bool:
        """One move of the state machine over ``_buf``; False when it must wait for more text."""
        if self._state == "plain":
            out.append(self._buf)
            self._buf = ""
            return True
        if self._state == "call":
            return self._in_call(out)
        if self._state == "after":
            return self._after_call(out)
        if self.parser == "hermes":
            return self._hermes_content(out)
        return self._llama_start(out)

    def _hermes_content(self, out: list[Piece]) -> bool:
        tag = "<tool_call>"
        at = self._buf.find(tag)
        if at >= 0:
            out.append(self._content(self._buf[:at]))
            self._buf = self._buf[at + len(tag):]
            self._begin_call()
            return True
        held = _partial_suffix(self._buf, tag)
        out.append(self._content(self._buf[:len(self._buf) - held]))
        self._buf = self._buf[len(self._buf) - held:]
        return False

    def _content(self, text: str) -> str:
        """Content after a call keeps nothing but what is not whitespace."""
        if self._state == "after_content":
            text = text.lstrip()
            if text:
                self._state = "content"
        return text

    def _llama_start(self, out: list[Piece]) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(stripped):
            return False  # blank so far, or a partial tag
        if not stripped:
            return False
        if stripped[0] == "{":
            self._lead, self._buf = self._buf[:len(self._buf) - len(stripped)], stripped
            self._begin_call()
        else:
            self._state = "plain"
        return True

    def _begin_call(self) -> None:
        self._state, self._scanner, self._sent, self._scanner_call, self._lead = "call", CallScanner(), 0, False, ""

    def _in_call(self, out: list[Piece]) -> bool:
        scanner = self._scanner
        if not scanner.raw:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            if stripped[0] != "{":  # not a call after all: its text is content
                self._state = "plain" if self.parser == "llama3_json" else "content"
                out.append(self._call_text(""))
                return True
            self._lead, self._buf = self._buf[:len(self._buf) - len(stripped)], stripped
        taken = scanner.feed(self._buf)
        self._buf = self._buf[taken:]
        if scanner.name is not None and not self._scanner_call:
            call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", scanner.name)
            self.calls.append(call)
            self._scanner_call = True
            out.append(CallDelta(len(self.calls) - 1, call.id, call.name))
        if self._scanner_call:
            args = scanner.arguments()
            if scanner.done and scanner.args is None:
                args = "{}"
            if len(args) > self._sent:
                self.calls[-1].arguments += args[self._sent:]
                out.append(CallDelta(len(self.calls) - 1, arguments=args[self._sent:]))
                self._sent = len(args)
        if scanner.done:
            if not self._scanner_call:  # an object without a name: its text is content
                out.append(self._call_text(scanner.raw))
            self._state = "after"
            return True
        return False

    def _after_call(self, out: list[Piece]) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if self.parser == "hermes":
            tag = "</tool_call>"
            if stripped.startswith(tag):
                stripped = stripped[len(tag):]
            elif tag.startswith(stripped):
                return False
            self._buf, self._state = stripped, "after_content"
            return True
        if stripped[0] == ";":
            self._buf = stripped[1:]
            self._begin_call()
        else:
            self._buf, self._state = stripped, "plain"
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be coming)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content pieces as one, empty ones left out."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += piece
                continue
        out.append(piece)
    return out


def parse_whole(parser: str, text: str) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole answer."""
    p = ToolCallParser(parser)
    pieces = p.feed(text) + p.close()
    return "".join(piece for piece in pieces if isinstance(piece, str)), p.calls
