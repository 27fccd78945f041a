"""The HTTP front end on rank 0: native ``/generate``, ``/tokenize`` and ``/detokenize``, the OpenAI ``/v1`` routes,
``/health``, ``/metrics``.

The app validates requests (``checks``), turns them into :class:`GenerationParams` and relays the backend's
events (``relay``). Its guarantees (docs/architecture.md §9, §10):
  * bad input is a 4xx saying what to fix, never a 500, and never affects other requests or ``/health``;
  * a backend failure is a 5xx (or the ``BackendError``'s status) for that request only;
  * the backend generator is always closed; when the client goes away before the end it is closed early,
    which aborts the request in the backend.
Error bodies: ``{"error": {"message", "type", "param", "code"}}`` on ``/v1`` routes, ``{"error": "..."}``
elsewhere. One module per route family: ``chat``, ``completions``, ``native`` (``/generate``), ``tokenize``,
``media_routes`` (speech and images); this one builds the app and holds the operations routes and error handlers.
"""

from __future__ import annotations

import inspect
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mstar_dist.config.deployment import MediaConfig
from mstar_dist.server.backend import BackendError, GenerationBackend
from mstar_dist.server.chat import add_chat_route
from mstar_dist.server.checks import ApiError, error_body
from mstar_dist.server.completions import add_completions_route
from mstar_dist.server.direct import DirectRoutes
from mstar_dist.server.framing import NDJSON_MEDIA_TYPE, SSE_MEDIA_TYPE
from mstar_dist.server.guard import GuardMiddleware
from mstar_dist.server.http_metrics import HttpStats, StatsMiddleware
from mstar_dist.server.http_server import HttpServer
from mstar_dist.server.media_routes import add_media_routes
from mstar_dist.server.native import add_generate_route
from mstar_dist.server.openapi import install_openapi
from mstar_dist.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, ImageGenerationRequest, ModelCard,
    ModelList, SpeechRequest, TokenizeRequest,
)
from mstar_dist.server.relay import ClientGone
from mstar_dist.server.tokenize import add_tokenize_routes

__all__ = ["build_app", "HttpServer", "NDJSON_MEDIA_TYPE", "SSE_MEDIA_TYPE"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20

GENERATION_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/audio/speech",
                    "/v1/images/generations")
"""The POST routes ``DirectRoutes`` serves without FastAPI's routing (each handler takes the ``Request`` alone)."""
BODIES = [GenerateRequest, ChatCompletionRequest, CompletionRequest, SpeechRequest, ImageGenerationRequest,
          TokenizeRequest, DetokenizeRequest]
"""Every request body the OpenAPI document describes."""


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
    add_chat_route(app, backend, stats, media)
    add_completions_route(app, backend, stats)
    add_generate_route(app, backend, stats, media, max_body_bytes)
    add_tokenize_routes(app, backend)
    add_media_routes(app, backend, stats)
    install_openapi(app, backend, BODIES, api_key=bool(api_key), media=media)
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
        card = ModelCard(id=backend.model_name, created=created, max_model_len=backend.max_context_tokens,
                         weights=getattr(backend, "weights", "checkpoint"))
        return JSONResponse(ModelList(data=[card]).model_dump())


# --------------------------------------------------------------------------------------- errors, metrics


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
