"""HTTP-level metrics the app exports on /metrics after the backend's own, with prometheus_client on a registry
of the app's own (several apps live in one test process). With several intake processes on the port, each
reports its counts to the conductor and ``/metrics`` shows their sum (``conductor/metrics.render_counts``, which
writes these same series)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class HttpStats:
    """Requests by route and status, requests in flight, and client disconnects (runs on the HTTP loop)."""

    ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/images/generations",
              "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics")

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("mstar_http_requests", "HTTP requests answered, by route and status code.",
                                ["route", "code"], registry=self.registry)
        self.in_flight = Gauge("mstar_http_requests_in_flight", "HTTP requests being handled now.",
                               registry=self.registry)
        self._disconnects = Counter("mstar_http_client_disconnects", "Generations aborted because the client went "
                                    "away.", registry=self.registry)

    def disconnected(self) -> None:
        self._disconnects.inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def reset(self) -> None:
        """Forget the requests answered so far (an intake's warm-up ones, which no client sent)."""
        self.requests.clear()

    def counts(self) -> tuple[dict[str, int], int, int]:
        """(``"route code"`` -> requests answered, requests in flight, client disconnects): what an intake process
        reports so that ``/metrics`` can show the sum over every process serving the port
        (``conductor/metrics.render_counts``)."""
        requests: dict[str, int] = {}
        in_flight = disconnects = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name == "mstar_http_requests_total":
                    requests[f"{sample.labels['route']} {sample.labels['code']}"] = int(sample.value)
                elif sample.name == "mstar_http_requests_in_flight":
                    in_flight = int(sample.value)
                elif sample.name == "mstar_http_client_disconnects_total":
                    disconnects = int(sample.value)
        return requests, in_flight, disconnects


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

        self.stats.in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.stats.in_flight.dec()
            self.stats.requests.labels(route=route, code=str(status)).inc()
