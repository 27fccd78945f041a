"""The interface between the HTTP front end and whatever produces tokens (the conductor on rank 0).

The app (``mstar_dist.server.app``) only ever talks to a :class:`GenerationBackend`. Everything here is plain
data: no torch, no sockets, so the app and its tests run without a process group.

Threading: every method is called on the HTTP server's asyncio loop (``HttpServer.loop``). ``health()`` is
synchronous and must not block (read cached state), and so is ``metrics_text()`` unless it is a coroutine;
``generate()`` must never block the loop (await the conductor's futures instead).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from mstar_dist.events import (  # noqa: F401 -- re-exported: the app and its tests import them from here
    FINISH_REASONS, BackendError, Finished, GenerationEvent, GenerationParams, MediaDelta, TextDelta,
)


@runtime_checkable
class GenerationBackend(Protocol):
    """What the HTTP app needs from the serving runtime."""

    model_name: str
    """The one model this deployment serves (``/v1/models``; requests naming another model get a 400)."""
    max_context_tokens: int
    """Prompt + completion tokens the model can hold."""
    max_tokens_limit: int
    """Largest ``max_tokens`` a request may ask for; also the default when the request gives none."""
    output_modality: str
    """What the model emits to clients: "text", "audio" or "image" (a route for another modality is a 400).

    Two attributes are optional (``checks.outputs_of`` / ``inputs_of`` read them with their defaults):
    ``output_modalities``, every modality the model produces when a request asks for it (default: this one), and
    ``input_modalities``, what requests may carry besides text ("image", "audio"; default: text alone)."""

    def health(self) -> tuple[bool, str]:
        """(serving?, reason). Serving means every rank is READY and alive; the reason is shown on a 503."""
        ...

    def metrics_text(self) -> str:
        """Prometheus text exposition of the runtime's metrics (the app appends its own HTTP metrics). May instead
        be a coroutine function (an intake process asks the conductor); a backend whose text already holds the
        HTTP metrics of every process on the port sets ``http_stats_merged = True``."""
        ...

    def generate(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """Run one request; implement as an async generator (``async def generate(...): ... yield ...``).

        Yields zero or more :class:`TextDelta` / :class:`MediaDelta` then exactly one :class:`Finished`, and then
        returns. Stop strings are already applied (text is cut before the first one, finish reason "stop").
        Raises :class:`BackendError` for request-level failures — before the first item for a bad request
        (prompt too long: 400) or when not serving (503); any other exception is reported as a 500 for this
        request only. The app always closes the iterator (``aclose()``); closing it before ``Finished``
        (client disconnect, server shutdown) must abort the request everywhere and free its resources.
        """
        ...
