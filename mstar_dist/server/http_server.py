"""Running an ASGI app under uvicorn on a thread of its own, with its own asyncio loop: the HTTP thread of the front
end (``runtime/frontend.py``) or of an intake (``runtime/intake.py``), docs/architecture.md §2 "Threads". The
conductor thread hands events to this loop with ``call_soon_threadsafe`` (``conductor/backend.py``); nothing else
runs on it.

uvicorn parses HTTP with httptools (a dependency; h11 where it cannot be imported): an intake takes a burst's requests
one after another, and httptools costs each of them markedly less of the server's CPU than h11 (docs/architecture.md
§2, "Intake processes").
For the same reason a response's headers wait for its first body chunk and leave with it in one socket write
(``_HeadersWithBody``, on every connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import threading
import time

import uvicorn

from mstar_dist.server.handoff import CLOSED

logger = logging.getLogger(__name__)


class HttpServer:
    """uvicorn serving ``app`` on a daemon thread; ``start`` returns once it accepts connections."""

    def __init__(self, app, *, log_level: str = "warning", access_log: bool = False) -> None:
        self._app = app
        self._log_level = log_level
        self._access_log = access_log
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self.host: str | None = None
        self.port: int | None = None
        """The port actually bound (resolves ``port=0``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server thread's running loop; valid between ``start()`` and ``stop()``."""
        if self._loop is None or not self.running:
            raise RuntimeError("HttpServer is not running: call start() first")
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, host: str = "127.0.0.1", port: int = 8000, timeout_s: float = 30.0,
              sock: socket.socket | None = None, handoff: socket.socket | None = None) -> None:
        """Binds ``host:port`` (0 = any free port), or takes ``sock`` from :func:`reserve_port`, and serves;
        blocks up to ``timeout_s`` until listening. With ``handoff`` (an intake's end of ``server/handoff.py``'s
        pair) it serves the connections the front end accepted on ``host:port`` and passes on that pair instead,
        and tells it when each closes.

        Raises OSError naming ``host:port`` when the address cannot be bound (port taken, bad address), and
        RuntimeError when uvicorn fails or does not come up within ``timeout_s``.
        """
        if self._thread is not None:
            raise RuntimeError(f"HttpServer already started on {self.host}:{self.port}")
        self._handoff = handoff
        if handoff is not None:  # uvicorn serves a listening socket: one that nobody can reach
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(f"\0mstar-dist-handoff-{os.getpid()}-{id(self)}")
        sock = sock if sock is not None else reserve_port(host, port)
        sock.listen(2048)
        sock.setblocking(False)
        self.host, self.port = host, port if handoff is not None else sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            log_level=self._log_level,
            access_log=self._access_log,
            lifespan="auto",
            timeout_graceful_shutdown=10,
            log_config=None,  # uvicorn's records go to the root handler: rank, host and --log-format apply
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, args=(sock,), name="mstar-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {host}:{self.port} failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop(timeout_s=2.0)
                raise RuntimeError(f"HTTP server on {host}:{self.port} did not start within {timeout_s:.0f} s")
            time.sleep(0.01)
        if handoff is not None:
            self._loop.call_soon_threadsafe(self._take_passed)
        logger.info("HTTP server listening on %s", self.url)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops accepting, lets in-flight requests finish for up to ``timeout_s``, then cancels them (which
        closes their backend generators) and joins the thread. Blocks at most about ``2 * timeout_s``."""
        if self._thread is None or self._server is None:
            return
        self._server.config.timeout_graceful_shutdown = max(int(timeout_s), 1)
        self._server.should_exit = True
        self._thread.join(timeout_s + 2.0)
        if self._thread.is_alive():
            logger.warning("HTTP server did not stop within %.1f s; forcing", timeout_s)
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._thread = None

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        _keep_protocol_factory(loop, self)
        try:
            loop.run_until_complete(self._server.serve(sockets=[sock]))
        except BaseException as exc:  # noqa: BLE001 -- reported by start() / logged; the thread must end cleanly
            self._error = exc
            logger.exception("HTTP server thread failed")
        finally:
            try:
                _cancel_remaining(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                sock.close()
                loop.close()

    # -- connections passed by the front end (server/handoff.py) ------------------------------------------------
    _handoff: socket.socket | None = None
    _protocol_factory = None
    """uvicorn's factory of per-connection protocols, kept from its ``create_server`` call
    (``_keep_protocol_factory``)."""

    def _take_passed(self) -> None:
        self._adopting: set[asyncio.Task] = set()
        self._handoff.setblocking(False)
        self._loop.add_reader(self._handoff.fileno(), self._on_passed)

    def _on_passed(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._handoff, 16, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:  # the front end is gone: nothing more comes
                self._loop.remove_reader(self._handoff.fileno())
                return
            for fd in fds:  # the loop holds only weak references to its tasks: keep each until it is done
                task = self._loop.create_task(self._adopt(socket.socket(fileno=fd)))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        """Serve a passed connection as uvicorn serves one it accepted (TCP_NODELAY set by asyncio: the socket object
        reads its protocol back from the descriptor); the front end hears once when it closes."""
        factory = self._protocol_factory
        told = False

        def closed() -> None:
            nonlocal told
            if not told:
                told = True
                with contextlib.suppress(OSError):
                    self._handoff.send(CLOSED)

        def protocol():
            p = factory()  # already holds its headers for the first body chunk (_keep_protocol_factory)
            lost = p.connection_lost

            def connection_lost(exc):
                try:
                    lost(exc)
                finally:
                    closed()

            p.connection_lost = connection_lost
            return p

        try:
            conn.setblocking(False)
            await self._loop.connect_accepted_socket(protocol, conn)
        except Exception:  # noqa: BLE001 -- the client's connection is lost; the server goes on
            logger.warning("could not serve a connection passed by the front end", exc_info=True)
            conn.close()
            closed()

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, not yet listening (connections are refused until ``start``), so a port
    in use is reported at startup, before any rank loads its model. OSError naming the address otherwise."""
    try:
        family, kind, proto = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][:3]
        # the protocol stated (IPPROTO_TCP, not 0): asyncio turns Nagle off (TCP_NODELAY) only on connections
        # accepted from a socket that says TCP, and with Nagle on a streamed response's small writes wait for
        # the client's delayed ACK (40 ms on Linux)
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot bind HTTP server to {host}:{port}: {exc.strerror or exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (port already in use)" if exc.errno == errno.EADDRINUSE else ""
        raise OSError(exc.errno, f"cannot bind HTTP server to {host}:{port}{hint}: {exc.strerror}") from exc
    return sock


def _keep_protocol_factory(loop: asyncio.AbstractEventLoop, server: HttpServer) -> None:
    """Keep the protocol factory uvicorn passes to ``loop.create_server`` on ``server``, with every protocol it makes
    writing through a :class:`_HeadersWithBody` transport: passed connections get the same protocols (and so
    uvicorn's connection tracking and graceful shutdown) through asyncio's public ``connect_accepted_socket``, without
    reaching into uvicorn."""
    create_server = loop.create_server

    def holding(protocol_factory):
        def factory():
            protocol = protocol_factory()
            made = protocol.connection_made
            protocol.connection_made = lambda transport: made(_HeadersWithBody(transport, loop))
            return protocol
        return factory

    async def keeping(protocol_factory, *args, **kwargs):
        server._protocol_factory = holding(protocol_factory)
        return await create_server(server._protocol_factory, *args, **kwargs)

    loop.create_server = keeping


class _HeadersWithBody:
    """A connection's transport that sends a response's status line and headers with what is written next in the same
    turn of the event loop, in one socket write. uvicorn writes the headers when the app starts its response and
    each body chunk when the app sends it; the headers alone are of no use to the client, and every write is a
    system call on the intake's one thread (asyncio's ``write`` was a quarter of a server's time per streamed
    request: docs/architecture.md §2). A write that starts a response (``HTTP/1.``) waits until the next write or,
    at the latest, the end of this turn of the loop; every other write goes straight through. Everything else is
    the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held = b""

    def write(self, data) -> None:
        if self._held:
            data, self._held = self._held + bytes(data), b""
        elif data[:7] == b"HTTP/1.":
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
            return
        self._transport.write(data)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def _flush(self) -> None:
        if self._held:
            data, self._held = self._held, b""
            if not self._transport.is_closing():
                self._transport.write(data)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = b""
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return len(self._held) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
