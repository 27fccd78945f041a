"""Connections spread evenly over the HTTP intake processes (docs/architecture.md §2, "Intake processes").

A client keeps its connection (HTTP/1.1 keep-alive), so whichever intake accepts it parses all of that client's
requests, one after another. With every intake listening on the port (``SO_REUSEPORT``) the kernel picks by a hash of
the addresses, and a burst's connections pile up on a few intakes, which take their requests one after another while
others idle. Instead the front end accepts every connection (``Acceptor``, one thread) and passes its socket
(``SCM_RIGHTS`` over a Unix seqpacket pair, one per intake) to the intake that holds the fewest open connections;
each intake tells it, over the same pair, when one of them closes. The intake's uvicorn serves passed sockets as if
it had accepted them (``server/http_server.py``, ``HttpServer.start(handoff=...)``).

Wire, on each pair: front end -> intake, one message ``b"c"`` carrying one file descriptor per connection; intake ->
front end, one message ``b"x"`` per connection that closed. An intake whose end is gone gets no more connections.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading

log = logging.getLogger(__name__)

PASSED = b"c"
CLOSED = b"x"


def handoff_pair() -> tuple[socket.socket, socket.socket]:
    """(front end's end, intake's end) of the pair that passes one intake its connections."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Acceptor:
    """Accepts on ``listener`` (bound, not yet listening) and passes each connection to the intake with the fewest
    open ones (ties: the one that waited longest), on a thread of its own until ``stop``."""

    def __init__(self, listener: socket.socket, links: list[socket.socket], backlog: int = 2048) -> None:
        self._listener = listener
        self._links = list(links)
        self.open = [0] * len(links)
        """Connections passed to each intake and not yet closed."""
        self.passed = [0] * len(links)
        self._live = set(range(len(links)))
        self._backlog = backlog
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="http-acceptor", daemon=True)

    def start(self) -> None:
        """Listen and start passing connections; returns at once."""
        self._listener.listen(self._backlog)
        self._listener.setblocking(False)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting (connections not yet accepted are refused once the socket closes) and close the socket.
        Blocks at most ``timeout_s``."""
        if self._thread.is_alive():
            os.write(self._wake_w, b"\0")
            self._thread.join(timeout_s)
        self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ, "stop")
            sel.register(self._listener, selectors.EVENT_READ, "accept")
            for i, link in enumerate(self._links):
                link.setblocking(False)
                sel.register(link, selectors.EVENT_READ, i)
            while True:
                for key, _ in sel.select():
                    if key.data == "stop":
                        return
                    if key.data == "accept":
                        self._accept()
                    elif not self._closed(key.data):
                        sel.unregister(key.fileobj)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: the client is refused, the server goes on
                log.warning("HTTP acceptor: accept failed: %s", exc)
                return
            with conn:
                self._pass(conn)

    def _pass(self, conn: socket.socket) -> None:
        while self._live:
            i = min(self._live, key=lambda k: (self.open[k], self.passed[k]))
            try:
                socket.send_fds(self._links[i], [PASSED], [conn.fileno()])
            except OSError as exc:  # that intake is gone (the front end stops for it): try another
                log.warning("HTTP acceptor: intake %d takes no connections (%s)", i, exc)
                self._live.discard(i)
                continue
            self.open[i] += 1
            self.passed[i] += 1
            return
        log.error("HTTP acceptor: no intake takes connections; refused one")

    def _closed(self, i: int) -> bool:
        """Count intake ``i``'s closed connections; False once its end is gone."""
        while True:
            try:
                msg = self._links[i].recv(16)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                msg = b""
            if not msg:
                self._live.discard(i)
                return False
            self.open[i] = max(0, self.open[i] - msg.count(CLOSED))
