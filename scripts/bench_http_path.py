"""Host cost of one streamed chat completion through the HTTP app, without a model.

    python scripts/bench_http_path.py [--tokens 1 16] [--requests 400] [--out FILE]
    python scripts/bench_http_path.py --socket [--parsers h11 httptools] [--rounds 3] [--out FILE]
    python scripts/bench_http_path.py --intake WEIGHTS_DIR [--requests 2000] [--out FILE]

An intake process takes its connections' requests one after another, so what one request costs it (the app's
middleware and routing, the body's validation, the response's events) decides how far apart a burst of requests
reaches the conductor (docs/architecture.md §2). This drives the real FastAPI app (`build_app`) as the ASGI server
would, one request at a time on one event loop, over a backend that answers every request with ``--tokens`` text
deltas at once (tests/fakes.py's FakeBackend), and reports the median time per request, wall and the thread's CPU
time (a VM's stolen time does not count in the latter). Not included: the HTTP
parser, the chat template and tokenizer, the link to the conductor. Run it from another tree (for
example a `git archive` of an older commit) to compare.

``--intake WEIGHTS_DIR`` puts an intake process's own backend under the app instead (``conductor/intake.py``'s
``IntakeBackend``: the chat template and tokenizer of WEIGHTS_DIR, the ``Submit`` encoded as for the wire), over a
link that answers every request at once with two text deltas, and sends a streamed ``/generate`` (what
``bench_serving.py``'s clients send) whose prompt differs on every request, so no cache sees a prompt twice.

``--socket`` adds the server around the app: a child process serves it with ``HttpServer`` (uvicorn) on a loopback
port, and one keep-alive client connection sends ``--requests`` streamed requests one after another; it reports the
server process's CPU time per request (user + system, from /proc) and the client's wall time per request, for each
HTTP parser of ``--parsers`` (a child running h11 blocks the import of httptools, so uvicorn falls back to h11),
alternated ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import select
import socket
import subprocess
import statistics
import sys
import time
from pathlib import Path

REPO = Path.cwd()
sys.path.insert(0, str(REPO))

from mstar_dist.server.app import build_app  # noqa: E402
from tests.fakes import FakeBackend  # noqa: E402

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Write a haiku about the sea, please."}],
        "max_tokens": 16, "stream": True}


async def one_request(app, body: bytes, path: str = "/v1/chat/completions") -> int:
    """One POST to ``path`` through ``app``; the bytes of its streamed body."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())], "state": {}}
    delivered = False
    sent = 0

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays: the response's disconnect listener waits here

    async def send(message):
        nonlocal sent
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"{path} answered {message['status']}: the benchmark times only served requests")
        sent += len(message.get("body", b""))

    await app(scope, receive, send)
    return sent


async def measure(tokens: int, requests: int) -> dict:
    backend = FakeBackend(deltas=["hi"] * tokens)
    backend.max_tokens_limit = max(tokens, 16)
    app = build_app(backend)
    body = json.dumps(BODY).encode()
    for _ in range(50):  # the app's first requests build its validators and serialisers
        await one_request(app, body)
    gc.collect()
    gc.freeze()  # as a serving process does once it is up (mstar_dist/heap.py): no walk of the startup heap
    times, cpu = [], []
    for _ in range(requests):
        t0, c0 = time.perf_counter(), time.thread_time()
        size = await one_request(app, body)
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
    return {"tokens": tokens, "requests": requests, "us_per_request_median": round(statistics.median(times) * 1e6, 1),
            "us_per_request_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
            "cpu_us_per_request_median": round(statistics.median(cpu) * 1e6, 1), "response_bytes": size}


class _AnsweringLink:
    """An intake's link to the conductor that encodes what it is given as for the wire and answers each ``Submit``
    at once (``ConductorLink``'s place in ``--intake``)."""

    health = (True, "")

    def __init__(self) -> None:
        self.backend = None

    def send(self, body) -> None:
        from mstar_dist.control import messages as m
        from mstar_dist.events import Finished, TextDelta

        m.encode("t" * 32, "intake0", body)
        if isinstance(body, m.Submit):
            rid = body.params.request_id
            self.backend.deliver([(rid, TextDelta("hi", 1)), (rid, TextDelta(" there", 1)),
                                  (rid, Finished("length", 40, 2))])


