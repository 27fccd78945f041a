"""The OpenAI media routes: ``POST /v1/audio/speech`` and ``POST /v1/images/generations``.

Speech needs a backend whose model produces audio (``output_modalities``): the response is a WAV file or raw
PCM16, whole, or streamed as the audio deltas arrive (``"stream": true``). Images need one that produces "image":
``n`` backend requests run concurrently and come back as base64 PNG. Both keep OpenAI's error body; request
checking and the relay guarantees (abort on disconnect, errors per request) are the app's (``checks``, ``relay``).
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mstar_dist.media.wav import wav_bytes, wav_header
from mstar_dist.server.backend import Finished, GenerationBackend, GenerationEvent, GenerationParams, MediaDelta
from mstar_dist.server.checks import (
    REQUEST_ID_HEADER, ApiError, check_modality, check_model, family_field, header_request_id, parse_body,
)
from mstar_dist.server.http_metrics import HttpStats
from mstar_dist.server.openapi import body_doc
from mstar_dist.server.protocol import ImageData, ImageGenerationRequest, ImagesResponse, SpeechRequest
from mstar_dist.server.relay import (
    ClosingStreamingResponse, StreamAborted, collect, events, run_all, start_stream, until_disconnect,
)

logger = logging.getLogger(__name__)

SPEECH_MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
DEFAULT_SAMPLE_RATE = 24000
"""Sample rate written in the (empty) WAV header when a model yields no audio at all: there is no delta to take
it from, and with no samples it changes nothing audible (24 kHz is OpenAI's PCM rate)."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SPEECH_FIELDS = {"voice": "voice"}
IMAGE_FIELDS = {"width": "size", "height": "size", "steps": "steps", "guidance_scale": "guidance_scale",
                "negative_prompt": "negative_prompt"}
"""The family's knobs -> the request fields they come from (a family's 400 about a knob names the field)."""


@dataclass(frozen=True)
class AudioFormat:
    sample_rate: int
    num_channels: int

    @classmethod
    def of(cls, delta: MediaDelta, request_id: str) -> AudioFormat:
        """The format an audio delta's metadata declares (``num_channels`` defaults to 1); missing or invalid
        metadata is the model's fault (500)."""
        rate, channels = delta.metadata.get("sample_rate"), delta.metadata.get("num_channels", 1)
        if not (_positive_whole(rate) and _positive_whole(channels)):
            raise ApiError(500, f"request {request_id}: the model's audio has no valid sample_rate/num_channels "
                                f"metadata ({delta.metadata!r:.120})")
        return cls(int(rate), int(channels))

    def headers(self) -> dict[str, str]:
        """Response headers telling raw-PCM clients how to play the body."""
        return {"X-Sample-Rate": str(self.sample_rate), "X-Num-Channels": str(self.num_channels)}


def _positive_whole(value: object) -> bool:
    """An int, or a float with a whole value (24000.0 from a config file), above 0; not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and float(value).is_integer()


def _is_audio(event: GenerationEvent) -> bool:
    return isinstance(event, MediaDelta) and event.modality == "audio"


def join_audio(media: list[MediaDelta], request_id: str = "") -> tuple[bytes, AudioFormat | None]:
    """All audio deltas' PCM, concatenated in order, and their format (None when there is no audio). Deltas
    that disagree on the format are a model bug (500)."""
    audio = [m for m in media if m.modality == "audio"]
    if not audio:
        return b"", None
    fmt = AudioFormat.of(audio[0], request_id)
    for delta in audio[1:]:
        _check_same_format(fmt, delta, request_id)
    return b"".join(m.data for m in audio), fmt


def _check_same_format(fmt: AudioFormat, delta: MediaDelta, request_id: str) -> None:
    other = AudioFormat.of(delta, request_id)
    if other != fmt:
        raise ApiError(500, f"request {request_id}: the model changed audio format mid-request ({fmt} then {other})")


def add_media_routes(app: FastAPI, backend: GenerationBackend, stats: HttpStats) -> None:
    """Registers the speech and image routes on ``app`` (runs on the HTTP server's loop, like the app)."""

    @app.post("/v1/audio/speech", openapi_extra=body_doc(SpeechRequest))
    async def speech(request: Request) -> Response:
        check_modality(backend, "audio")
        req = await parse_body(request, SpeechRequest)
        check_model(req.model, backend)
        request_id = header_request_id(request) or uuid.uuid4().hex
        params = _speech_params(req, request_id, backend)
        headers = {REQUEST_ID_HEADER: request_id}
        media_type = SPEECH_MEDIA_TYPES[req.response_format]
        if req.stream:
            try:
                stream, first = await start_stream(request, backend, params, stats, first=_is_audio)
            except ApiError as exc:
                raise family_field(exc, SPEECH_FIELDS) from None
            try:
                fmt = AudioFormat.of(first, request_id) if _is_audio(first) else AudioFormat(DEFAULT_SAMPLE_RATE, 1)
            except ApiError:
                await stream.aclose()
                raise
            body = _speech_body(stream, first, fmt, wav=req.response_format == "wav", request_id=request_id)
            return ClosingStreamingResponse(body, stats=stats, media_type=media_type, headers=headers | fmt.headers())
        try:
            outcome = await until_disconnect(request, collect(events(backend, params)), stats)
        except ApiError as exc:
            raise family_field(exc, SPEECH_FIELDS) from None
        pcm, fmt = join_audio(outcome.media, request_id)
        fmt = fmt or AudioFormat(DEFAULT_SAMPLE_RATE, 1)
        content = wav_file(pcm, fmt, request_id) if req.response_format == "wav" else pcm
        return Response(content, media_type=media_type, headers=headers | fmt.headers())

    @app.post("/v1/images/generations", openapi_extra=body_doc(ImageGenerationRequest))
    async def images(request: Request) -> JSONResponse:
        check_modality(backend, "image")
        req = await parse_body(request, ImageGenerationRequest)
        check_model(req.model, backend)
        request_id = header_request_id(request) or uuid.uuid4().hex
        batch = [_image_params(req, request_id, i, backend) for i in range(req.n)]
        try:
            pngs = await until_disconnect(request, run_all([_one_image(backend, params) for params in batch]), stats)
        except ApiError as exc:
            raise _image_error(exc, req) from None
        data = [ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in pngs]
        size = req.size if req.size not in (None, "auto") else None
        body = ImagesResponse(created=int(time.time()), data=data, size=size)
        return JSONResponse(body.model_dump(exclude_none=True), headers={REQUEST_ID_HEADER: request_id})


# ------------------------------------------------------------------------------------------------ speech


def _speech_params(req: SpeechRequest, request_id: str, backend: GenerationBackend) -> GenerationParams:
    """The text to speak as the prompt; ``voice`` as the family's knob; the sampling knobs as on the text routes
    (those left out take the family's defaults, e.g. its model card's); the token budget is the service's limit
    (``max_tokens_given=False``: the family bounds the audio length itself)."""
    return GenerationParams(
        request_id=request_id, prompt=req.input, messages=None,
        max_tokens=backend.max_tokens_limit, max_tokens_given=False, stream=req.stream,
        model_kwargs={"voice": req.voice} if req.voice is not None else {}, output_modalities=["audio"],
        **req.knob_fields(),
    )


def wav_file(pcm: bytes, fmt: AudioFormat, request_id: str) -> bytes:
    """``pcm`` as a WAV file; a format WAV cannot hold is the model's fault (500)."""
    try:
        return wav_bytes(pcm, fmt.sample_rate, fmt.num_channels)
    except ValueError as exc:
        raise ApiError(500, f"request {request_id}: the model's audio cannot be written as WAV: {exc}") from exc


async def _speech_body(stream: AsyncIterator[GenerationEvent], first: GenerationEvent, fmt: AudioFormat, *,
                       wav: bool, request_id: str) -> AsyncIterator[bytes]:
    """A streamed speech body: for WAV the streaming-form header (sizes unknown), then each audio delta's PCM
    as it arrives; text deltas are left out. With no audio at all, an exact empty WAV (or nothing, for PCM).

    A failure after the 200 went out is logged and raises :class:`StreamAborted`: the connection is dropped
    before the last chunk, so the client sees a truncated transfer rather than a complete-looking file.
    """
    try:
        if isinstance(first, Finished):
            if wav:
                yield wav_header(fmt.sample_rate, fmt.num_channels, 0)
            return
        if wav:
            yield wav_header(fmt.sample_rate, fmt.num_channels, None)
        event = first
        while not isinstance(event, Finished):
            if _is_audio(event):
                _check_same_format(fmt, event, request_id)
                yield event.data
            event = await stream.__anext__()
    except ApiError as exc:
        logger.error("speech request %s failed after its audio started streaming: [%d] %s", request_id,
                     exc.status, exc.message)
        raise StreamAborted(exc.message) from exc
    finally:
        await stream.aclose()


# ------------------------------------------------------------------------------------------------ images


def _image_params(req: ImageGenerationRequest, request_id: str, i: int,
                  backend: GenerationBackend) -> GenerationParams:
    """Image ``i`` of the request: id ``<request_id>-<i>``, seed ``seed + i`` when a seed is given (so the n
    images differ but the whole batch is reproducible), the family's knobs from size/steps/guidance_scale."""
    return GenerationParams(
        request_id=f"{request_id}-{i}", prompt=req.prompt, messages=None,
        max_tokens=backend.max_tokens_limit, max_tokens_given=False,
        seed=None if req.seed is None else req.seed + i, model_kwargs=req.family_knobs(), output_modalities=["image"],
    )


def _image_error(exc: ApiError, req: ImageGenerationRequest) -> ApiError:
    """The family's complaint about a knob as the client wrote it: ``width`` / ``height`` came from ``size`` (a 400
    naming ``size``), ``steps`` and ``guidance_scale`` are the request's own fields."""
    named = family_field(exc, IMAGE_FIELDS)
    if named.param != "size":
        return named
    if req.size in (None, "auto"):
        return exc  # the family's own default size: not the client's doing
    return ApiError(400, f"size {req.size!r} is not supported: {exc.message}", "size", exc.headers)


async def _one_image(backend: GenerationBackend, params: GenerationParams) -> bytes:
    """The PNG of one request: its last image delta (a family may send previews first)."""
    outcome = await collect(events(backend, params))
    images = [m for m in outcome.media if m.modality == "image"]
    if not images:
        raise ApiError(500, f"request {params.request_id} finished ({outcome.finish.finish_reason}) without "
                            "producing an image")
    if not images[-1].data.startswith(PNG_SIGNATURE):
        raise ApiError(500, f"request {params.request_id} produced an image that is not a PNG file")
    return images[-1].data
