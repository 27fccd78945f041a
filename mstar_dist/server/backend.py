"""The interface between the HTTP front end and whatever produces tokens (the conductor on rank 0).

The app (``mstar_dist.server.app``) only ever talks to a :class:`GenerationBackend`. Everything here is plain
data: no torch, no sockets, so the app and its tests run without a process group.

Threading: every method is called on the HTTP server's asyncio loop (``HttpServer.loop``). ``health()`` and
``metrics_text()`` are synchronous and must not block (read cached state); ``generate()`` must never block the
loop (await the conductor's futures instead).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class GenerationParams:
    """One validated request, as the backend receives it (already checked against the backend's limits)."""

    request_id: str
    """Pinned by the client (native ``request_id``, ``X-Request-Id``) or generated; unique per request."""
    prompt: str | None
    """Raw prompt text; exactly one of ``prompt`` / ``messages`` is set."""
    messages: list[dict[str, str]] | None
    """Chat messages normalised to ``{"role": str, "content": str}`` (text parts joined); the backend applies
    the model's chat template."""
    max_tokens: int
    """Upper bound on generated tokens, 1 <= max_tokens <= backend.max_tokens_limit."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """0 disables."""
    seed: int | None = None
    """Fixes the request's sampling seed when set (see DESIGN §4)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings. The backend should end generation once the text contains one (stop checks live in the
    engine); the app trims the stop string and everything after it from what the client sees."""
    stream: bool = False
    """Whether the client streams; informational (the backend yields deltas either way)."""
    max_tokens_given: bool = True
    """False when the client did not ask for a number: ``max_tokens`` is then the service's default limit and the
    backend may lower it to what the context leaves after the prompt (instead of rejecting the request)."""


@dataclass(frozen=True)
class TextDelta:
    """New text since the previous delta (whole characters: the backend holds back partial UTF-8 bytes)."""

    text: str
    n_tokens: int
    """Tokens this delta accounts for (may be > 0 with empty text while a multi-byte character is pending)."""


@dataclass(frozen=True)
class Finished:
    """The last item of every complete generation."""

    finish_reason: str
    """One of ``FINISH_REASONS``: "stop" (EOS or stop string), "length" (max_tokens or context), "abort"."""
    prompt_tokens: int
    completion_tokens: int


GenerationEvent = TextDelta | Finished


class BackendError(Exception):
    """A request-level failure with the HTTP status the client should see.

    4xx: the request is wrong (``BackendError(400, "prompt is 9000 tokens, context is 8192")``).
    5xx: the service failed this request (503 when not serving, 500 for a model failure naming the rank).
    """

    def __init__(self, status: int, message: str) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"BackendError status must be a 4xx/5xx HTTP status, got {status}")
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"BackendError({self.status}, {self.message!r})"


@runtime_checkable
class GenerationBackend(Protocol):
    """What the HTTP app needs from the serving runtime."""

    model_name: str
    """The one model this deployment serves (``/v1/models``; requests naming another model get a 400)."""
    max_context_tokens: int
    """Prompt + completion tokens the model can hold."""
    max_tokens_limit: int
    """Largest ``max_tokens`` a request may ask for; also the default when the request gives none."""

    def health(self) -> tuple[bool, str]:
        """(serving?, reason). Serving means every rank is READY and alive; the reason is shown on a 503."""
        ...

    def metrics_text(self) -> str:
        """Prometheus text exposition of the runtime's metrics (the app appends its own HTTP metrics)."""
        ...

    def generate(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """Run one request; implement as an async generator (``async def generate(...): ... yield ...``).

        Yields zero or more :class:`TextDelta` then exactly one :class:`Finished`, and then returns.
        Raises :class:`BackendError` for request-level failures — before the first item for a bad request
        (prompt too long: 400) or when not serving (503); any other exception is reported as a 500 for this
        request only. The app always closes the iterator (``aclose()``); closing it before ``Finished``
        (client disconnect, server shutdown) must abort the request everywhere and free its resources.
        """
        ...
