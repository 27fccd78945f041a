"""An HTTP intake process: the FastAPI app on the shared port, talking to the conductor over its control socket
(docs/architecture.md §2, "Intake processes"; ``server.http_processes`` > 1).

The front end spawns N of them (``python -m mstar_dist.conductor.intake --index k``) so that a burst of arrivals
is parsed, validated and framed by N interpreters instead of the one HTTP thread that shares the conductor's GIL.
The front end accepts the connections on ``server.host:port`` and passes each to the intake with the fewest open
ones (``server/handoff.py``: a client keeps its connection, so that is where its requests are parsed). Its HTTP thread
runs uvicorn and the app (``server/app.py``) with :class:`IntakeBackend` as its backend, and on the same loop receives
on this process's control channel (``intake<k>``, :class:`ConductorLink`: the channel's descriptors watched with
``add_reader``) what comes back (``Outputs``, ``Health``, ``MetricsText``); until uvicorn runs, a link thread receives
(the first ``Health``). ``Submit`` / ``Cancel`` / ``MetricsAsk`` leave from the HTTP thread itself.

Startup, as JSON lines with the front end (no pickle): it binds its channel and writes ``{"endpoint"}``; reads the
handover (the launch's secret, the conductor's endpoint, what the app serves) on stdin; connects, waits for the
conductor's first ``Health``, starts uvicorn on the connections passed to it and writes ``{"listening": port}``. It
stops on SIGTERM (in-flight responses get up to 5 s to finish) or when its stdin closes (the front end is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from mstar_dist import trace
from mstar_dist.conductor.backend import relay_queue
from mstar_dist.conductor.process import (
    _OUT_FD, _WHERE, SWITCH_INTERVAL_S, ChildProcess, _read_line, watch_parent,
)
from mstar_dist.control import messages as m
from mstar_dist.events import (
    BackendError, Failed, Finished, GenerationEvent, GenerationParams, TextDelta, from_wire,
)
from mstar_dist.server.handoff import handoff_pair

log = logging.getLogger(__name__)

HEALTH_WAIT_S = 10.0
"""How long an intake waits for the conductor's first ``Health`` before it gives up starting."""
METRICS_WAIT_S = 5.0
"""How long ``/metrics`` waits for the conductor's answer."""
COUNTS_EVERY_S = 1.0
"""How often an intake reports its HTTP counts when they changed."""


