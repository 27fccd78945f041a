"""The generation routes, served without FastAPI's router and request layers.

An intake takes the requests of its connections one after another, so what the app costs a request before its
handler runs decides how far apart a burst's requests reach the conductor (docs/architecture.md §2). On its way to
a handler a request passed FastAPI's exception middleware, its exit-stack middleware, the router (a regular
expression per route until one matches), Starlette's request wrapper and FastAPI's dependency solver: about half of
the app's CPU time for a streamed chat completion (``scripts/bench_http_path.py``). The handlers of the POST
generation routes take the ``Request`` alone and need nothing those layers resolve, so ``DirectRoutes``, the
innermost of the app's own middleware (inside ``StatsMiddleware`` and ``GuardMiddleware``, which still see every
request), calls them on an exact method and path and renders what they raise with the app's own exception handlers.
Every other request goes on through FastAPI, and the routes stay registered there too, for the OpenAPI document.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

Handler = Callable[[Request], Awaitable[Response]]


class DirectRoutes:
    """Pure ASGI middleware: ``POST`` requests to ``paths`` go straight to their route's handler (runs on the HTTP
    server's loop)."""

    def __init__(self, app, *, fastapi_app: FastAPI, paths: Iterable[str]) -> None:
        # Starlette builds its middleware stack at the first request, so every route and handler exists by now
        self.app = app
        self._handlers = _post_handlers(fastapi_app, set(paths))
        self._exception_handlers = fastapi_app.exception_handlers

    async def __call__(self, scope, receive, send) -> None:
        handler = self._handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await self._render(request, exc)
        await response(scope, receive, send)

    async def _render(self, request: Request, exc: Exception) -> Response:
        """The response of the app's handler for the closest class of ``exc`` (as Starlette chooses one)."""
        for cls in type(exc).__mro__:
            on_error = self._exception_handlers.get(cls)
            if on_error is not None:
                response = on_error(request, exc)
                return await response if inspect.isawaitable(response) else response
        raise exc


def _post_handlers(app: FastAPI, paths: set[str]) -> dict[str, Handler]:
    handlers: dict[str, Handler] = {}
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path in paths and "POST" in route.methods:
            params = list(inspect.signature(route.endpoint).parameters.values())
            if len(params) != 1 or params[0].annotation not in (Request, "Request"):
                raise TypeError(f"the handler of POST {route.path} must take the Request alone to be served "
                                f"directly; it takes {[p.name for p in params]}")
            handlers[route.path] = route.endpoint
    missing = paths - handlers.keys()
    if missing:
        raise ValueError(f"no POST route for {sorted(missing)} to serve directly")
    return handlers
