"""The HTTP front end on rank 0: native ``/generate``, OpenAI ``/v1`` routes, ``/health``, ``/metrics``.

The app validates requests, turns them into :class:`GenerationParams` and relays the backend's events. It
owns three guarantees (docs/architecture.md §9, §10):
  * bad input is a 4xx saying what to fix, never a 500, and never affects other requests or ``/health``;
  * a backend failure is a 5xx (or the ``BackendError``'s status) for that request only;
  * the backend generator is always closed; when the client goes away before the end it is closed early,
    which aborts the request in the backend.
Error bodies: ``{"error": {"message", "type", "param", "code"}}`` on ``/v1`` routes, ``{"error": "..."}``
elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mstar_dist.server.backend import BackendError, Finished, GenerationBackend, GenerationParams, TextDelta
from mstar_dist.server.http_metrics import HttpStats, StatsMiddleware
from mstar_dist.server.http_server import HttpServer
from mstar_dist.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    ChunkDelta,
    ErrorInfo,
    ErrorResponse,
    GenerateOutput,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    StreamLine,
    Usage,
    normalize_messages,
)
from mstar_dist.conductor.stop_strings import StopTrimmer

__all__ = ["build_app", "HttpServer", "NDJSON_MEDIA_TYPE", "SSE_MEDIA_TYPE"]

logger = logging.getLogger(__name__)

NDJSON_MEDIA_TYPE = "application/x-ndjson; charset=utf-8"
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
REQUEST_ID_HEADER = "X-Request-Id"

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A request failure with the status and message the client sees."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class _Outcome:
    text: str
    finish: Finished


def build_app(backend: GenerationBackend) -> FastAPI:
    """The FastAPI app serving ``backend``. Runs on the loop of the server that hosts it (``HttpServer``)."""
    app = FastAPI(title="mstar_dist", version="0.1.0")
    stats = HttpStats()
    app.add_middleware(StatsMiddleware, stats=stats)
    created = int(time.time())
    _add_error_handlers(app)

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
        if text and not text.endswith("\n"):
            text += "\n"
        return PlainTextResponse(text + stats.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=backend.model_name, created=created, max_model_len=backend.max_context_tokens)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse_body(request, ChatCompletionRequest, status=400)
        _check_model(req.model, backend)
        if req.n != 1:
            raise ApiError(400, f"n is {req.n}; only n=1 (one choice per request) is supported", "n")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        request_id = _header_request_id(request) or uuid.uuid4().hex
        params = GenerationParams(
            request_id=request_id,
            prompt=None,
            messages=normalize_messages(req.messages),
            max_tokens=_max_tokens(req.requested_max_tokens(), backend, param),
            max_tokens_given=req.requested_max_tokens() is not None,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k_value(),
            seed=req.seed,
            stop=req.stop_list(),
            stream=req.stream,
        )
        reply = _ChatReply(f"chatcmpl-{request_id}", int(time.time()), backend.model_name)
        headers = {REQUEST_ID_HEADER: request_id}
        if req.stream:
            events, first = await _start_stream(request, backend, params, stats)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = reply.sse(events, first, include_usage=include_usage)
            return _ClosingStreamingResponse(body, stats=stats, media_type=SSE_MEDIA_TYPE, headers=headers)
        outcome = await _until_disconnect(request, _collect(_events(backend, params)), stats)
        return JSONResponse(reply.response(outcome).model_dump(), headers=headers)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = await _parse_body(request, GenerateRequest, status=422)
        _check_model(req.model, backend)
        kw = req.model_kwargs
        request_id = req.request_id or _header_request_id(request) or uuid.uuid4().hex
        params = GenerationParams(
            request_id=request_id,
            prompt=req.prompt,
            messages=normalize_messages(req.messages) if req.messages is not None else None,
            max_tokens=_max_tokens(kw.max_tokens, backend, "model_kwargs.max_tokens"),
            max_tokens_given=kw.max_tokens is not None,
            temperature=kw.temperature,
            top_p=kw.top_p,
            top_k=kw.top_k_value(),
            seed=kw.seed,
            stop=kw.stop_list(),
            stream=req.stream,
        )
        headers = {REQUEST_ID_HEADER: request_id}
        if req.stream:
            events, first = await _start_stream(request, backend, params, stats)
            body = _ndjson_body(events, first, request_id)
            return _ClosingStreamingResponse(body, stats=stats, media_type=NDJSON_MEDIA_TYPE, headers=headers)
        outcome = await _until_disconnect(request, _collect(_events(backend, params)), stats)
        return JSONResponse(_generate_response(request_id, outcome).model_dump(), headers=headers)

    return app


# ------------------------------------------------------------------------------------- request checking


async def _parse_body(request: Request, model: type[M], *, status: int) -> M:
    """Parses the JSON body into ``model``; ``status`` is used for schema errors (400 on /v1, 422 native)."""
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "request body is empty: send a JSON object (Content-Type: application/json)")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {_json_type(obj)}")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise ApiError(status, _describe(exc), _loc(first["loc"]) or None) from None


def _describe(exc: ValidationError) -> str:
    """One readable line per problem: ``messages[0].role: Input should be 'system', ... (got 'robot')``."""
    problems = []
    for err in exc.errors(include_url=False):
        where = _loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "field required"
        elif err["type"] not in ("value_error", "extra_forbidden") and not isinstance(err["input"], dict | list):
            msg += f" (got {json.dumps(err['input'])[:60]})" if _jsonable(err["input"]) else ""
        problems.append(f"{where}: {msg}" if where else msg)
    return "invalid request: " + "; ".join(problems)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _check_model(model: str | None, backend: GenerationBackend) -> None:
    if model is not None and model != backend.model_name:
        raise ApiError(
            400,
            f"model {model!r} is not served here; this server serves {backend.model_name!r} (see GET /v1/models)",
            "model",
        )


def _max_tokens(requested: int | None, backend: GenerationBackend, param: str) -> int:
    limit = backend.max_tokens_limit
    if requested is None:
        return limit
    if requested > limit:
        raise ApiError(400, f"{param} is {requested}, above this server's limit of {limit}; ask for at most {limit}",
                       param)
    return requested


def _header_request_id(request: Request) -> str | None:
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not (0 < len(value) <= 128 and all(c.isascii() and (c.isalnum() or c in "._:-") for c in value)):
        raise ApiError(400, f"{REQUEST_ID_HEADER} must be 1-128 characters of [A-Za-z0-9._:-]")
    return value


# ------------------------------------------------------------------------------------------- generation


async def _events(backend: GenerationBackend, params: GenerationParams) -> AsyncIterator[TextDelta | Finished]:
    """The backend's events with stop strings applied and failures turned into :class:`ApiError`.

    Yields non-empty-text deltas, then one ``Finished``. Closing this generator closes the backend's.
    """
    gen = backend.generate(params)
    trimmer = StopTrimmer(params.stop)
    tokens = 0  # tokens of deltas whose text is held back or cut, reported with the next delta shown
    try:
        async for event in gen:
            if isinstance(event, TextDelta):
                text, tokens = trimmer.feed(event.text), tokens + event.n_tokens
                if text:
                    yield TextDelta(text=text, n_tokens=tokens)
                    tokens = 0
            elif isinstance(event, Finished):
                tail = trimmer.flush()
                if tail:
                    yield TextDelta(text=tail, n_tokens=tokens)
                reason = "stop" if trimmer.stopped else event.finish_reason
                yield Finished(reason, event.prompt_tokens, event.completion_tokens)
                return
            else:
                raise TypeError(f"backend yielded {type(event).__name__}; expected TextDelta or Finished")
        raise RuntimeError("backend generator ended without a Finished event")
    except BackendError as exc:
        raise ApiError(exc.status, exc.message) from exc
    except Exception as exc:
        logger.exception("request %s failed in the backend", params.request_id)
        raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from exc
    finally:
        await gen.aclose()


async def _collect(events: AsyncIterator[TextDelta | Finished]) -> _Outcome:
    parts: list[str] = []
    try:
        async for event in events:
            if isinstance(event, Finished):
                return _Outcome("".join(parts), event)
            parts.append(event.text)
        raise AssertionError("_events ended without Finished")
    finally:
        await events.aclose()


async def _until_disconnect(request: Request, work: Awaitable[T], stats: HttpStats) -> T:
    """Awaits ``work`` in a task and cancels it if the client disconnects first (raises ClientGone).

    Requires the request body to be consumed already: the next ASGI ``receive()`` then returns only when the
    client disconnects (or the response is complete).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        stats.disconnects += 1
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})  # let the backend's cleanup (abort) run to the end


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _start_stream(
    request: Request, backend: GenerationBackend, params: GenerationParams, stats: HttpStats
) -> tuple[AsyncIterator[TextDelta | Finished], TextDelta | Finished]:
    """Waits for the first event before the 200 goes out, so a rejected request (prompt too long, not
    serving) still gets its HTTP status rather than an error inside a stream."""
    events = _events(backend, params)
    try:
        first = await _until_disconnect(request, _next(events), stats)
    except BaseException:
        await events.aclose()
        raise
    return events, first


