"""The backend of an HTTP intake process (docs/architecture.md §2, "Intake processes"): requests go to the conductor
over this process's control channel, what comes back reaches the waiting handlers on the HTTP loop.

:class:`IntakeBackend` is the ``GenerationBackend`` the app (``server/app.py``) serves in an intake, as
``conductor/backend.py``'s ``ConductorBackend`` is in the front end. :class:`ConductorLink` owns the channel: until
uvicorn runs, a link thread receives (the conductor's first ``Health``); then the HTTP loop itself watches the
channel's descriptors (``add_reader``) and takes ``Outputs``, ``Health`` and ``MetricsText`` in its own turn.
``Submit`` / ``Cancel`` / ``MetricsAsk`` leave from the HTTP thread. The process around them is ``runtime/intake.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from mstar_dist import trace
from mstar_dist.conductor.backend import relay_queue
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ControlChannel
from mstar_dist.control.envelope import CONDUCTOR, Reject, open_envelope
from mstar_dist.events import BackendError, Failed, Finished, GenerationEvent, GenerationParams, TextDelta, from_wire

log = logging.getLogger(__name__)

METRICS_WAIT_S = 5.0
"""How long ``/metrics`` waits for the conductor's answer."""
COUNTS_EVERY_S = 1.0
"""How often an intake reports its HTTP counts when they changed."""