async def measure_intake(weights: str, requests: int) -> dict:
    from models.llama.tokenizer import ChatTokenizer
    from mstar_dist.conductor.intake import IntakeBackend
    from mstar_dist.server.http_metrics import HttpStats

    link, stats = _AnsweringLink(), HttpStats()
    backend = IntakeBackend(link, stats, model_name="bench", max_context_tokens=2048, max_tokens_limit=256,
                            output_modality="text", encoder=ChatTokenizer(weights))
    link.backend = backend
    app = build_app(backend, stats=stats)
    content = "Write a long story about a lighthouse keeper who finds a message in a bottle, in detail. "

    def body(i: int) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": f"{content}{i}"}], "stream": True,
                           "model_kwargs": {"max_tokens": 256}}).encode()

    for i in range(300):
        await one_request(app, body(-i), "/generate")
    gc.collect()
    gc.freeze()
    times, cpu = [], []
    for i in range(requests):
        data = body(i)
        t0, c0 = time.perf_counter(), time.thread_time()
        size = await one_request(app, data, "/generate")
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
    return {"route": "/generate", "requests": requests,
            "us_per_request_median": round(statistics.median(times) * 1e6, 1),
            "cpu_us_per_request_median": round(statistics.median(cpu) * 1e6, 1), "response_bytes": size}


SERVER_START_S = 60.0
PARSERS = {"h11": ("httptools",), "httptools": ()}
"""uvicorn's HTTP parser -> the modules a ``--socket`` server child must not import to run it."""


def serve(parser: str) -> None:
    """The ``--socket`` server child: the app over FakeBackend (two text deltas a request) on a free loopback port,
    which it prints, until killed."""
    for name in PARSERS[parser]:
        sys.modules[name] = None  # import fails: uvicorn parses with h11
    from mstar_dist.server.http_server import HttpServer

    backend = FakeBackend(deltas=["hi", "there"])
    backend.max_tokens_limit = 16
    server = HttpServer(build_app(backend))
    server.start("127.0.0.1", 0)
    gc.collect()
    gc.freeze()
    print(server.port, flush=True)
    time.sleep(3600)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure_socket(parser: str, requests: int, warm: int = 300) -> dict:
    """One server child with ``parser``: its CPU and the client's wall time per request, over ``requests`` streamed
    chat completions after ``warm`` untimed ones."""
    child = subprocess.Popen([sys.executable, __file__, "--serve", parser], stdout=subprocess.PIPE, text=True)
    try:
        if not select.select([child.stdout], [], [], SERVER_START_S)[0]:
            raise RuntimeError(f"the {parser} server child did not report its port within {SERVER_START_S:g} s")
        line = child.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the {parser} server child failed to start (exit code {child.poll()}): {line!r}")
        port = int(line)
        body = json.dumps(BODY).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def one() -> None:
                conn.sendall(head + body)
                got = b""
                while not got.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
                    data = conn.recv(65536)
                    if not data:
                        raise RuntimeError(f"the server closed the connection: {got[-300:]!r}")
                    got += data
                if not got.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the server answered {got[:300]!r}")

            for _ in range(warm):  # the app's first requests build its validators and serialisers
                one()
            cpu0, t0 = _cpu_seconds(child.pid), time.perf_counter()
            for _ in range(requests):
                one()
            wall, cpu = time.perf_counter() - t0, _cpu_seconds(child.pid) - cpu0
    finally:
        child.kill()
        child.wait(10)
    return {"parser": parser, "requests": requests, "server_cpu_us_per_request": round(cpu / requests * 1e6, 1),
            "wall_us_per_request": round(wall / requests * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--out", default=None)
    p.add_argument("--socket", action="store_true", help="through a server child on a loopback socket")
    p.add_argument("--parsers", nargs="+", choices=sorted(PARSERS), default=["h11", "httptools"])
    p.add_argument("--rounds", type=int, default=3, help="--socket: rounds, the parsers alternated in each")
    p.add_argument("--intake", metavar="WEIGHTS_DIR", help="an intake's backend with this tokenizer under the app")
    p.add_argument("--serve", choices=sorted(PARSERS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.intake:
        results = asyncio.run(measure_intake(args.intake, args.requests))
        print(f"intake /generate: {results['us_per_request_median']:.1f} us per request (CPU "
              f"{results['cpu_us_per_request_median']:.1f})", flush=True)
    elif args.socket:
        results = []
        for _ in range(args.rounds):
            for parser in args.parsers:
                results.append(measure_socket(parser, args.requests))
                print(f"{parser:10s} server CPU {results[-1]['server_cpu_us_per_request']:7.1f} us per request, "
                      f"wall {results[-1]['wall_us_per_request']:7.1f}", flush=True)
        medians = {parser: statistics.median(r["server_cpu_us_per_request"] for r in results
                                             if r["parser"] == parser) for parser in args.parsers}
        print("median server CPU us per request: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
        results = {"runs": results, "server_cpu_us_per_request_median": medians}
    else:
        results = [asyncio.run(measure(n, args.requests)) for n in args.tokens]
        for r in results:
            print(f"{r['tokens']:3d} tokens: {r['us_per_request_median']:7.1f} us per request (p90 "
                  f"{r['us_per_request_p90']:.1f}; CPU {r['cpu_us_per_request_median']:.1f}), {r['response_bytes']} "
                  f"bytes", flush=True)
    out = {"command": " ".join([sys.executable, *sys.argv]), "tree": str(REPO),
           "machine": {"platform": platform.platform(), "python": platform.python_version()}, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