async def _next(events: AsyncIterator[T]) -> T:
    return await events.__anext__()


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator, whatever ended the response.

    Starlette leaves the body iterator suspended when the client disconnects while a chunk is being sent;
    closing it here (shielded from the cancellation that ended the response) aborts the backend request.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], *, stats: HttpStats, **kwargs: Any) -> None:
        super().__init__(self._until_exhausted(body), **kwargs)
        self._body, self._stats, self._complete = body, stats, False

    async def _until_exhausted(self, body: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        async for chunk in body:
            yield chunk
        self._complete = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # ASGI spec >= 2.4 servers report a gone client by failing send(); nobody is left to tell
        finally:
            if not self._complete:
                self._stats.disconnects += 1
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._body.aclose()


@dataclass
class _ChatReply:
    id: str
    created: int
    model: str

    def response(self, outcome: _Outcome) -> ChatCompletionResponse:
        f = outcome.finish
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatChoice(message=AssistantMessage(content=outcome.text), finish_reason=f.finish_reason)],
            usage=Usage.of(f.prompt_tokens, f.completion_tokens),
        )

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None, include_usage: bool) -> bytes:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage).model_dump(mode="json")
        if not include_usage:
            del chunk["usage"]
        return _sse(chunk)

    async def sse(self, events, first, *, include_usage: bool) -> AsyncIterator[bytes]:
        """``data: {chunk}`` events: role, content deltas, finish_reason, [usage], then ``data: [DONE]``."""
        try:
            yield self._chunk([ChunkChoice(delta=ChunkDelta(role="assistant", content=""))], None, include_usage)
            event = first
            while isinstance(event, TextDelta):
                yield self._chunk([ChunkChoice(delta=ChunkDelta(content=event.text))], None, include_usage)
                event = await events.__anext__()
            yield self._chunk([ChunkChoice(delta=ChunkDelta(), finish_reason=event.finish_reason)], None,
                              include_usage)
            if include_usage:
                yield self._chunk([], Usage.of(event.prompt_tokens, event.completion_tokens), True)
        except ApiError as exc:
            yield _sse(_openai_error(exc).model_dump())
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"