class ConductorLink:
    """The receiver on this intake's control channel, and the channel's senders' lock. It receives on the link
    thread until the HTTP loop runs (startup: the conductor's first ``Health``), then on the HTTP loop itself
    (``attach``): the conductor's ``Outputs`` reach the waiting handlers in the loop's own turn, with no thread
    between (a hand-off from a receiving thread cost every delivery a second wake-up: docs/architecture.md §2)."""

    def __init__(self, channel: ControlChannel, token: str, name: str) -> None:
        self.channel, self.token, self.name = channel, token, name
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._handover = threading.Event()
        self.health: tuple[bool, str] | None = None
        """The conductor's last word on whether the deployment serves (None until its first ``Health``)."""
        self.heard = threading.Event()
        """Set with the conductor's first ``Health`` (an intake starts serving only then)."""
        self.backend: IntakeBackend | None = None
        self.thread = threading.Thread(target=self._run, name="conductor-link", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: set[int] = set()
        self.failed: str | None = None
        """Why receiving on the HTTP loop stopped (an error there), or None."""
        self._last_counts: Any = None
        self._counted_at = 0.0

    @property
    def alive(self) -> bool:
        """Whether something receives the conductor's messages (the thread, or the HTTP loop once attached)."""
        if self._loop is not None:
            return self.failed is None
        return self.thread.is_alive()

    def send(self, body: m.Message) -> None:
        """Send ``body`` to the conductor now, from the calling thread (the HTTP loop's or the link thread). A lock
        orders the senders on the channel's sending side, which its receives do not touch (``ControlChannel.send``
        never blocks)."""
        with self._send_lock:
            self._send(body)

    def attach(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0) -> None:
        """From the main thread, once uvicorn runs ``loop``: end the link thread, then receive on the loop."""
        self._handover.set()
        self.channel.wake()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"the link thread did not hand the channel over within {timeout_s:g} s")
        asyncio.run_coroutine_threadsafe(self._attach_here(), loop).result(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self.channel.wake()
        if self.thread.is_alive():
            self.thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self._handover.is_set():
                items = self._take(self.channel.recv(100))
                if items:
                    self.backend.deliver(items)
                self._count()
        except Exception:
            log.exception("%s: the link thread to the conductor failed", self.name)

    async def _attach_here(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.backend is not None:
            self.backend.loop = self._loop
        self._readable()  # what came while the thread handed over (ZMQ's descriptor signals only new arrivals)
        self._loop.call_later(COUNTS_EVERY_S, self._count_on_loop)

    def _readable(self) -> None:
        """HTTP loop: a descriptor of the channel is ready. Drain it, deliver, and watch the channel's descriptors
        as they are now (a local link accepted meanwhile is one more)."""
        if self.failed is not None:
            return
        try:
            while not self._stop.is_set():
                messages = self.channel.recv(0)
                if not messages:
                    break
                items = self._take(messages)
                if items:
                    self.backend._deliver(items)
            fds = self.channel.fds()
        except Exception as exc:
            log.exception("%s: receiving from the conductor failed", self.name)
            self.failed = f"{type(exc).__name__}: {exc}"
            fds = set()
        for fd in self._readers - fds:
            self._loop.remove_reader(fd)
        for fd in fds - self._readers:
            self._loop.add_reader(fd, self._readable)
        self._readers = fds

    def _count_on_loop(self) -> None:
        if self._stop.is_set() or self.failed is not None:
            return
        try:
            self._count()
        finally:
            self._loop.call_later(COUNTS_EVERY_S, self._count_on_loop)

    def _take(self, messages: list[tuple[str, bytes]]) -> list:
        """The items of the conductor's messages to deliver (``Health`` is kept here); none before there is a
        backend."""
        items: list = []
        for sender, payload in messages:
            env = open_envelope(payload, sender, self.token, CONDUCTOR.__eq__)
            if isinstance(env, Reject):
                log.warning("%s: %s", self.name, env)
                continue
            body = env.body
            if isinstance(body, m.Outputs):
                items.extend(body.items)
            elif isinstance(body, m.Health):
                self.health = (body.serving, body.reason)
                self.heard.set()
            elif isinstance(body, m.MetricsText):
                items.append(body)
        return items if self.backend is not None else []

    def _count(self) -> None:
        """Report this intake's HTTP counts when they changed, at most every ``COUNTS_EVERY_S``."""
        now = time.monotonic()
        if self.backend is None or now - self._counted_at < COUNTS_EVERY_S:
            return
        self._counted_at = now
        counts = self.backend.counts()
        if counts != self._last_counts:
            self._last_counts = counts
            self.send(counts)

    def _send(self, body: m.Message) -> None:
        try:
            self.channel.send(CONDUCTOR, m.encode(self.token, self.name, body))
            if trace.ON and isinstance(body, m.Submit):  # phase trace: handed to the socket
                trace.event("intake_sent", body.params.request_id)
        except Exception as exc:  # the conductor does not read: its requests fail here instead of hanging
            log.error("%s: cannot reach the conductor: %s", self.name, exc)
            if isinstance(body, m.Submit) and self.backend is not None:
                self.backend.deliver([(body.params.request_id, Failed(503, f"the conductor is unreachable: {exc}"))])


class IntakeBackend:
    """``GenerationBackend`` of an intake process: requests go to the conductor through :class:`ConductorLink`.
    Every method but ``deliver`` and ``counts`` runs on the HTTP loop."""

    http_stats_merged = True
    """``metrics_text()`` already holds the HTTP metrics of every intake (the app adds none of its own)."""

    def __init__(self, link: ConductorLink, stats, *, model_name: str, max_context_tokens: int,
                 max_tokens_limit: int, output_modality: str, encoder: Any = None,
                 output_modalities: list[str] | None = None, input_modalities: list[str] | None = None,
                 weights: str = "checkpoint") -> None:
        """``encoder``: the family's prompt encoder (``CompositeModel.prompt_encoder``), or None: the conductor
        tokenizes. The rest: ``runtime.deployment.served``."""
        self.link, self.stats = link, stats
        self.encoder = encoder
        self.tokenizer = encoder
        """The family's prompt encoder as ``/tokenize``, token-id prompts and logprobs use it
        (``server/tokenizer.py``); None: the model has none here."""
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.max_tokens_limit = max_tokens_limit
        self.output_modality = output_modality
        self.output_modalities = tuple(output_modalities or (output_modality,))
        self.input_modalities = tuple(input_modalities or ("text",))
        self.weights = weights
        self.loop: asyncio.AbstractEventLoop | None = None
        """uvicorn's loop, where ``deliver`` hands items from another thread; taken by the first request that needs it
        (``generate``, ``metrics_text``), so nothing is delivered to a loop no request runs on."""
        self._queues: dict[str, asyncio.Queue] = {}
        self._asks: dict[int, asyncio.Future] = {}
        self._next_ask = 0
        self.warming = False
        """Set only by ``runtime.intake.warm_up``, before the intake listens: requests get a canned reply, nothing is
        sent."""

    def health(self) -> tuple[bool, str]:
        return self.link.health or (False, "starting: no word from the conductor yet")

    def counts(self) -> m.HttpCounts:
        """This intake's HTTP counts (reported by ``ConductorLink``; prometheus_client locks its values)."""
        requests, in_flight, disconnects = self.stats.counts()
        return m.HttpCounts(requests=requests, in_flight=in_flight, disconnects=disconnects)

    async def metrics_text(self) -> str:
        self.loop = asyncio.get_running_loop()
        self._next_ask += 1
        ask = self._next_ask
        future = asyncio.get_running_loop().create_future()
        self._asks[ask] = future
        try:
            self.link.send(m.MetricsAsk(ask=ask, counts=self.counts()))
            return await asyncio.wait_for(future, METRICS_WAIT_S)
        except asyncio.TimeoutError:
            raise BackendError(503, f"the conductor did not answer within {METRICS_WAIT_S:g} s") from None
        finally:
            self._asks.pop(ask, None)

    def deliver(self, items: list) -> None:
        """Link thread: hand ``items`` to the HTTP loop in one wake-up."""
        loop = self.loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._deliver, items)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            pass

    def _deliver(self, items: list) -> None:
        for item in items:
            if isinstance(item, m.MetricsText):
                future = self._asks.get(item.ask)
                if future is not None and not future.done():
                    future.set_result(item.text)
                continue
            request_id, event = item
            events = self._queues.get(request_id)
            if events is not None:
                events.put_nowait(from_wire(event))

    async def generate(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        if self.warming:
            yield TextDelta(text="ok", n_tokens=1)
            yield Finished(finish_reason="stop", prompt_tokens=1, completion_tokens=1)
            return
        ok, reason = self.health()
        if not ok:
            raise BackendError(503, f"not serving: {reason}")
        if params.request_id in self._queues:
            raise BackendError(409, f"request_id {params.request_id!r} is already in flight; use a new id")
        self.loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self._queues[params.request_id] = events
        # media placeholders are the family's preprocess's; ids the server already has (a token-id prompt, one it
        # counted up front) stay as they are
        if self.encoder is not None and params.prompt_ids is None and not params.media:
            params = dataclasses.replace(params, prompt_ids=self._encode(params))
        if trace.ON:
            trace.event("http_submitted", params.request_id)
        self.link.send(m.Submit(params=params, pinned_id=True))
        cancel = lambda: self.link.send(m.Cancel(request_id=params.request_id))  # noqa: E731
        try:
            async with contextlib.aclosing(relay_queue(events, params.request_id, cancel)) as relay:
                async for event in relay:
                    yield event
        finally:
            self._queues.pop(params.request_id, None)

    def _encode(self, params: GenerationParams) -> list[int] | None:
        """The prompt's ids, encoded here rather than on the conductor thread (a burst of requests would queue behind
        the encoding there). None when the encoder fails: the conductor tokenizes again and answers the client as it
        always does (a 400 naming what is wrong)."""
        try:
            return self.encoder.encode_prompt(params.prompt, params.messages)
        except Exception:
            return None


