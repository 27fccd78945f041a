"""HTTP protocol types: the OpenAI subset we serve (chat completions, speech, image generations) and the native
``/generate`` API.

Requests are strict (``"5"`` is not an int, ``"yes"`` is not a bool) so a typo fails with a message instead of
being coerced. Chat completion requests reject unknown fields except OpenAI's own (``OPENAI_CHAT_IGNORED``:
clients send many optional ones); the speech and image routes ignore unknown fields. Native requests reject
unknown top-level fields; inside ``model_kwargs`` the sampling knobs are typed here and every other key is the
model family's knob, passed through as JSON and validated by the family (an unknown or out-of-range knob is a 400
naming it).

Media in (a model whose backend lists "image" / "audio" in ``input_modalities``; any other answers a 400): chat
content parts ``{"type": "image_url", "image_url": {"url", "detail"}}`` (``url`` a ``data:image/...;base64,``
URL, or ``http(s)`` on a host of ``media.allowed_domains``) and ``{"type": "input_audio", "input_audio": {"data":
<base64>, "format": "wav" | "mp3" | "flac" | "ogg"}}``, on the chat route and in native ``messages`` alike. Media
out: chat ``modalities: ["text", "audio"]`` with ``audio: {voice, format}`` (:class:`ChatCompletionRequest`).

Native streaming format (NDJSON, ``Content-Type: application/x-ndjson; charset=utf-8``), one JSON object a line,
one line per delta as the model produces it:
    {"modality": "text", "data": <base64 of the UTF-8 text delta>, "metadata": {"request_id", "n_tokens"}}
    {"modality": "audio", "data": <base64 of PCM16 LE>, "metadata": {"sample_rate", "num_channels", ...,
     "request_id", "n_tokens"}}
    {"modality": "image", "data": <base64 of a PNG file>, "metadata": {"width", "height", ..., "request_id",
     "n_tokens"}}
    ... then exactly one final line, either
    {"modality": "text", "data": "", "metadata": {"request_id", "finish_reason", "usage": {...}}}
    or {"modality": "error", "data": "", "metadata": {"request_id", "status", "message"}}
Media metadata is the model's (``mstar_dist.events.MediaDelta``) plus ``request_id`` and ``n_tokens``.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mstar_dist.events import AUDIO_INPUT_FORMATS

# ----------------------------------------------------------------------------------------------- shared

TOP_K_MAX = 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    """OpenAI request types: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


IMAGE_DETAILS = ("auto", "low", "high")
"""``image_url.detail`` values (passed to the family, which may ignore them)."""
PART_TYPES = ("text", "image_url", "input_audio")
_PART_INPUT = {"text": "text", "image_url": "image", "input_audio": "audio"}
"""Content part type -> the input modality it carries."""


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str = Field(min_length=1, description="a data: URL (data:image/png;base64,...), or an http(s) URL on a host "
                                               "the server allows (media.allowed_domains)")
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    """OpenAI's image content part: ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``."""

    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Lenient):
    data: str = Field(min_length=1, description="base64 of the audio file")
    format: Literal["wav", "mp3", "flac", "ogg"]


class AudioPart(_Lenient):
    """OpenAI's audio content part: ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]


class ChatMessage(_Lenient):
    """One chat message; content is a string or a list of parts: text, ``image_url`` and ``input_audio`` (OpenAI's
    shapes; images and audio only for a model that takes them)."""

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
            problem = _part_problem(part, context.get("model"), context.get("inputs"))
            if problem:
                raise ValueError(f"content[{i}]{problem}")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


def _part_problem(part: Any, model: str | None = None, inputs: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with one content part (a message starting at the part's key path), or None. ``inputs``: what
    the served model reads (None: any part type)."""
    kind = part.get("type") if isinstance(part, dict) else None
    kind = kind if isinstance(kind, str) else None
    if inputs is not None and kind in _PART_INPUT and _PART_INPUT[kind] not in inputs:
        parts = " and ".join(tag for tag, kind_ in _PART_INPUT.items() if kind_ in inputs)
        return (f" is an {kind} part, but {model!r} takes only {parts} parts (it reads no "
                f"{'images' if kind == 'image_url' else 'audio'}); leave it out")
    if kind not in PART_TYPES:
        return (f' must be {{"type": "text", "text": "..."}}, {{"type": "image_url", "image_url": {{"url": "..."}}}} '
                f'or {{"type": "input_audio", "input_audio": {{"data": "<base64>", "format": "wav"}}}}, '
                f"got {part!r:.80}")
    if kind == "text":
        return None if isinstance(part.get("text"), str) else f".text must be a string, got {part.get('text')!r:.40}"
    body = part.get(kind)
    if not isinstance(body, dict):
        return f".{kind} must be an object, got {body!r:.40}"
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


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the backend takes them: ``{"role", "content": str}``."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class _NullMeansDefault(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many OpenAI clients send `"temperature": null` etc. for "not set"; treat it as absent.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _SamplingKnobs(_NullMeansDefault):
    """Token sampling fields shared by every route (validated the same way)."""

    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy; at most 2")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass in (0, 1]")
    top_k: int = Field(0, ge=-1, description="0 or -1 disables")
    seed: int | None = None

    def top_k_value(self) -> int:
        """0 for disabled; a k beyond any vocabulary is clamped (it keeps every token either way, and must fit
        the control plane's int64)."""
        return min(max(self.top_k, 0), TOP_K_MAX)


