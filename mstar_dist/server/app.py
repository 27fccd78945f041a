"""The HTTP front end on rank 0: native ``/generate``, OpenAI ``/v1`` routes, ``/health``, ``/metrics``.

The app validates requests (``checks``), turns them into :class:`GenerationParams` and relays the backend's
events (``relay``). Its guarantees (docs/architecture.md §9, §10):
  * bad input is a 4xx saying what to fix, never a 500, and never affects other requests or ``/health``;
  * a backend failure is a 5xx (or the ``BackendError``'s status) for that request only;
  * the backend generator is always closed; when the client goes away before the end it is closed early,
    which aborts the request in the backend.
Error bodies: ``{"error": {"message", "type", "param", "code"}}`` on ``/v1`` routes, ``{"error": "..."}``
elsewhere. The speech and image routes live in ``media_routes``.
"""

from __future__ import annotations

import base64
import functools
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mstar_dist import trace
from mstar_dist.config.deployment import MediaConfig
from mstar_dist.server.backend import BackendError, Finished, GenerationBackend, GenerationParams, MediaDelta, TextDelta
from mstar_dist.server.checks import (
    REQUEST_ID_HEADER, ApiError, check_modality, check_model, check_outputs, error_body, header_request_id, max_tokens,
    parse_body, parse_json, served_context,
)
from mstar_dist.server.direct import DirectRoutes
from mstar_dist.server.guard import GuardMiddleware
from mstar_dist.server.media_input import gather_media, media_limits, read_multipart
from mstar_dist.server.openapi import body_doc, install_openapi, multipart_doc
from mstar_dist.server.http_metrics import HttpStats, StatsMiddleware
from mstar_dist.server.http_server import HttpServer
from mstar_dist.server.media_routes import DEFAULT_SAMPLE_RATE, AudioFormat, add_media_routes, join_audio, wav_file
from mstar_dist.server.protocol import (
    AssistantMessage,
    ChatAudio,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    ChunkDelta,
    ErrorResponse,
    GenerateOutput,
    GenerateRequest,
    GenerateResponse,
    ImageGenerationRequest,
    ModelCard,
    ModelList,
    SpeechRequest,
    StreamLine,
    Usage,
    normalize_messages,
)
from mstar_dist.server.relay import (
    ClientGone, ClosingStreamingResponse, Outcome, collect, events, start_stream, until_disconnect,
)

__all__ = ["build_app", "HttpServer", "NDJSON_MEDIA_TYPE", "SSE_MEDIA_TYPE"]

logger = logging.getLogger(__name__)

NDJSON_MEDIA_TYPE = "application/x-ndjson; charset=utf-8"
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


DEFAULT_MAX_BODY_BYTES = 8 << 20

GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/audio/speech", "/v1/images/generations")
"""The POST routes ``DirectRoutes`` serves without FastAPI's routing (each handler takes the ``Request`` alone)."""


