"""HTTP-level counters the app exports on /metrics after the backend's own metrics."""

from __future__ import annotations


class HttpStats:
    """Counters the app itself exports on /metrics, after the backend's."""

    ROUTES = ("/generate", "/v1/chat/completions", "/v1/audio/speech", "/v1/images/generations", "/v1/models",
              "/health", "/metrics")

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.disconnects = 0

    def render(self) -> str:
        lines = [
            "# HELP mstar_http_requests_total HTTP requests answered, by route and status code.",
            "# TYPE mstar_http_requests_total counter",
        ]
        for (route, code), n in sorted(self.requests.items()):
            lines.append(f'mstar_http_requests_total{{route="{route}",code="{code}"}} {n}')
        lines += [
            "# HELP mstar_http_requests_in_flight HTTP requests being handled now.",
            "# TYPE mstar_http_requests_in_flight gauge",
            f"mstar_http_requests_in_flight {self.in_flight}",
            "# HELP mstar_http_client_disconnects_total Generations aborted because the client went away.",
            "# TYPE mstar_http_client_disconnects_total counter",
            f"mstar_http_client_disconnects_total {self.disconnects}",
        ]
        return "\n".join(lines) + "\n"


class StatsMiddleware:
    """Pure ASGI middleware (does not buffer streams) counting requests by route and status."""

    def __init__(self, app, stats: HttpStats) -> None:
        self.app, self.stats = app, stats

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in HttpStats.ROUTES else "other"
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.stats.in_flight += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.stats.in_flight -= 1
            key = (route, status)
            self.stats.requests[key] = self.stats.requests.get(key, 0) + 1
