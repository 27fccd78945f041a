"""Relaying one backend generation to one HTTP response, for every route.

Owns the app's per-request guarantees (docs/architecture.md §9, §10): a backend failure becomes an :class:`ApiError`
for that request only; the backend generator is always closed, and closed early (which aborts the request in the
backend) when the client goes away first. Everything here runs on the HTTP server's loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from mstar_dist import trace
from mstar_dist.events import TokenLogprob
from mstar_dist.server.backend import (
    BackendError, Finished, GenerationBackend, GenerationEvent, GenerationParams, MediaDelta, TextDelta,
)
from mstar_dist.server.checks import ApiError
from mstar_dist.server.http_metrics import HttpStats

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class StreamAborted(Exception):
    """Raised by a streamed body that cannot go on (a failure after the 200 went out, in a format with no way
    to say so in-band): the response ends without its terminating chunk, so the client sees a truncated
    transfer instead of a well-formed but incomplete file."""


@dataclass
class Choice:
    """What one choice of a generation produced: its text, and its log-probabilities when asked for."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, delta: TextDelta) -> None:
        self.parts.append(delta.text)
        self.logprobs += delta.logprobs or ()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


@dataclass
class Outcome:
    """A whole generation: its text, its media deltas in order, and how it ended; with several choices
    (``GenerationParams.n``), each one's text and log-probabilities (``choice(i)``)."""

    text: str
    finish: Finished
    media: list[MediaDelta] = field(default_factory=list)
    choices: dict[int, Choice] = field(default_factory=dict)

    def choice(self, index: int) -> Choice:
        """Choice ``index`` (an empty one when it produced nothing)."""
        return self.choices.get(index) or Choice()


def finish_reasons(finish: Finished, n: int) -> list[str]:
    """How each of a request's ``n`` choices ended (``Finished.choices``; one choice: ``finish_reason``)."""
    ends = {end.index: end.finish_reason for end in finish.choices}
    return [ends.get(i, finish.finish_reason) for i in range(n)]


async def events(backend: GenerationBackend, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
    """The backend's events with failures turned into :class:`ApiError`.

    Yields text deltas with non-empty text or log-probabilities and media deltas, as produced, then one
    ``Finished``; the tokens of other text deltas ride on the next delta yielded. Stop strings are the backend's
    business (the conductor applies them once, ``conductor/stop_strings.py``): text is relayed as is. Closing this
    generator closes the backend's.
    """
    gen = backend.generate(params)
    tokens = 0  # tokens of empty text deltas, reported with the next delta shown
    try:
        async for event in gen:
            if isinstance(event, TextDelta):
                tokens += event.n_tokens
                if event.text or event.logprobs or event.prompt_logprobs is not None:
                    yield event if tokens == event.n_tokens else msgspec.structs.replace(event, n_tokens=tokens)
                    tokens = 0
            elif isinstance(event, MediaDelta):
                yield MediaDelta(event.modality, event.data, event.metadata, event.n_tokens + tokens)
                tokens = 0
            elif isinstance(event, Finished):
                yield event
                return
            else:
                raise TypeError(f"backend yielded {type(event).__name__}; expected TextDelta, MediaDelta or Finished")
        raise RuntimeError("backend generator ended without a Finished event")
    except BackendError as exc:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        raise ApiError(exc.status, exc.message, headers=headers) from exc
    except Exception as exc:
        logger.exception("request %s failed in the backend", params.request_id)
        raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from exc
    finally:
        await gen.aclose()


async def collect(stream: AsyncIterator[GenerationEvent]) -> Outcome:
    """Drains ``stream`` (from :func:`events`) into an :class:`Outcome`; always closes it."""
    choices: dict[int, Choice] = {}
    media: list[MediaDelta] = []
    try:
        async for event in stream:
            if isinstance(event, Finished):
                return Outcome(choices[0].text if 0 in choices else "", event, media, choices)
            if isinstance(event, MediaDelta):
                media.append(event)
            else:
                choice = choices.get(event.index)
                if choice is None:
                    choice = choices[event.index] = Choice()
                choice.add(event)
        raise AssertionError("events() ended without Finished")
    finally:
        await stream.aclose()


async def until_disconnect(request: Request, work: Awaitable[T], stats: HttpStats) -> T:
    """Awaits ``work`` in a task and cancels it if the client disconnects first (raises ClientGone).

    Requires the request body to be consumed already: the next ASGI ``receive()`` then returns only when the
    client disconnects (or the response is complete).
    """
    task = _eager_task(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        stats.disconnected()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})  # let the backend's cleanup (abort) run to the end


def _eager_task(coro: Awaitable[T]) -> asyncio.Future[T]:
    """A task that runs ``coro`` at once, up to its first wait, on Python 3.12+ (a plain task before): a streamed
    request reaches the backend (an intake submits it to the conductor) before the loop turns to the other
    requests of a burst, not after them."""
    if EAGER_TASKS and asyncio.iscoroutine(coro):
        return asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
    return asyncio.ensure_future(coro)