async def _ndjson_body(events, first, request_id: str) -> AsyncIterator[bytes]:
    """NDJSON lines (see ``protocol`` module docstring): text deltas, then one final or error line."""
    try:
        event = first
        while isinstance(event, TextDelta):
            meta = {"request_id": request_id, "n_tokens": event.n_tokens}
            yield _line(StreamLine(modality="text", data=_b64(event.text), metadata=meta))
            event = await events.__anext__()
        usage = Usage.of(event.prompt_tokens, event.completion_tokens).model_dump()
        meta = {"request_id": request_id, "finish_reason": event.finish_reason, "usage": usage}
        yield _line(StreamLine(modality="text", metadata=meta))
    except ApiError as exc:
        meta = {"request_id": request_id, "status": exc.status, "message": exc.message}
        yield _line(StreamLine(modality="error", metadata=meta))
    finally:
        await events.aclose()


def _generate_response(request_id: str, outcome: _Outcome) -> GenerateResponse:
    f = outcome.finish
    output = GenerateOutput(modality="text", data=_b64(outcome.text),
                            metadata={"mime_type": "text/plain; charset=utf-8", "n_tokens": f.completion_tokens})
    return GenerateResponse(request_id=request_id, text=outcome.text, finish_reason=f.finish_reason,
                            usage=Usage.of(f.prompt_tokens, f.completion_tokens), outputs=[output])


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def _line(line: StreamLine) -> bytes:
    return json.dumps(line.model_dump(), ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


# --------------------------------------------------------------------------------------- errors, metrics


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def _openai_error(exc: ApiError) -> ErrorResponse:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return ErrorResponse(error=ErrorInfo(message=exc.message, type=kind, param=exc.param, code=exc.status))


def _error_response(request: Request, exc: ApiError) -> JSONResponse:
    body = _openai_error(exc).model_dump() if _is_openai(request) else {"error": exc.message}
    return JSONResponse(body, status_code=exc.status)


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