def build_app(backend: GenerationBackend, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, stats: HttpStats | None = None,
              media: MediaConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``backend``. Runs on the loop of the server that hosts it (``HttpServer``).

    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (401 without).
    ``max_body_bytes``: larger request bodies get a 413. ``stats``: where the app counts its HTTP requests (a new
    ``HttpStats`` by default; an intake process shares its own with its backend, which reports them). ``media``:
    the deployment's ``media:`` section (limits on images and audio in requests, hosts of image URLs; its defaults
    when None)."""
    app = FastAPI(title="mstar_dist", version="0.1.0")
    stats = stats if stats is not None else HttpStats()
    media = media if media is not None else MediaConfig()
    # innermost first: the generation routes skip FastAPI's router and request layers (server/direct.py)
    app.add_middleware(DirectRoutes, fastapi_app=app, paths=GENERATION_PATHS)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(StatsMiddleware, stats=stats)  # added last: outermost, so it counts 401s and 413s too
    _add_error_handlers(app)
    _add_ops_routes(app, backend, stats)
    _add_chat_route(app, backend, stats, media)
    _add_generate_route(app, backend, stats, media, max_body_bytes)
    add_media_routes(app, backend, stats)
    install_openapi(app, backend, [GenerateRequest, ChatCompletionRequest, SpeechRequest, ImageGenerationRequest],
                    api_key=bool(api_key), media=media)
    return app


def _add_ops_routes(app: FastAPI, backend: GenerationBackend, stats: HttpStats) -> None:
    """``/health``, ``/metrics`` (the backend's series, then this app's HTTP ones unless the backend's hold them
    already) and ``/v1/models``."""
    created = int(time.time())
    merged = getattr(backend, "http_stats_merged", False)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            serving, reason = backend.health()
        except Exception as exc:  # noqa: BLE001 -- a failing probe means "not serving", with the reason
            serving, reason = False, f"health check failed: {type(exc).__name__}: {exc}"
        if serving:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = backend.metrics_text()
        if inspect.isawaitable(text):  # an intake asks the conductor
            try:
                text = await text
            except BackendError as exc:  # it did not answer in time
                raise ApiError(exc.status, exc.message) from None
        if text and not text.endswith("\n"):
            text += "\n"
        if not merged:
            text += stats.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=backend.model_name, created=created, max_model_len=backend.max_context_tokens)
        return JSONResponse(ModelList(data=[card]).model_dump())


def _add_chat_route(app: FastAPI, backend: GenerationBackend, stats: HttpStats, media: MediaConfig) -> None:
    """OpenAI's ``/v1/chat/completions``: one choice, streamed as server-sent events or whole; spoken too when the
    request asks for ``modalities: ["text", "audio"]``."""

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic() if trace.ON else 0.0
        check_modality(backend, "text")
        req = await parse_body(request, ChatCompletionRequest, served_context(backend))
        check_model(req.model, backend)
        if req.n != 1:
            raise ApiError(400, f"n is {req.n}; only n=1 (one choice per request) is supported", "n")
        request_id = header_request_id(request) or uuid.uuid4().hex
        params = await _chat_params(req, request_id, backend, media)
        reply = _ChatReply(f"chatcmpl-{request_id}", int(time.time()), backend.model_name)
        audio_id = f"audio-{request_id}" if req.wants_audio() else None
        headers = {REQUEST_ID_HEADER: request_id}
        if trace.ON:
            _trace_prepared(arrived, request_id, "/v1/chat/completions")
        if req.stream:
            stream, first = await start_stream(request, backend, params, stats)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = reply.sse(stream, first, include_usage=include_usage, audio_id=audio_id)
            return ClosingStreamingResponse(body, stats=stats, media_type=SSE_MEDIA_TYPE, headers=headers)
        outcome = await until_disconnect(request, collect(events(backend, params)), stats)
        audio = _chat_audio(audio_id, req.audio_format(), outcome, request_id) if audio_id else None
        return JSONResponse(reply.body(outcome, audio), headers=headers)


async def _chat_params(req: ChatCompletionRequest, request_id: str, backend: GenerationBackend,
                       media: MediaConfig) -> GenerationParams:
    """The chat request as the backend takes it: its media fetched and checked, the voice as the family's knob."""
    if req.wants_audio():
        check_outputs(backend, ["audio"], "modalities")
    items = await gather_media(req.messages, backend, media)
    voice = req.audio.voice if req.wants_audio() and req.audio is not None else None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return GenerationParams(
        request_id=request_id,
        prompt=None,
        messages=normalize_messages(req.messages),
        max_tokens=max_tokens(req.requested_max_tokens(), backend, param),
        max_tokens_given=req.requested_max_tokens() is not None,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k_value(),
        seed=req.seed,
        stop=req.stop_list(),
        stream=req.stream,
        model_kwargs={"voice": voice} if voice is not None else {},
        media=items,
        media_limits=media_limits(media) if items else None,
        output_modalities=req.output_modalities(),
    )


