"""Host cost of one streamed chat completion through the HTTP app, without sockets or a model.

    python scripts/bench_http_path.py [--tokens 1 16] [--requests 400] [--out FILE]

An intake process takes its connections' requests one after another, so what one request costs it (the app's
middleware and routing, the body's validation, the response's events) decides how far apart a burst of requests
reaches the conductor (docs/architecture.md §2). This drives the real FastAPI app (`build_app`) as the ASGI server
would, one request at a time on one event loop, over a backend that answers every request with ``--tokens`` text
deltas at once (tests/fakes.py's FakeBackend), and reports the median time per request, wall and the thread's CPU
time (a VM's stolen time does not count in the latter). Not included: the HTTP
parser (uvicorn's h11), the chat template and tokenizer, the link to the conductor. Run it from another tree (for
example a `git archive` of an older commit) to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
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


async def one_request(app, body: bytes) -> int:
    """One POST /v1/chat/completions through ``app``; the bytes of its streamed body."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = [asyncio.run(measure(n, args.requests)) for n in args.tokens]
    for r in results:
        print(f"{r['tokens']:3d} tokens: {r['us_per_request_median']:7.1f} us per request (p90 "
              f"{r['us_per_request_p90']:.1f}; CPU {r['cpu_us_per_request_median']:.1f}), {r['response_bytes']} bytes",
              flush=True)
    out = {"command": " ".join([sys.executable, *sys.argv]), "tree": str(REPO),
           "machine": {"platform": platform.platform(), "python": platform.python_version()}, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
