"""The native ``POST /generate``: any modality, a prompt or chat messages, the sampling knobs and the model family's
own in ``model_kwargs``.

Native streaming format (NDJSON, ``Content-Type: application/x-ndjson; charset=utf-8``), one JSON object a line,
one line per delta as the model produces it:
    {"modality": "text", "data": <the text delta>, "metadata": {"encoding": "utf-8", "request_id", "n_tokens"}}
    {"modality": "audio", "data": <base64 of PCM16 LE>, "metadata": {"encoding": "base64", "sample_rate",
     "num_channels", ..., "request_id", "n_tokens"}}
    {"modality": "image", "data": <base64 of a PNG file>, "metadata": {"encoding": "base64", "width", "height", ...,
     "request_id", "n_tokens"}}
    ... then exactly one final line, either
    {"modality": "text", "data": "", "metadata": {"request_id", "finish_reason", "usage": {...}}}
    or {"modality": "error", "data": "", "metadata": {"request_id", "status", "message"}}
``metadata.encoding`` says how ``data`` is written: text as itself (UTF-8 in the JSON), media as base64. Servers
before it wrote text as base64 too, without the key: a client that finds no ``encoding`` decodes base64. The whole
response (``stream: false``) has the same ``outputs`` entries. Media metadata is the model's
(``mstar_dist.events.MediaDelta``) plus ``request_id`` and ``n_tokens``.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mstar_dist.server.protocol.base import Body, Unsupported, Usage, key_error, reject_unknown
from mstar_dist.server.protocol.messages import ChatMessage
from mstar_dist.server.protocol.sampling import SAMPLING_UNSUPPORTED, ExtraSampling

TEXT_ENCODING = "utf-8"
MEDIA_ENCODING = "base64"
"""``metadata.encoding`` of a ``/generate`` output: text is sent as itself, audio and images as base64."""
TYPO_CUTOFF = 0.8
"""How close (difflib's ratio) an unknown ``model_kwargs`` key must be to a sampling field to be taken for a typo of
it when the family does not list its knobs (0.8 takes ``max_token`` for ``max_tokens`` but not ``steps`` for
``stop``)."""
TYPO_CACHE = 1024
"""How many ``model_kwargs`` keys :func:`typo_of` remembers (a client may send any key: bounded)."""

NATIVE_UNSUPPORTED = {
    **SAMPLING_UNSUPPORTED,
    **{name: Unsupported("use POST /v1/completions or /v1/chat/completions for log-probabilities")
       for name in ("logprobs", "top_logprobs", "prompt_logprobs", "echo")},
    "n": Unsupported("one answer per request: send the request again, or use n on /v1/completions", 1),
}


class ModelKwargs(ExtraSampling):
    """``model_kwargs`` of ``/generate``: the sampling fields (those of the OpenAI routes, vLLM's extra parameters and
    structured outputs), ``max_tokens``, and the model family's own knobs (``voice``, ``width``...).

    A key that is neither is a 400 naming it when the served model lists its knobs (the backend's ``model_knobs``,
    in the validation context as "knobs"); for a model that does not, a key within :data:`TYPO_CUTOFF` of a sampling
    field is a 400 (``max_token``: "did you mean 'max_tokens'?") and any other goes to the family, which checks it."""

    model_config = ConfigDict(strict=True, extra="allow")
    UNSUPPORTED = NATIVE_UNSUPPORTED

    max_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _screen_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.field_keys()
        knobs = (info.context or {}).get("knobs")
        if knobs is not None:
            reject_unknown(data, fields | set(knobs), cls.UNSUPPORTED)
        else:
            reject_unknown({k: v for k, v in data.items() if k in fields or k in cls.UNSUPPORTED}, fields,
                           cls.UNSUPPORTED)
            for key in data:
                close = None if key in fields or key in cls.UNSUPPORTED else typo_of(str(key), fields)
                if close is not None:
                    raise key_error(str(key), f"unknown field {key!r} (did you mean {close!r}?)")
        return {k: v for k, v in data.items() if v is not None and k not in cls.UNSUPPORTED}

    def family_knobs(self) -> dict[str, Any]:
        """The keys beyond sampling, as sent (JSON values; a null value counts as not sent)."""
        return dict(self.model_extra or {})


@functools.lru_cache(maxsize=TYPO_CACHE)
def typo_of(key: str, fields: frozenset[str]) -> str | None:
    """The field ``key`` is a typo of (within :data:`TYPO_CUTOFF`), or None. Asked only for a key that is no field,
    and remembered: difflib's comparisons cost far more than the rest of a request's validation, and a family's
    knobs come back with every request."""
    close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=TYPO_CUTOFF)
    return close[0] if close else None


class GenerateRequest(Body):
    """``POST /generate``: exactly one of ``prompt`` / ``messages``. Images and audio go in ``messages`` as content
    parts (OpenAI's shapes: ``image_url``, ``input_audio``), or as files in a ``multipart/form-data`` body (see
    ``server/native.py``). ``modalities``: what to produce (the model's default when absent), e.g. ["text", "audio"]
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
    """The text itself for modality "text"; base64 of the output bytes for audio and images
    (``metadata.encoding``)."""
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