class _Sampling(_SamplingKnobs):
    """Sampling fields of the text routes: the knobs plus stop strings."""

    stop: str | list[str] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if value is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise ValueError(f"stop must be a string or a list of strings, got {value!r:.80}")
        if value is not None and any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ------------------------------------------------------------------------------------------------ OpenAI


class StreamOptions(_Lenient):
    include_usage: bool = False


OPENAI_CHAT_IGNORED = frozenset({
    "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "metadata",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
    "response_format", "safety_identifier", "service_tier", "store", "tool_choice", "tools", "top_logprobs", "user",
    "verbosity", "web_search_options",
})
"""OpenAI chat completion fields this server accepts and ignores (clients send them); any other field that is
not one of ours is a 400 naming it, so a typo (``max_token``) is not silently ignored."""


def reject_unknown(data: Any, known: frozenset[str] | set[str]) -> None:
    """A ValueError naming every key of ``data`` outside ``known``, with the closest known name as a hint."""
    if not isinstance(data, dict):
        return
    unknown = [k for k in data if k not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")


CHAT_AUDIO_FORMATS = ("wav", "pcm16")
"""``audio.format`` of a chat completion: a whole WAV file, or raw little-endian PCM16 (the only one streamed)."""


class AudioOutput(_Lenient):
    """Chat ``audio``: how to speak the answer when ``modalities`` holds "audio". ``voice`` is the family's (a 400
    lists its voices; left out, its default voice); ``format`` defaults to "wav", or "pcm16" when streaming."""

    voice: str | None = None
    format: Literal["wav", "pcm16"] | None = None


class ChatCompletionRequest(_Sampling, _Lenient):
    """Unknown fields are rejected (a 400 naming them), except OpenAI's own in :data:`OPENAI_CHAT_IGNORED`.

    ``modalities``: ["text"] (the default) or ["text", "audio"]; with "audio" the answer is also spoken (``audio``
    says how) and comes back as ``message.audio`` (``id``, base64 ``data``, ``transcript``, ``expires_at``) or,
    streamed, as ``delta.audio`` chunks of base64 PCM16 beside the text deltas."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1)
    audio: AudioOutput | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        reject_unknown(data, set(cls.model_fields) | OPENAI_CHAT_IGNORED)
        return data

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (len(set(value)) != len(value) or "text" not in value):
            raise ValueError(f'{value!r} is not supported: use ["text"] or ["text", "audio"]')
        return value

    @model_validator(mode="after")
    def _check_audio_stream(self) -> ChatCompletionRequest:
        if self.stream and self.wants_audio() and self.audio is not None and self.audio.format == "wav":
            raise ValueError('audio.format "wav" cannot be streamed: use "pcm16" with "stream": true')
        return self

    def wants_audio(self) -> bool:
        return self.modalities is not None and "audio" in self.modalities

    def output_modalities(self) -> list[str]:
        return ["text", "audio"] if self.wants_audio() else ["text"]

    def audio_format(self) -> str:
        """The format spoken audio comes back in (see :class:`AudioOutput`)."""
        if self.audio is not None and self.audio.format is not None:
            return self.audio.format
        return "pcm16" if self.stream else "wav"

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens`` (OpenAI's rule)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ChatAudio(BaseModel):
    """``message.audio`` of a chat completion asked for with ``modalities: ["text", "audio"]``."""

    id: str
    data: str
    """base64 of a whole WAV file, or of raw little-endian PCM16 (``audio.format``)."""
    transcript: str
    """What the audio says: the answer's text."""
    expires_at: int
    """Unix time after which the server no longer holds this audio: now (it keeps none, so a later turn must send
    the transcript as the assistant's content)."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    audio: ChatAudio | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event. With ``stream_options.include_usage`` every chunk carries ``usage: null`` and one last
    chunk with empty ``choices`` carries the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mstar_dist"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ------------------------------------------------------------------------------------------ OpenAI media

SPEECH_FORMATS = ("wav", "pcm")
"""``response_format`` values of ``/v1/audio/speech``: a WAV file, or raw little-endian PCM16."""
SIZE_PATTERN = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


def _one_of(value: Any, allowed: tuple[str, ...]) -> Any:
    if value not in allowed:
        raise ValueError(f"{value!r} is not supported; use " + " or ".join(repr(a) for a in allowed))
    return value


class SpeechRequest(_SamplingKnobs, _Lenient):
    """``POST /v1/audio/speech``: OpenAI's fields, plus ``stream``, ``seed`` and the sampling knobs.

    ``voice`` goes to the model family (``model_kwargs["voice"]``), which rejects an unknown voice with a 400
    listing its voices; left out, the family's default voice speaks. ``instructions`` is rejected when non-empty
    (no family here takes free-text voice directions, and ignoring them would silently give another voice).
    ``stream_format`` may be "audio" (raw bytes, what we always send); "sse" is rejected. Streaming is asked for
    with ``stream: true``.
    """

    model: str | None = None
    input: str = Field(min_length=1)
    voice: str | None = None
    response_format: str = "wav"
    speed: float = 1.0
    instructions: str | None = None
    stream_format: str | None = None
    stream: bool = False

    @field_validator("response_format")
    @classmethod
    def _check_format(cls, value: str) -> str:
        return _one_of(value, SPEECH_FORMATS)

    @field_validator("speed")
    @classmethod
    def _check_speed(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError(f"{value} is not supported: only 1.0 (the model speaks at its own rate)")
        return value

    @field_validator("instructions")
    @classmethod
    def _check_instructions(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported by this server: choose the voice with 'voice' and leave instructions out")
        return value

    @field_validator("stream_format")
    @classmethod
    def _check_stream_format(cls, value: str | None) -> str | None:
        if value not in (None, "audio"):
            raise ValueError(f"{value!r} is not supported: audio is sent as raw bytes (\"audio\"); "
                             "set \"stream\": true to receive it as it is generated")
        return value


class ImageGenerationRequest(_NullMeansDefault, _Lenient):
    """``POST /v1/images/generations``: OpenAI's fields plus ``seed``, ``steps`` and ``guidance_scale``.

    ``size`` "WIDTHxHEIGHT" becomes the family's ``width`` / ``height`` knobs ("auto" or left out: the family's
    default); the family checks which sizes, step counts and guidance scales it supports (a 400 naming the knob).
    Images come back inline as base64 PNG only.
    """

    model: str | None = None
    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=4, description="images to generate, 1 to 4")
    size: str | None = None
    response_format: str = "b64_json"
    output_format: str = "png"
    stream: bool = False
    seed: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None

    @field_validator("size")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        if value not in (None, "auto") and not SIZE_PATTERN.match(value):
            raise ValueError(f"{value!r} is not a size: write WIDTHxHEIGHT in pixels, e.g. \"64x64\"")
        return value

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: str) -> str:
        if value != "b64_json":
            raise ValueError(f"{value!r} is not supported: only 'b64_json' (images are returned inline as "
                             "base64 PNG; this server keeps no files to link to)")
        return value

    @field_validator("output_format")
    @classmethod
    def _check_output_format(cls, value: str) -> str:
        return _one_of(value, ("png",))

    @field_validator("stream")
    @classmethod
    def _check_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("streaming images is not supported: leave stream out or false")
        return value

    def family_knobs(self) -> dict[str, Any]:
        """``width``, ``height``, ``steps``, ``guidance_scale`` as far as the request gives them."""
        knobs: dict[str, Any] = {}
        match = SIZE_PATTERN.match(self.size or "")
        if match:
            knobs["width"], knobs["height"] = int(match[1]), int(match[2])
        if self.steps is not None:
            knobs["steps"] = self.steps
        if self.guidance_scale is not None:
            knobs["guidance_scale"] = self.guidance_scale
        return knobs


class ImageData(BaseModel):
    b64_json: str
    """base64 of a PNG file."""


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    size: str | None = None


# ------------------------------------------------------------------------------------------------ native


class ModelKwargs(_Sampling):
    """``model_kwargs`` of ``/generate``: typed sampling fields, and every other key is the family's knob."""

    model_config = ConfigDict(strict=True, extra="allow")

    max_tokens: int | None = Field(None, gt=0)

    def family_knobs(self) -> dict[str, Any]:
        """The keys beyond sampling, as sent (JSON values; a null value counts as not sent)."""
        return dict(self.model_extra or {})