def _add_generate_route(app: FastAPI, backend: GenerationBackend, stats: HttpStats, media: MediaConfig,
                        max_body_bytes: int) -> None:
    """The native ``/generate``: any modality, streamed as NDJSON lines or whole; a JSON body, or for a model that
    takes media a ``multipart/form-data`` body (the JSON in its ``request`` field, files in ``image`` / ``audio``
    fields, added to the last user message in the order sent: ``media_input.read_multipart``)."""

    @app.post("/generate", openapi_extra=body_doc(GenerateRequest, multipart_doc(backend)))
    async def generate(request: Request) -> Response:
        arrived = time.monotonic() if trace.ON else 0.0
        uploads = []
        if request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data":
            text, uploads = await read_multipart(request, media, max_body_bytes)
            req = parse_json(text, GenerateRequest, "the 'request' field", context=served_context(backend))
        else:
            req = await parse_body(request, GenerateRequest, served_context(backend))
        check_model(req.model, backend)
        check_outputs(backend, req.modalities, "modalities")
        kw = req.model_kwargs
        request_id = req.request_id or header_request_id(request) or uuid.uuid4().hex
        items = await gather_media(req.messages, backend, media, uploads)
        params = GenerationParams(
            request_id=request_id,
            prompt=req.prompt,
            messages=normalize_messages(req.messages) if req.messages is not None else None,
            max_tokens=max_tokens(kw.max_tokens, backend, "model_kwargs.max_tokens"),
            max_tokens_given=kw.max_tokens is not None,
            temperature=kw.temperature,
            top_p=kw.top_p,
            top_k=kw.top_k_value(),
            seed=kw.seed,
            stop=kw.stop_list(),
            stream=req.stream,
            model_kwargs=kw.family_knobs(),
            media=items,
            media_limits=media_limits(media) if items else None,
            output_modalities=req.modalities,
        )
        headers = {REQUEST_ID_HEADER: request_id}
        if trace.ON:
            _trace_prepared(arrived, request_id, "/generate")
        if req.stream:
            stream, first = await start_stream(request, backend, params, stats)
            body = _ndjson_body(stream, first, request_id)
            return ClosingStreamingResponse(body, stats=stats, media_type=NDJSON_MEDIA_TYPE, headers=headers)
        outcome = await until_disconnect(request, collect(events(backend, params)), stats)
        response = _generate_response(request_id, outcome, text_model=backend.output_modality == "text")
        return JSONResponse(response.model_dump(), headers=headers)


def _trace_prepared(arrived: float, request_id: str, route: str) -> None:
    """Phase trace (``mstar_dist/trace.py``): the route handler began (``arrived``; the request id is known only
    once the body is parsed) and the request's parameters are built."""
    trace.event_at(arrived, "http_arrived", request_id, route=route)
    trace.event("http_prepared", request_id)


# ------------------------------------------------------------------------------------------- responses


