"""Chat messages and their content parts, shared by ``/v1/chat/completions``, native ``/generate`` and
``/tokenize``.

Content is a string or a list of parts in OpenAI's shapes: ``{"type": "text", "text"}``, ``{"type": "image_url",
"image_url": {"url", "detail"}}`` (``url`` a ``data:image/...;base64,`` URL, or ``http(s)`` on a host of
``media.allowed_domains``) and ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav" | "mp3" |
"flac" | "ogg"}}``; images and audio only for a model that reads them (``CompositeModel.input_modalities``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationInfo, field_validator

from mstar_dist.events import AUDIO_INPUT_FORMATS
from mstar_dist.server.protocol.base import Body, key_problem

IMAGE_DETAILS = ("auto", "low", "high")
"""``image_url.detail`` values (passed to the family, which may ignore them)."""
PART_TYPES = ("text", "image_url", "input_audio")
PART_INPUT = {"text": "text", "image_url": "image", "input_audio": "audio"}
"""Content part type -> the input modality it carries."""
PART_KEYS = {"text": {"type", "text"}, "image_url": {"type", "image_url"}, "input_audio": {"type", "input_audio"}}
BODY_KEYS = {"image_url": {"url", "detail"}, "input_audio": {"data", "format"}}
MESSAGE_IGNORED = frozenset({"name", "refusal", "audio", "tool_calls", "tool_call_id", "function_call"})
"""Message keys OpenAI clients send that are accepted and ignored: a participant's ``name`` and an earlier
assistant turn's ``refusal``, ``audio`` reference, ``tool_calls`` / ``function_call`` and a tool message's
``tool_call_id`` (tool calling is not implemented yet; the text of every message is kept)."""


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str = Field(min_length=1, description="a data: URL (data:image/png;base64,...), or an http(s) URL on a host "
                                               "the server allows (media.allowed_domains)")
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Body):
    """OpenAI's image content part: ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``."""

    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Body):
    data: str = Field(min_length=1, description="base64 of the audio file")
    format: Literal["wav", "mp3", "flac", "ogg"]


class AudioPart(Body):
    """OpenAI's audio content part: ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]


class ChatMessage(Body):
    """One chat message; content is a string or a list of parts: text, ``image_url`` and ``input_audio`` (OpenAI's
    shapes; images and audio only for a model that takes them). Other keys are a 400, but for
    :data:`MESSAGE_IGNORED`."""

    IGNORED = MESSAGE_IGNORED

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        # Checked up front so a wrong part gets one clear message instead of one error per union branch. A route
        # validates with the context {"model": name, "inputs": what it reads} (``checks.served_context``), so a part
        # the model does not read is named as such before its shape is looked at.
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts (or image_url / input_audio parts, for "
                             f"a model that reads them), got {type(value).__name__}")
        context = info.context or {}
        for i, part in enumerate(value):
            problem = part_problem(part, context.get("model"), context.get("inputs"))
            if problem:
                raise ValueError(f"content[{i}]{problem}")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


def part_problem(part: Any, model: str | None = None, inputs: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with one content part (a message starting at the part's key path), or None. ``inputs``: what
    the served model reads (None: any part type)."""
    kind = part.get("type") if isinstance(part, dict) else None
    kind = kind if isinstance(kind, str) else None
    if inputs is not None and kind in PART_INPUT and PART_INPUT[kind] not in inputs:
        parts = " and ".join(tag for tag, kind_ in PART_INPUT.items() if kind_ in inputs)
        return (f" is an {kind} part, but {model!r} takes only {parts} parts (it reads no "
                f"{'images' if kind == 'image_url' else 'audio'}); leave it out")
    if kind not in PART_TYPES:
        return (f' must be {{"type": "text", "text": "..."}}, {{"type": "image_url", "image_url": {{"url": "..."}}}} '
                f'or {{"type": "input_audio", "input_audio": {{"data": "<base64>", "format": "wav"}}}}, '
                f"got {part!r:.80}")
    unknown = _unknown_keys(part, PART_KEYS[kind])
    if unknown:
        return unknown
    if kind == "text":
        return None if isinstance(part.get("text"), str) else f".text must be a string, got {part.get('text')!r:.40}"
    body = part.get(kind)
    if not isinstance(body, dict):
        return f".{kind} must be an object, got {body!r:.40}"
    unknown = _unknown_keys(body, BODY_KEYS[kind])
    if unknown:
        return f".{kind}{unknown}"
    if kind == "image_url":
        if not isinstance(body.get("url"), str) or not body["url"]:
            return ".image_url.url must be a data: URL or an http(s) URL"
        if body.get("detail") not in (None, *IMAGE_DETAILS):
            return f".image_url.detail {body['detail']!r:.40} is not one of {', '.join(IMAGE_DETAILS)}"
        return None
    if not isinstance(body.get("data"), str) or not body["data"]:
        return ".input_audio.data must be the audio file in base64"
    if body.get("format") not in AUDIO_INPUT_FORMATS:
        return (f".input_audio.format {body.get('format')!r:.40} is not supported; use one of "
                f"{', '.join(AUDIO_INPUT_FORMATS)}")
    return None


def _unknown_keys(obj: dict, known: set[str]) -> str | None:
    """``": unknown field 'x' (did you mean 'y'?)"`` for keys of ``obj`` outside ``known``, else None."""
    problem = key_problem(obj, known)
    return f": {problem[1]}" if problem else None


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the backend takes them: ``{"role", "content": str}``."""
    return [{"role": m.role, "content": m.text()} for m in messages]