class GenerateRequest(_Strict):
    """``POST /generate``: exactly one of ``prompt`` / ``messages``. Images and audio go in ``messages`` as content
    parts (OpenAI's shapes: ``image_url``, ``input_audio``), or as files in a ``multipart/form-data`` body (see
    ``server/app.py``). ``modalities``: what to produce (the model's default when absent), e.g. ["text", "audio"]
    for a model that can also speak; the voice is ``model_kwargs.voice``."""

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    model: str | None = None
    stream: bool = False
    modalities: list[Literal["text", "audio", "image"]] | None = Field(None, min_length=1)
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
    model_kwargs: ModelKwargs = Field(default_factory=ModelKwargs)

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"{value!r} names a modality twice")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            given = "both" if self.prompt is not None else "neither"
            raise ValueError(f"give exactly one of 'prompt' (a string) or 'messages' (a chat list); got {given}")
        return self


class GenerateOutput(BaseModel):
    modality: str
    data: str
    """base64 of the output bytes (UTF-8 text for modality "text")."""
    metadata: dict[str, Any] = Field(default_factory=dict)


class GenerateResponse(BaseModel):
    request_id: str
    text: str
    finish_reason: str
    usage: Usage
    outputs: list[GenerateOutput]


class StreamLine(BaseModel):
    """One NDJSON line of a streamed ``/generate`` response (see the module docstring)."""

    modality: str
    data: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)
