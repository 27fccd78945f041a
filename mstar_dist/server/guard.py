"""What every request passes before a route sees it: the API key and the body size limit.

``GuardMiddleware`` is pure ASGI (streams are not buffered). With an API key set (``--api-key`` /
``MSTAR_API_KEY``), every route but ``/health`` needs ``Authorization: Bearer <key>`` (vLLM's ``--api-key``
rule), else a 401. A body larger than ``server.max_body_bytes`` is a 413: at once when ``Content-Length`` says
so, else as soon as the bytes read pass the limit (chunked uploads). Errors use the route family's format
(``checks.error_body``).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from mstar_dist.server.checks import ApiError, error_body

OPEN_PATHS = frozenset({"/health"})
"""Routes served without the API key (load balancers' probes)."""


class GuardMiddleware:
    """Checks the API key and the body size of every HTTP request (runs on the HTTP server's loop)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_key(scope)
            self._check_length(scope)
        except ApiError as exc:
            response = JSONResponse(error_body(scope["path"], exc), status_code=exc.status, headers=exc.headers)
            await response(scope, receive, send)
            return
        await self.app(scope, self._bounded(receive), send)

    def _check_key(self, scope) -> None:
        if self._key is None or scope["path"] in OPEN_PATHS:
            return
        value = _header(scope, b"authorization")
        challenge = {"WWW-Authenticate": "Bearer"}
        if value is None:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'", headers=challenge)
        scheme, _, key = value.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self._key):
            raise ApiError(401, "invalid API key in the Authorization header", headers=challenge)

    def _check_length(self, scope) -> None:
        value = _header(scope, b"content-length")
        if value is not None and value.isdigit() and int(value) > self.max_body_bytes:
            raise self._too_large(int(value))

    def _too_large(self, size: int | None) -> ApiError:
        got = f"{size} bytes" if size is not None else "more"
        return ApiError(413, f"request body is {got}; this server takes at most {self.max_body_bytes} bytes "
                             "(server.max_body_bytes, --max-body-bytes)")

    def _bounded(self, receive):
        """``receive`` that raises a 413 :class:`ApiError` once the body read passes the limit (the route's
        error handler renders it)."""
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self._too_large(None)
            return message

        return bounded


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None
