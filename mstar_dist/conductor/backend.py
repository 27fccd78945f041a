"""The in-process HTTP side of the conductor: implements :class:`GenerationBackend` on the HTTP asyncio loop, when the
HTTP server runs in the conductor's own process (no intake processes).

Every call here runs on the HTTP loop's thread. Commands (``conductor/commands.py``) reach the conductor thread
through :meth:`Conductor.command` (its command queue plus a wake-up of its control channel); events
come back into a per-request ``asyncio.Queue``: the conductor thread appends them to one outbox and schedules a
single ``loop.call_soon_threadsafe`` delivery for everything appended until it runs (not one wake-up of the
loop per token). A response that falls behind its events sends the text deltas waiting in its queue as one
delta (one chunk, one socket write), so HTTP framing costs per write, not per token, under load.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from mstar_dist import trace
from mstar_dist.conductor.commands import Abort, Submit
from mstar_dist.events import BackendError, Finished, GenerationEvent, GenerationParams, TextDelta, joined

if TYPE_CHECKING:
    from mstar_dist.conductor.conductor import Conductor


class ConductorBackend:
    def __init__(self, conductor: Conductor, *, model_name: str, max_context_tokens: int, max_tokens_limit: int,
                 output_modality: str = "text", output_modalities: list[str] | None = None,
                 input_modalities: list[str] | None = None, tokenizer: object = None, weights: str = "checkpoint"):
        self.conductor = conductor
        self.weights = weights
        """"random-test" for random test weights, else "checkpoint" (``/v1/models``; ``runtime.deployment.served``)."""
        self.tokenizer = tokenizer
        """The family's prompt encoder for ``/tokenize`` and token-id prompts (``server/tokenizer.py``), or None."""
        self.output_modality = output_modality
        self.output_modalities = tuple(output_modalities or (output_modality,))
        """Every modality the model can produce when asked (``runtime.deployment.served``)."""
        self.input_modalities = tuple(input_modalities or ("text",))
        """What requests may carry: "text", "image", "audio" (the server refuses other media with a 400)."""
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.max_tokens_limit = max_tokens_limit
        self._outbox: list[tuple[asyncio.Queue, object]] = []
        self._outbox_lock = threading.Lock()
        self._delivery_scheduled = False

    def _post(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, event) -> None:
        """Called on the conductor thread: queue ``event`` for ``events`` on ``loop``."""
        with self._outbox_lock:
            self._outbox.append((events, event))
            if self._delivery_scheduled:
                return
            self._delivery_scheduled = True
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the HTTP loop is closed (shutdown): nobody is listening any more
            with self._outbox_lock:
                self._outbox.clear()
                self._delivery_scheduled = False

    def _deliver(self) -> None:
        with self._outbox_lock:
            batch, self._outbox = self._outbox, []
            self._delivery_scheduled = False
        for events, event in batch:
            events.put_nowait(event)

    def health(self) -> tuple[bool, str]:
        return self.conductor.health()

    def metrics_text(self) -> str:
        return self.conductor.metrics.render()

    async def generate(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        ok, reason = self.health()
        if not ok:
            raise BackendError(503, f"not serving: {reason}")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(event) -> None:  # called on the conductor thread
            self._post(loop, events, event)

        if trace.ON:  # as it is handed over (after, the conductor thread may be first on the clock)
            trace.event("http_submitted", params.request_id)
        self.conductor.command(Submit(params, sink, pinned_id=True))
        cancel = lambda: self.conductor.command(Abort(params.request_id, sink))  # noqa: E731
        async with contextlib.aclosing(relay_queue(events, params.request_id, cancel)) as relay:
            async for event in relay:
                yield event


async def relay_queue(events: asyncio.Queue, request_id: str,
                      cancel: Callable[[], None]) -> AsyncIterator[GenerationEvent]:
    """The events of one request as they land in ``events``, until ``Finished``; an exception event is raised.
    Text deltas of one choice waiting behind one another go out as one (one chunk, one socket write under load).
    Closed before its end (the client left, the server stops), it calls ``cancel()`` to abort the request where it
    runs."""
    pending: collections.deque = collections.deque()  # events taken from the queue, not yet yielded
    first = trace.ON
    finished = False
    try:
        while True:
            event = pending.popleft() if pending else await events.get()
            if first:  # phase trace: the first event is on the HTTP loop
                first = False
                trace.event("http_first_event", request_id, kind=type(event).__name__)
            while not events.empty():
                pending.append(events.get_nowait())
            while isinstance(event, TextDelta) and pending and isinstance(pending[0], TextDelta):
                both = joined(event, pending[0])  # text waiting behind this one goes out with it (same choice)
                if both is None:
                    break
                pending.popleft()
                event = both
            if isinstance(event, BaseException):
                finished = True  # an error event: the request has ended where it ran
                raise event
            finished = isinstance(event, Finished)
            yield event
            if finished:
                return
    finally:
        if not finished:
            cancel()