@dataclass
class _ChatReply:
    id: str
    created: int
    model: str

    def body(self, outcome: Outcome, audio: ChatAudio | None = None) -> dict[str, Any]:
        """The whole response; ``message.audio`` only when the request asked for audio."""
        f = outcome.finish
        message = AssistantMessage(content=outcome.text, audio=audio)
        body = ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatChoice(message=message, finish_reason=f.finish_reason)],
            usage=Usage.of(f.prompt_tokens, f.completion_tokens),
        ).model_dump()
        if audio is None:
            del body["choices"][0]["message"]["audio"]
        return body

    def _event(self, delta: dict[str, Any], include_usage: bool) -> bytes:
        """One event whose delta is ``delta`` as given (the audio shapes, which ``ChunkDelta`` does not model)."""
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                    choices=[ChunkChoice(delta=ChunkDelta())], usage=None).model_dump(mode="json")
        chunk["choices"][0]["delta"] = delta
        if not include_usage:
            del chunk["usage"]
        return _sse(chunk)

    def _spoken(self, event: TextDelta | MediaDelta, include_usage: bool, audio_id: str) -> bytes:
        """The event of one delta of a spoken answer: text as ``content`` and as the audio's ``transcript``, audio as
        ``audio.data`` (base64 PCM16, OpenAI's streamed audio); other media are left out."""
        if isinstance(event, TextDelta):
            return self._event({"content": event.text, "audio": {"id": audio_id, "transcript": event.text}},
                               include_usage)
        if event.modality == "audio":
            return self._event({"audio": {"id": audio_id, "data": _b64(event.data)}}, include_usage)
        return b""

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None, include_usage: bool) -> bytes:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage).model_dump(mode="json")
        if not include_usage:
            del chunk["usage"]
        return _sse(chunk)

    def _content_framing(self, include_usage: bool) -> tuple[bytes, bytes]:
        """The bytes around a content delta's JSON string in its event: what ``_chunk`` writes for
        ``[ChunkChoice(delta=ChunkDelta(content=text))]``, cut at the text (built once per response, so a token's
        event costs one string encoding, not two pydantic models and a dump)."""
        head, tail = _chunk_template(self.model, include_usage, "content")
        return self._fill(head), tail

    def _fill(self, template: bytes) -> bytes:
        """A ``_chunk_template`` with this response's id and creation time."""
        return template.replace(_TEMPLATE_ID, _json(self.id), 1).replace(
            _TEMPLATE_CREATED, b'"created":%d' % self.created, 1)

    async def sse(self, stream, first, *, include_usage: bool, audio_id: str | None = None) -> AsyncIterator[bytes]:
        """``data: {chunk}`` events: role, content deltas, finish_reason, [usage], then ``data: [DONE]``.
        Media deltas are left out, unless ``audio_id`` is set (the request asked for audio): then text deltas carry
        ``audio.transcript`` too, audio deltas come as ``audio.data`` and one last ``audio.expires_at`` precedes the
        finish."""
        # events that are ready together leave in one body chunk, one socket write (an intake takes a burst's
        # requests one after another, so each write it saves shortens the queue: docs/architecture.md §2): the role
        # with the first content delta, and the finish with the usage and [DONE]
        out = self._fill(_chunk_template(self.model, include_usage, "role"))
        try:
            head, tail = self._content_framing(include_usage)
            event = first
            while not isinstance(event, Finished):
                if audio_id is not None:
                    out += self._spoken(event, include_usage, audio_id)
                elif isinstance(event, TextDelta):
                    out += head + _json(event.text) + tail
                if out:
                    yield out
                    out = b""
                event = await stream.__anext__()
            if audio_id is not None:
                out += self._event({"audio": {"id": audio_id, "expires_at": int(time.time())}}, include_usage)
            out += self._fill(_chunk_template(self.model, include_usage, "finish", event.finish_reason))
            if include_usage:
                out += self._chunk([], Usage.of(event.prompt_tokens, event.completion_tokens), True)
        except ApiError as exc:
            out += _sse(_openai_error(exc).model_dump())
        finally:
            await stream.aclose()
        yield out + b"data: [DONE]\n\n"


def _chat_audio(audio_id: str, fmt: str, outcome: Outcome, request_id: str) -> ChatAudio:
    """``message.audio``: all audio deltas as one WAV file or raw PCM16, the answer's text as its transcript."""
    pcm, audio_format = join_audio(outcome.media, request_id)
    audio_format = audio_format or AudioFormat(DEFAULT_SAMPLE_RATE, 1)
    data = wav_file(pcm, audio_format, request_id) if fmt == "wav" else pcm
    return ChatAudio(id=audio_id, data=_b64(data), transcript=outcome.text, expires_at=int(time.time()))


async def _ndjson_body(stream, first, request_id: str) -> AsyncIterator[bytes]:
    """NDJSON lines (see ``protocol`` module docstring): one per delta, then one final or error line."""
    try:
        text_head = b'{"modality":"text","data":"'
        text_meta = b'","metadata":{"request_id":' + _json(request_id) + b',"n_tokens":'
        event = first
        while not isinstance(event, Finished):
            if isinstance(event, TextDelta):  # the per-token line, written directly (what _delta_line gives)
                yield b"".join((text_head, base64.b64encode(event.text.encode("utf-8")), text_meta,
                                str(event.n_tokens).encode("ascii"), b"}}\n"))
            else:
                yield _line(_delta_line(event, request_id))
            event = await stream.__anext__()
        usage = Usage.of(event.prompt_tokens, event.completion_tokens).model_dump()
        meta = {"request_id": request_id, "finish_reason": event.finish_reason, "usage": usage}
        yield _line(StreamLine(modality="text", metadata=meta))
    except ApiError as exc:
        meta = {"request_id": request_id, "status": exc.status, "message": exc.message}
        yield _line(StreamLine(modality="error", metadata=meta))
    finally:
        await stream.aclose()


