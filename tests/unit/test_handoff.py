"""Connections spread over HTTP intakes (mstar_dist/server/handoff.py, HttpServer's handoff mode). A failure means a
burst of clients piles onto some intakes while others idle (their requests then wait for each other's parsing), that
a passed connection is not served like an accepted one, or that the front end loses count of what each intake
holds."""

from __future__ import annotations

import socket
import time

from mstar_dist.server.handoff import CLOSED, Acceptor, handoff_pair
from mstar_dist.server.http_server import HttpServer, reserve_port


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _passed(theirs: socket.socket) -> list[socket.socket]:
    """Every connection waiting on an intake's end of its pair."""
    out = []
    theirs.setblocking(False)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(theirs, 16, 1)
        except BlockingIOError:
            return out
        assert msg == b"c" and len(fds) == 1
        out.append(socket.socket(fileno=fds[0]))


def test_a_burst_of_connections_is_spread_evenly_and_a_closed_one_frees_its_intake():
    pairs = [handoff_pair() for _ in range(4)]
    listener = reserve_port("127.0.0.1", 0)
    acceptor = Acceptor(listener, [ours for ours, _ in pairs])
    acceptor.start()
    port = listener.getsockname()[1]
    clients: list[socket.socket] = []
    try:
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
        _wait(lambda: sum(acceptor.passed) == 8)
        got = [_passed(theirs) for _, theirs in pairs]
        assert [len(g) for g in got] == [2, 2, 2, 2] and acceptor.open == [2, 2, 2, 2]
        got[2][0].sendall(b"hello")  # the passed socket is the client's connection itself
        assert clients[[c.getsockname() for c in clients].index(got[2][0].getpeername())].recv(5) == b"hello"
        pairs[2][1].send(CLOSED)  # intake 2 reports a closed connection: the next one goes there
        _wait(lambda: acceptor.open[2] == 1)
        clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        _wait(lambda: sum(acceptor.passed) == 9)
        assert [len(_passed(theirs)) for _, theirs in pairs] == [0, 0, 1, 0]
        pairs[1][1].close()  # intake 1 is gone: it gets nothing more
        for _ in range(3):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        _wait(lambda: sum(acceptor.passed) == 12)
        assert acceptor.passed[1] == 2 and 1 not in acceptor._live
    finally:
        acceptor.stop()
        for c in clients:
            c.close()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    try:  # stopped: the port is closed
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        raise AssertionError("the acceptor's port still takes connections")
    except ConnectionRefusedError:
        pass


def test_an_intake_serves_a_passed_connection_like_an_accepted_one_and_says_when_it_closes():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hello(request):
        return PlainTextResponse(f"hello {request.client.host}")

    ours, theirs = handoff_pair()
    server = HttpServer(Starlette(routes=[Route("/", hello)]))
    server.start("127.0.0.1", 8000, timeout_s=10, handoff=theirs)
    listener = reserve_port("127.0.0.1", 0)
    listener.listen(4)
    client = None
    try:
        assert server.port == 8000  # what the front end serves on, for the URL in logs
        client = socket.create_connection(listener.getsockname(), timeout=5)
        conn, _ = listener.accept()
        socket.send_fds(ours, [b"c"], [conn.fileno()])
        conn.close()
        for _ in range(2):  # keep-alive: both requests on the one passed connection
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while b"hello 127.0.0.1" not in reply:
                chunk = client.recv(4096)
                assert chunk, reply
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200")
        ours.settimeout(5)
        client.close()
        assert ours.recv(16) == CLOSED
    finally:
        if client is not None:
            client.close()
        server.stop(timeout_s=2)
        listener.close()
        ours.close()
        theirs.close()