EAGER_TASKS = sys.version_info >= (3, 12)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def start_stream(
    request: Request, backend: GenerationBackend, params: GenerationParams, stats: HttpStats,
    *, first: Callable[[GenerationEvent], bool] = lambda event: True,
) -> tuple[AsyncIterator[GenerationEvent], GenerationEvent]:
    """Waits for the first event for which ``first`` holds (events before it are dropped) or ``Finished``,
    before the 200 goes out, so a rejected request (prompt too long, not serving, bad knob) still gets its HTTP
    status rather than an error inside a stream. Returns the open event stream and that event."""
    stream = events(backend, params)
    try:
        event = await until_disconnect(request, _next_wanted(stream, first), stats)
    except BaseException:
        await stream.aclose()
        raise
    return stream, event


async def _next_wanted(stream: AsyncIterator[GenerationEvent], wanted: Callable[[GenerationEvent], bool]):
    while True:
        event = await stream.__anext__()
        if isinstance(event, Finished) or wanted(event):
            return event


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator, whatever ended the response.

    Starlette leaves the body iterator suspended when the client disconnects while a chunk is being sent;
    closing it here (shielded from the cancellation that ended the response) aborts the backend request. A body
    that raises :class:`StreamAborted` ends the response without its last chunk (the connection is dropped).
    """

    def __init__(self, body: AsyncGenerator[bytes, None], *, stats: HttpStats, **kwargs: Any) -> None:
        super().__init__(self._until_exhausted(body), **kwargs)
        self._body, self._stats, self._complete = body, stats, False

    async def _until_exhausted(self, body: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        first = trace.ON
        async for chunk in body:
            yield chunk
            if first:  # phase trace: the server has written the first body chunk (it asks for the next one)
                first = False
                trace.event("http_first_chunk", self.headers.get("x-request-id", ""))
        self._complete = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
            if scope["type"] == "http" and spec < (2, 4):
                await self._stream_watching(receive, send)
            else:
                await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # ASGI spec >= 2.4 servers report a gone client by failing send(); nobody is left to tell
        except StreamAborted:
            self._complete = True  # not a disconnect: the body chose to end; the server drops the connection
        finally:
            if not self._complete:
                self._stats.disconnected()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._body.aclose()

    async def _stream_watching(self, receive, send) -> None:
        """Stream the body while one plain task waits for the client to go away (ASGI spec < 2.4, such as uvicorn's
        h11 and httptools servers, tell it only through ``receive``; their ``send`` to a gone client does nothing),
        and then cancels the streaming, which closes the body and so aborts the backend request. Starlette does the
        same with an anyio task group and cancel scopes, a cost paid on every response (and an intake takes its
        requests one after another)."""
        me = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            await self.listen_for_disconnect(receive)
            gone = True
            me.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # ours when the client is gone and nobody else cancelled this task too (the server stopping)
            if not gone or me.uncancel() > 0:
                raise
        finally:
            watcher.cancel()  # no await since the streaming ended: the watcher cannot cancel this task any more
        if self.background is not None:
            await self.background()


async def first_events(request: Request, streams: list[AsyncIterator[GenerationEvent]],
                       stats: HttpStats) -> list[GenerationEvent]:
    """The first event of each stream (from :func:`events`), awaited together before the 200 goes out, so that a
    rejected request still gets its HTTP status; the first failure is raised (the streams stay open: the caller
    closes them). Raises ClientGone when the client leaves first."""
    async def firsts() -> list[GenerationEvent]:
        tasks = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()  # no-op for the finished ones
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks)

    return await until_disconnect(request, firsts(), stats)


async def merged(streams: list[AsyncIterator[GenerationEvent]], firsts: list[GenerationEvent]
                 ) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """The events of several streams (from :func:`events`, whose first events are ``firsts``) as they come, each with
    its stream's place in the list; ends when every stream has given its ``Finished``. A failure of any is raised at
    once; closing this generator (or a failure) closes every stream, which aborts what still runs."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[GenerationEvent]) -> None:
        try:
            async for event in stream:
                await queue.put((i, event, None))
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which raises it
            await queue.put((i, None, exc))

    left = len(streams)
    for i, event in enumerate(firsts):
        queue.put_nowait((i, event, None))
    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)
             if not isinstance(firsts[i], Finished)]
    try:
        while left:
            i, event, exc = await queue.get()
            if exc is not None:
                raise exc
            if isinstance(event, Finished):
                left -= 1
            yield i, event
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()


async def run_all(work: list[Awaitable[T]]) -> list[T]:
    """Runs ``work`` concurrently and returns the results in order. The first failure cancels (aborts) the others and
    is raised; cancelling this coroutine cancels them all and waits until they are closed."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # no-op for the finished ones
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)
    errors = [task.exception() for task in tasks if not task.cancelled() and task.exception() is not None]
    if errors:
        raise errors[0]
    return [task.result() for task in tasks]
