"""How a streamed response reaches the socket (mstar_dist/server/http_server.py ``_HeadersWithBody``, the SSE body of
mstar_dist/server/app.py). An intake takes a burst's requests one after another, and each socket write is a system
call on its one thread, so what is ready together leaves together. A failure here means bytes lost, reordered or held
back (a client waits for headers or an event that was written), or the writes of a request's first token multiplied
again."""

from __future__ import annotations

import asyncio
import json
import socket

from mstar_dist.server.app import build_app
from mstar_dist.server.http_server import HttpServer, _HeadersWithBody
from tests.fakes import FakeBackend

HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"


class Recording:
    """A transport that records what reaches it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.calls: list[str] = []
        self.closing = False

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 9)}.get(name, default)


def test_headers_leave_with_the_next_write_or_at_the_end_of_the_loop_turn():
    async def run() -> None:
        inner = Recording()
        t = _HeadersWithBody(inner, asyncio.get_running_loop())
        t.write(HEADERS)
        assert inner.writes == [] and t.get_write_buffer_size() == len(HEADERS)
        t.write(b"5\r\nfirst\r\n")
        t.write(b"6\r\nsecond\r\n")
        assert inner.writes == [HEADERS + b"5\r\nfirst\r\n", b"6\r\nsecond\r\n"]  # one write, then straight through
        inner.writes.clear()
        t.write(HEADERS)  # a response with nothing after it in this turn (a 100 Continue, say)
        await asyncio.sleep(0)
        assert inner.writes == [HEADERS]
        assert t.get_extra_info("peername") == ("127.0.0.1", 9)  # the rest is the transport's own

    asyncio.run(run())


def test_held_headers_are_written_before_a_close_and_dropped_by_an_abort():
    async def run() -> None:
        inner = Recording()
        t = _HeadersWithBody(inner, asyncio.get_running_loop())
        t.write(HEADERS)
        t.close()
        assert inner.writes == [HEADERS] and inner.calls == ["close"]
        await asyncio.sleep(0)  # the scheduled flush finds nothing more to write
        assert inner.writes == [HEADERS]
        inner = Recording()
        t = _HeadersWithBody(inner, asyncio.get_running_loop())
        t.write(HEADERS)
        t.abort()
        await asyncio.sleep(0)
        assert inner.writes == [] and inner.calls == ["abort"]

    asyncio.run(run())


def _chat(stream: bool) -> bytes:
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": stream}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def _response(conn: socket.socket) -> bytes:
    got = b""
    while not (got.endswith(b"\r\n0\r\n\r\n") or (b"content-length" in got and got.endswith(b"}"))):
        data = conn.recv(65536)
        assert data, f"the server closed the connection: {got!r}"
        got += data
    return got


class Tap:
    """Forwards to a connection's transport and records each write that reaches it (the socket writes)."""

    def __init__(self, transport, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def test_a_streamed_response_starts_with_its_headers_role_and_first_token_in_one_write_and_keeps_every_byte(
        monkeypatch):
    writes: list[bytes] = []
    real_init = _HeadersWithBody.__init__
    monkeypatch.setattr(_HeadersWithBody, "__init__",
                        lambda self, transport, loop: real_init(self, Tap(transport, writes), loop))
    server = HttpServer(build_app(FakeBackend(deltas=["one", " two", " three"])))
    server.start("127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(_chat(stream=False))  # a JSON response first, then a stream on the same connection
            plain = _response(conn)
            assert plain.startswith(b"HTTP/1.1 200") and b'"content":"one two three"' in plain
            assert len(writes) == 1  # headers and body together
            conn.sendall(_chat(stream=True))
            streamed = _response(conn)
    finally:
        server.stop()
    head, _, body = streamed.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    events = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
    assert [e["choices"][0]["delta"].get("content") for e in events] == ["", "one", " two", " three", None]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1]["choices"][0]["finish_reason"]
    assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    # what reached the socket: the headers with the role and the first token, each later token, the finish with
    # [DONE], the chunked body's end
    stream_writes = writes[1:]
    assert b"".join(stream_writes) == streamed
    assert stream_writes[0].startswith(b"HTTP/1.1 200") and b'"content":"one"' in stream_writes[0]
    assert len(stream_writes) == 5, stream_writes
