"""The OpenAI media routes' types: ``POST /v1/audio/speech`` and ``POST /v1/images/generations``. Unknown keys are a
400 naming them (``voise`` -> "did you mean 'voice'?"); OpenAI's options that are not implemented are a 400 unless
they ask for nothing."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from mstar_dist.server.protocol.base import Body, Unsupported
from mstar_dist.server.protocol.sampling import INT64_MAX, INT64_MIN, SamplingKnobs

SPEECH_FORMATS = ("wav", "pcm")
"""``response_format`` values of ``/v1/audio/speech``: a WAV file, or raw little-endian PCM16."""
SIZE_PATTERN = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


def _one_of(value: Any, allowed: tuple[str, ...]) -> Any:
    if value not in allowed:
        raise ValueError(f"{value!r} is not supported; use " + " or ".join(repr(a) for a in allowed))
    return value


class SpeechRequest(SamplingKnobs):
    """``POST /v1/audio/speech``: OpenAI's fields, plus ``stream``, ``seed`` and the sampling knobs (temperature,
    top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty: top-level keys, as OpenAI-compatible
    speech servers take extra parameters; a knob left out takes the model family's default).

    ``voice`` goes to the model family (``model_kwargs["voice"]``), which rejects an unknown voice with a 400
    listing its voices; left out, the family's default voice speaks. ``instructions`` is rejected when non-empty
    (no family here takes free-text voice directions, and ignoring them would silently give another voice).
    ``stream_format`` may be "audio" (raw bytes, what we always send); "sse" is rejected. Streaming is asked for
    with ``stream: true``.
    """

    IGNORED = frozenset({"user"})

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


class ImageGenerationRequest(Body):
    """``POST /v1/images/generations``: OpenAI's fields plus ``negative_prompt``, ``seed``, ``steps`` and
    ``guidance_scale``.

    ``size`` "WIDTHxHEIGHT" becomes the family's ``width`` / ``height`` knobs ("auto" or left out: the family's
    default); the family checks which sizes, step counts and guidance scales it supports (a 400 naming the field).
    Images come back inline as base64 PNG only.
    """

    NULL_MEANS_DEFAULT = True
    IGNORED = frozenset({"user"})
    UNSUPPORTED = {
        "quality": Unsupported("the model draws at one quality; use steps", "auto", "standard"),
        "style": Unsupported("the model has one style; describe it in the prompt"),
        "background": Unsupported("images are drawn opaque", "auto", "opaque"),
        "moderation": Unsupported("this server does not moderate images", "auto"),
        "output_compression": Unsupported("images are lossless PNG", 100),
        "partial_images": Unsupported("images are not streamed", 0),
    }

    model: str | None = None
    prompt: str = Field(min_length=1)
    negative_prompt: str | None = Field(None, description="what the picture should not show (classifier-free "
                                                          "guidance's unconditional branch)")
    n: int = Field(1, ge=1, le=4, description="images to generate, 1 to 4")
    size: str | None = None
    response_format: str = "b64_json"
    output_format: str = "png"
    stream: bool = False
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX - 4)
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
        """``width``, ``height``, ``steps``, ``guidance_scale``, ``negative_prompt`` as far as the request gives
        them."""
        knobs: dict[str, Any] = {}
        match = SIZE_PATTERN.match(self.size or "")
        if match:
            knobs["width"], knobs["height"] = int(match[1]), int(match[2])
        if self.steps is not None:
            knobs["steps"] = self.steps
        if self.guidance_scale is not None:
            knobs["guidance_scale"] = self.guidance_scale
        if self.negative_prompt is not None:
            knobs["negative_prompt"] = self.negative_prompt
        return knobs


class ImageData(BaseModel):
    b64_json: str
    """base64 of a PNG file."""


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    size: str | None = None