class IntakeProcess(ChildProcess):
    """The front end's handle on one intake process; ``link`` is the front end's end of the pair on which it passes
    the intake its connections (``server/handoff.py``)."""

    def __init__(self, index: int, *, host_name: str, addr: str, log_level: str, log_format: str):
        self.what = f"HTTP intake {index}"
        self.name = f"intake{index}"
        self.link, theirs = handoff_pair()
        try:
            super().__init__("mstar_dist.conductor.intake",
                             ["--index", str(index), "--log-level", log_level, "--log-format", log_format,
                              "--handoff-fd", str(theirs.fileno())],
                             {_WHERE: f"{host_name} {addr}", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
                             pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()


class ConductorLink:
    """The receiver on this intake's control channel, and the channel's senders' lock. It receives on the link
    thread until the HTTP loop runs (startup: the conductor's first ``Health``), then on the HTTP loop itself
    (``attach``): the conductor's ``Outputs`` reach the waiting handlers in the loop's own turn, with no thread
    between (a hand-off from a receiving thread cost every delivery a second wake-up: docs/architecture.md §2)."""

    def __init__(self, channel, token: str, name: str) -> None:
        self.channel, self.token, self.name = channel, token, name
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._handover = threading.Event()
        self.health: tuple[bool, str] | None = None
        """The conductor's last word on whether the deployment serves (None until its first ``Health``)."""
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
            try:
                env = m.decode(payload)
            except Exception as exc:
                log.warning("%s: dropped an undecodable message from %r: %s", self.name, sender, exc)
                continue
            if env.token != self.token or sender != "conductor" or env.sender != sender:
                log.warning("%s: rejected a message from %r (not this launch's conductor)", self.name, sender)
                continue
            body = env.body
            if isinstance(body, m.Outputs):
                items.extend(body.items)
            elif isinstance(body, m.Health):
                self.health = (body.serving, body.reason)
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
            self.channel.send("conductor", m.encode(self.token, self.name, body))
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
                 max_tokens_limit: int, output_modality: str, encoder: Any = None) -> None:
        """``encoder``: the family's prompt encoder (``CompositeModel.prompt_encoder``), or None: the conductor
        tokenizes."""
        self.link, self.stats = link, stats
        self.encoder = encoder
        self.model_name = model_name
        self.max_context_tokens = max_context_tokens
        self.max_tokens_limit = max_tokens_limit
        self.output_modality = output_modality
        self.loop: asyncio.AbstractEventLoop | None = None
        """uvicorn's loop, where ``deliver`` hands items from another thread; taken by the first request that needs it
        (``generate``, ``metrics_text``), so nothing is delivered to a loop no request runs on."""
        self._queues: dict[str, asyncio.Queue] = {}
        self._asks: dict[int, asyncio.Future] = {}
        self._next_ask = 0
        self.warming = False
        """Set only by :func:`warm_up`, before the intake listens: requests get a canned reply, nothing is sent."""

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
        if self.encoder is not None:
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
        """The prompt's ids, encoded here rather than on the conductor thread (it takes ~0.1-0.4 ms a request: a
        burst of requests would queue behind it there). None when the encoder fails: the conductor tokenizes again and
        answers the client as it always does (a 400 naming what is wrong)."""
        try:
            return self.encoder.encode_prompt(params.prompt, params.messages)
        except Exception:
            return None


def load_prompt_encoder(spec: list | tuple | None) -> Any:
    """Build the family's prompt encoder from its ``("package.module:Factory", kwargs)`` (``prompt_encoder``); None
    for none, or when it cannot be built here (the conductor then tokenizes, as with one HTTP process)."""
    if spec is None:
        return None
    from models import load_object  # the zoo's registry module imports no torch

    path, kwargs = spec
    try:
        encoder = load_object(path)(**kwargs)
        with contextlib.suppress(Exception):  # a first call pays for lazily built tables, not a client's request
            encoder.encode_prompt(None, [{"role": "user", "content": "warm-up"}])
        return encoder
    except Exception as exc:
        log.warning("intake: cannot build the prompt encoder %s (%s: %s); the conductor tokenizes instead", path,
                    type(exc).__name__, exc)
        return None


def warm_up(app, backend: IntakeBackend, api_key: str | None) -> None:
    """Run the app's generation routes once, streamed and not, against canned replies, before the intake listens.
    A first request through the app costs ~20 ms more than the next ones (measured on the CI machine: 21.9
    against 1.4 ms); with several intakes, clients would pay it once per intake after every start."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = {"messages": [{"role": "user", "content": "warm-up"}], "max_tokens": 1}
    native = {"prompt": "warm-up"}

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://intake",
                                     headers=headers) as client:
            for path, body in (("/v1/chat/completions", chat), ("/generate", native)):
                for stream in (False, True):
                    response = await client.post(path, json={**body, "stream": stream})
                    if response.status_code != 200:
                        log.warning("intake warm-up: %s gave %d: %s", path, response.status_code, response.text[:200])

    backend.warming = True
    try:
        asyncio.run(run())
    finally:
        backend.warming = False


def main(argv: list[str] | None = None) -> int:
    from mstar_dist.control.channel import ControlChannel
    from mstar_dist.heap import freeze_startup_heap
    from mstar_dist.logs import configure_logging
    from mstar_dist.server.app import build_app
    from mstar_dist.server.http_metrics import HttpStats
    from mstar_dist.server.http_server import HttpServer

    p = argparse.ArgumentParser(prog="python -m mstar_dist.conductor.intake")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text")
    p.add_argument("--handoff-fd", type=int, required=True, help="this intake's end of the front end's pair "
                   "(server/handoff.py): the connections it serves come on it")
    args = p.parse_args(argv)
    name = f"intake{args.index}"
    trace.set_process(name)
    host_name, addr = os.environ[_WHERE].split(" ", 1)
    configure_logging(args.log_level, rank=0, host=host_name, fmt=args.log_format, progress="off")
    if (os.cpu_count() or 1) >= 8:  # threads hand work over (the link thread until uvicorn runs), as in the front end
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    out = os.fdopen(int(os.environ[_OUT_FD]), "wb")
    stop = threading.Event()

    def report(obj: dict[str, Any]) -> None:
        import json

        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    channel = link = http = None
    rc = 0
    try:
        channel = ControlChannel(name, addr)
        report({"endpoint": channel.endpoint})
        import json

        line = _read_line(sys.stdin.fileno(), 600.0)
        if line is None:
            raise RuntimeError("the front end did not hand over within 600 s")
        h: dict[str, Any] = json.loads(line)
        # from here on a stop drains what is in flight (before, SIGTERM's default ending is the right one)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        channel.connect("conductor", h["conductor"])
        link = ConductorLink(channel, h["token"], name)
        stats = HttpStats()
        backend = IntakeBackend(link, stats, model_name=h["model_name"], max_context_tokens=h["max_context_tokens"],
                                max_tokens_limit=h["max_tokens_limit"], output_modality=h["output_modality"],
                                encoder=load_prompt_encoder(h.get("prompt_encoder")))
        link.backend = backend
        link.thread.start()
        deadline = time.monotonic() + HEALTH_WAIT_S
        while link.health is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no word from the conductor within {HEALTH_WAIT_S:g} s")
            time.sleep(0.005)
        app = build_app(backend, api_key=h["api_key"], max_body_bytes=h["max_body_bytes"], stats=stats)
        if backend.output_modality == "text":
            warm_up(app, backend, h["api_key"])
            stats.reset()
        http = HttpServer(app)
        http.start(h["host"], h["port"], timeout_s=30, handoff=socket.socket(fileno=args.handoff_fd))
        # the app, its warmed routes and what uvicorn imported as it started leave the collector (heap.py); before
        # the front end hears that this intake listens, so before any request can come
        freeze_startup_heap()
        link.attach(http.loop)
        report({"listening": http.port})
        threading.Thread(target=watch_parent, args=(stop, "the front end"), name="parent-watch", daemon=True).start()
        while not stop.wait(0.2):
            if not http.running:
                raise RuntimeError("the HTTP thread ended")
            if not link.alive:  # nothing would come from the conductor: stop, and the front end says so
                raise RuntimeError("receiving from the conductor stopped; see the error above")
    except Exception as exc:
        log.error("%s failed: %s", name, exc, exc_info=not isinstance(exc, (TimeoutError, RuntimeError)))
        rc = 1
    finally:
        if http is not None:
            http.stop(timeout_s=5.0)  # what is in flight got its last events from the conductor already
        if link is not None:
            link.stop()
        if channel is not None:
            channel.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
