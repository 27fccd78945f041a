"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, an earlier assistant turn's
``tool_calls`` and the response's, in OpenAI's shapes.

``tools`` reach the model's chat template (its ``tools`` variable) as the client wrote them; the answer is parsed for
calls in the model's own format (``server/tool_calls.py``). ``tool_choice``: "none" (the model answers in text, the
tools are still shown to it, as vLLM does), "auto" (the default when tools are given: the model chooses),
"required" (at least one call) or ``{"type": "function", "function": {"name": ...}}`` (exactly one call of that
function); the last two are enforced by a grammar built from the tools' parameters.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from mstar_dist.server.protocol.base import Body, key_error

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function's name."""
TOOL_CHOICES = ("none", "auto", "required")


class FunctionDefinition(Body):
    """``tools[].function``: its ``parameters`` are a JSON schema of the arguments object (none: no arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not FUNCTION_NAME.match(value):
            raise ValueError(f"{value!r:.80} is not a function name: 1 to 64 letters, digits, '_' or '-'")
        return value


class Tool(Body):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition

    def template_value(self) -> dict[str, Any]:
        """The tool as the chat template sees it: as the client wrote it, without unset keys."""
        return self.model_dump(exclude_none=True)


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(Body):
    """An earlier assistant turn's ``tool_calls[].function``: ``arguments`` is a JSON object as text."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: str) -> str:
        _object_text(value)
        return value

    def arguments_value(self) -> dict[str, Any]:
        """The arguments as an object, the way chat templates write them (``tojson``)."""
        return _object_text(self.arguments)


def _object_text(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"arguments must be a JSON object as text: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object as text, got {type(value).__name__}")
    return value


class ToolCallIn(Body):
    """An earlier assistant turn's ``tool_calls[]``, as the client sends it back."""

    id: str
    type: Literal["function"]
    function: CalledFunction

    def template_value(self) -> dict[str, Any]:
        """The call as chat templates read it: ``{"id", "type", "function": {"name", "arguments": {...}}}``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments_value()}}


class ToolFields(Body):
    """The tool-calling fields of a chat completion request (a base of ``ChatCompletionRequest``)."""

    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in TOOL_CHOICES:
            raise ValueError(f"{value!r:.40} is not a tool_choice: use none, auto, required or "
                             '{"type": "function", "function": {"name": ...}}')
        return value

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ToolFields:
        names = [tool.function.name for tool in self.tools or ()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise key_error("tools", f"tools defines function {twice[0]!r} more than once")
        mode = self.tool_mode()
        if mode in ("required", "named") and not self.tools:
            raise key_error("tool_choice", f'tool_choice {"required" if mode == "required" else "naming a function"}'
                                           " needs tools")
        forced = self.forced_function()
        if forced is not None and forced not in names:
            raise key_error("tool_choice", f"tool_choice names function {forced!r}, which tools does not define "
                                           f"(it defines {', '.join(map(repr, names))})")
        return self

    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named": what ``tool_choice`` asks for (its default is "auto" with tools,
        "none" without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_values(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template sees them, or None."""
        return [tool.template_value() for tool in self.tools] if self.tools else None

    def forced_function(self) -> str | None:
        """The function a named ``tool_choice`` asks for."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """``message.tool_calls[]`` of a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