def _delta_line(event: TextDelta | MediaDelta, request_id: str) -> StreamLine:
    meta = {"request_id": request_id, "n_tokens": event.n_tokens}
    if isinstance(event, TextDelta):
        return StreamLine(modality="text", data=_b64(event.text.encode("utf-8")), metadata=meta)
    return StreamLine(modality=event.modality, data=_b64(event.data), metadata={**event.metadata, **meta})


def _generate_response(request_id: str, outcome: Outcome, *, text_model: bool) -> GenerateResponse:
    """``outputs``: the text (always for a text model, else when there is any), then all audio as one entry,
    then one entry per image."""
    f = outcome.finish
    outputs = []
    if text_model or outcome.text:
        text_meta = {"mime_type": "text/plain; charset=utf-8", "n_tokens": f.completion_tokens}
        outputs.append(GenerateOutput(modality="text", data=_b64(outcome.text.encode("utf-8")), metadata=text_meta))
    outputs += _media_outputs(outcome.media)
    return GenerateResponse(request_id=request_id, text=outcome.text, finish_reason=f.finish_reason,
                            usage=Usage.of(f.prompt_tokens, f.completion_tokens), outputs=outputs)


def _media_outputs(media: list[MediaDelta]) -> list[GenerateOutput]:
    outputs = []
    pcm, fmt = join_audio(media)
    if fmt is not None:
        n_tokens = sum(m.n_tokens for m in media if m.modality == "audio")
        meta = {"mime_type": "audio/pcm", "sample_rate": fmt.sample_rate, "num_channels": fmt.num_channels,
                "n_tokens": n_tokens}
        outputs.append(GenerateOutput(modality="audio", data=_b64(pcm), metadata=meta))
    for image in (m for m in media if m.modality == "image"):
        meta = {**image.metadata, "mime_type": "image/png", "n_tokens": image.n_tokens}
        outputs.append(GenerateOutput(modality="image", data=_b64(image.data), metadata=meta))
    return outputs


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


_LINE_BREAKERS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""Characters JSON may leave unescaped that ``str.splitlines`` (and so httpx's ``iter_lines``) takes for line ends:
a generated token holding one would cut a streamed line in two for such clients. Escaped, they are still valid JSON
(control characters below U+0020, the rest of splitlines' set, are always escaped)."""


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS).encode("utf-8")


def _line(line: StreamLine) -> bytes:
    return _json(line.model_dump()) + b"\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


_TEMPLATE_MARK = "\x00mstar-template\x00"
_TEMPLATE_ID = _json(_TEMPLATE_MARK)
_TEMPLATE_CREATED = b'"created":4611686018427387904'  # 2 ** 62: no real time, and anchored on its key


@functools.lru_cache(maxsize=64)
def _chunk_template(model: str, include_usage: bool, kind: str, finish_reason: str | None = None):
    """The bytes of a streamed chat completion's fixed events with a placeholder id and creation time
    (``_ChatReply._fill`` puts a response's own in): the role event (``kind="role"``), the finish event
    (``"finish"``, with ``finish_reason``), and the (head, tail) around a content delta's text (``"content"``, the
    tail needs no filling). Built by the same pydantic models and dump as any other event, once per model and shape,
    instead of three such builds per streamed request on its intake."""
    reply = _ChatReply(_TEMPLATE_MARK, 2 ** 62, model)
    if kind == "role":
        return reply._chunk([ChunkChoice(delta=ChunkDelta(role="assistant", content=""))], None, include_usage)
    if kind == "finish":
        return reply._chunk([ChunkChoice(delta=ChunkDelta(), finish_reason=finish_reason)], None, include_usage)
    marker = "\x00"
    whole = reply._chunk([ChunkChoice(delta=ChunkDelta(content=marker))], None, include_usage)
    head, tail = whole.split(b'"content":' + _json(marker), 1)
    return head + b'"content":', tail


# --------------------------------------------------------------------------------------- errors, metrics


def _openai_error(exc: ApiError) -> ErrorResponse:
    return ErrorResponse.model_validate(error_body("/v1/", exc))


def _error_response(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, exc), status_code=exc.status, headers=exc.headers)


def _add_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # never seen by anyone: the client has left

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        resp = _error_response(request, ApiError(exc.status_code, str(exc.detail)))
        resp.headers.update(exc.headers or {})
        return resp

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(ClientDisconnect, on_client_gone)  # left while we were reading the body
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
