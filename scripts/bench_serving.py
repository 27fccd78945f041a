"""Serving benchmark: our deployments vs HF transformers ``generate`` vs a bare batched loop, side by side in one run.

    python scripts/bench_serving.py [--config launch/configs/smollm2_pd.yaml:2 ...] [--streams 1 8 32 64]
                                    [--rounds 3] [--max-tokens 64] [--device cpu|cuda] [--route generate chat]
                                    [--out FILE]

Measures, alternating the contenders round by round so machine noise hits them alike (medians reported):
- cold start of each deployment: torchrun launch to ``/health`` 200 (weights already prepared);
- ours, for every ``--config PATH:NPROC`` (P/D split, single rank, ...): output tok/s and median TTFT at each
  ``--streams`` concurrency (streaming ``/generate``, ``2 x streams`` requests, at least 4), on each ``--route``:
  ``generate`` (the default; keys ``<config>_<streams>``) and/or ``chat`` (streaming ``/v1/chat/completions``, the
  same messages and ``max_tokens`` with ``ignore_eos`` so every answer is that long, TTFT at the first content delta,
  tokens from the usage of the last chunk; keys ``<config>_chat_<streams>``);
- HF ``generate`` (greedy) at batch 1 and batched at 8 (left-padded) on the same weights and prompts;
- the bare loop (our model + KV cache, no serving; ``mstar_dist/tools/bare_loop.py``) at batch = streams, eager and,
  on CUDA, replaying CUDA graphs like the engine (the yardstick of the GPU targets, timed over its decode steps
  alone: ``tok_s`` is ``decode_tok_s`` there, the whole run is ``tok_s_with_prefill``) with the engine's Triton kernels
  where they run (in-place decode attention, fused pointwise; ``--bare-sdpa``, ``--bare-unfused``: without); on the
  CPU with the engine's oneDNN-packed weights (``models/common/linear.py``; ``--no-packed-bare``: ``F.linear``).
Ratios and the targets of "Serve at the GPU's pace" go into the JSON (``--out``, default
``bench/raw/serving_<device>.json``, git-ignored). Every request asks for ``--max-tokens`` greedy tokens; all prompts
are long-answer prompts so EOS rarely ends them early, and tok/s counts the tokens actually produced.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures as cf
import itertools
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import yaml
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.soak import per_rank  # noqa: E402
from tests.e2e.server import WEIGHTS, Server  # noqa: E402

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a journey across the Sahara desert on a camel, day by day.",
    "Write a detailed essay about the history of the printing press.",
    "Tell me everything you know about the planets of the solar system.",
    "Write a long letter from a sailor to his family back home.",
    "Explain how bread is made, from growing wheat to baking the loaf.",
    "Describe a busy market in a medieval town in great detail.",
]


_local = threading.local()


ROUTES = {"generate": "/generate", "chat": "/v1/chat/completions"}
"""``--route``: the streaming route each request goes to (native NDJSON, or OpenAI's server-sent events)."""


def request_body(prompt: str, max_tokens: int, route: str = "generate") -> dict:
    """The streaming request of ``route``: the same chat messages, greedy, ``max_tokens``. A chat request also asks
    for exactly ``max_tokens`` (``ignore_eos``) and for the usage in a last chunk (``stream_options``)."""
    messages = [{"role": "user", "content": prompt}]
    if route == "chat":
        return {"messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
    return {"messages": messages, "stream": True, "model_kwargs": {"max_tokens": max_tokens, "temperature": 0}}


class _Tally:
    """What a client keeps of one streamed /generate response: the time of its first line with tokens and the
    completion tokens its last line reports. Times are ``time.monotonic()``, the clock of the server's phase trace on
    the same host (``ttft_trace`` lines the client's send and first read up with the server's events by ``rid``, the
    request's ``X-Request-Id``)."""

    def __init__(self, rid: str) -> None:
        self.rid, self.t0, self.ttft, self.tokens = rid, time.monotonic(), None, 0

    def line(self, line: bytes | str) -> None:
        if not line.strip():
            return
        item = json.loads(line)
        meta = item.get("metadata", {})
        if item["modality"] == "error":
            raise RuntimeError(meta)
        if self.ttft is None and meta.get("n_tokens"):
            self.ttft = time.monotonic() - self.t0
        if "usage" in meta:
            self.tokens = meta["usage"]["completion_tokens"]

    def result(self) -> tuple[float, float, int, str, float]:
        """(ttft s, total s, completion tokens, request id, monotonic send time)."""
        return self.ttft or 0.0, time.monotonic() - self.t0, self.tokens, self.rid, self.t0


class _ChatTally(_Tally):
    """``_Tally`` of a streamed chat completion (server-sent events): the first event with content is the first
    token; the completion tokens are the usage of the last chunk (``stream_options.include_usage``). A stream that
    ends without ``data: [DONE]`` or without its usage is an error, not a short count."""

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self.done = self.usage_seen = False

    def line(self, line: bytes | str) -> None:
        line = line.strip()
        if not line:
            return
        if isinstance(line, bytes):
            line = line.decode()
        if not line.startswith("data:"):
            raise RuntimeError(f"not a server-sent event line: {line[:200]!r}")
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return
        item = json.loads(data)
        if "error" in item:
            raise RuntimeError(item["error"])
        if self.ttft is None and any(c.get("delta", {}).get("content") for c in item.get("choices", ())):
            self.ttft = time.monotonic() - self.t0
        if item.get("usage"):
            self.tokens, self.usage_seen = item["usage"]["completion_tokens"], True

    def result(self) -> tuple[float, float, int, str, float]:
        if not (self.done and self.usage_seen):
            raise RuntimeError(f"chat stream {self.rid} ended without " + ("its usage" if self.done else "[DONE]"))
        return super().result()


TALLIES = {"generate": _Tally, "chat": _ChatTally}


_request_ids = itertools.count()


def request_id() -> str:
    """A request id no other client process of this run uses (``X-Request-Id``)."""
    return f"bench-{os.getpid()}-{next(_request_ids)}"


def stream_one(base_url: str, prompt: str, max_tokens: int,
               route: str = "generate") -> tuple[float, float, int, str, float]:
    """One streaming request to ``route`` on this thread's httpx client: ``_Tally.result``."""
    client = _local.client  # made before the clock starts: a new httpx client costs ~25 ms (its TLS context)
    tally = TALLIES[route](request_id())
    with client.stream("POST", f"{base_url}{ROUTES[route]}", json=request_body(prompt, max_tokens, route),
                       headers={"X-Request-Id": tally.rid}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            tally.line(line)
    return tally.result()


def _thread_client(base_url: str, prompts: list[str], streams: int, max_tokens: int,
                   route: str = "generate") -> tuple[list, float, float]:
    """``streams`` client threads in one process working through ``prompts`` (they share its GIL, and a thread
    woken by its first chunk can wait out another's switch interval): (per-request results, wall-clock start,
    end). Each thread's HTTP client exists before the clock starts."""
    ready = threading.Barrier(streams + 1)

    def setup() -> None:
        _local.client = httpx.Client(timeout=600)
        ready.wait()

    with cf.ThreadPoolExecutor(streams) as pool:
        for _ in range(streams):
            pool.submit(setup)
        ready.wait()
        start = time.time()
        results = list(pool.map(lambda p: stream_one(base_url, p, max_tokens, route), prompts))
        return results, start, time.time()


class _Connection:
    """One keep-alive HTTP/1.1 connection of the asyncio client, which reads the server's chunked NDJSON stream
    itself: on one event loop, a stream's first chunk is read as soon as it arrives rather than when its thread
    next gets the GIL."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, base_url: str) -> "_Connection":
        url = urllib.parse.urlsplit(base_url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, url.netloc)

    async def generate(self, prompt: str, max_tokens: int,
                       route: str = "generate") -> tuple[float, float, int, str, float]:
        body = json.dumps(request_body(prompt, max_tokens, route)).encode()
        rid = request_id()
        head = (f"POST {ROUTES[route]} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        tally = TALLIES[route](rid)
        self.writer.write(head + body)
        status = await self.reader.readline()
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip().lower()
        if headers.get("transfer-encoding") != "chunked":
            text = await self.reader.readexactly(int(headers.get("content-length", 0)))
            raise RuntimeError(f"{ROUTES[route]} answered {status.decode().strip()!r}, not a stream: {text[:300]!r}")
        pending = b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                tally.line(line)
        await self.reader.readline()  # the CRLF after the last (empty) chunk
        tally.line(pending)
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{ROUTES[route]} answered {status.decode().strip()!r}")
        return tally.result()


def _async_client(base_url: str, prompts: list[str], streams: int, max_tokens: int,
                  route: str = "generate") -> tuple[list, float, float]:
    """``streams`` concurrent clients on one asyncio loop in this process, each on its own keep-alive connection
    (opened before the clock starts), working through ``prompts``: (per-request results in prompt order,
    wall-clock start, end)."""

    async def run() -> tuple[list, float, float]:
        connections = await asyncio.gather(*[_Connection.open(base_url) for _ in range(streams)])
        queue = collections.deque(enumerate(prompts))
        results: list = [None] * len(prompts)

        async def worker(conn: _Connection) -> None:
            while queue:
                i, prompt = queue.popleft()
                results[i] = await conn.generate(prompt, max_tokens, route)

        start = time.time()
        try:
            await asyncio.gather(*[worker(c) for c in connections])
        finally:
            for c in connections:
                c.writer.close()
        return results, start, time.time()

    return asyncio.run(run())


CLIENTS = {"async": _async_client, "threads": _thread_client}
"""The benchmark's clients: asyncio (the default) or one httpx client thread per stream (what earlier sessions'
numbers were measured with; at 32 streams its threads' GIL hand-offs added ~6 ms to the measured TTFT)."""


CLIENT_STREAMS_PER_PROCESS = 8
"""Above this many streams the clients run in several processes: one Python process parsing every streamed line
of 64 streams would measure its own GIL rather than the server."""
_clients: cf.ProcessPoolExecutor | None = None
CLIENT_CPUS: frozenset[int] | None = None
"""``--client-cpus``: the cores the client processes run on (every client then runs in one; the server gets the
others)."""


def cpu_list(text: str) -> frozenset[int]:
    """``"8-15"``, ``"2,4-6"`` -> the CPU numbers. ValueError naming the text when it is not such a list."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"--client-cpus: expected a CPU list such as 8-15 or 2,4-6, got {text!r}") from None
    if not cpus:
        raise ValueError(f"--client-cpus: no CPU in {text!r}")
    return frozenset(cpus)


def _pin(cpus: frozenset[int]) -> None:
    os.sched_setaffinity(0, cpus)


def client_processes(streams: int) -> cf.ProcessPoolExecutor:
    """Client processes for up to ``streams`` streams, spawned (not forked: the caller may hold a CUDA context) and
    all up before anything is timed."""
    workers = -(-streams // CLIENT_STREAMS_PER_PROCESS)
    pinning = {"initializer": _pin, "initargs": (CLIENT_CPUS,)} if CLIENT_CPUS else {}
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"), **pinning)
    list(pool.map(time.sleep, [1.0] * workers))
    return pool


def run_streams(base_url: str, prompts: list[str], streams: int, max_tokens: int,
                pool: cf.ProcessPoolExecutor | None, client: str = "async",
                route: str = "generate") -> tuple[list, float, float]:
    """``streams`` concurrent streaming clients (``CLIENTS[client]``) working through ``prompts``, in this process
    or, above ``CLIENT_STREAMS_PER_PROCESS`` streams, spread over ``pool``: (per-request ``_Tally.result``,
    wall-clock start, end)."""
    run = CLIENTS[client]
    procs = -(-streams // CLIENT_STREAMS_PER_PROCESS)
    if (procs == 1 and not CLIENT_CPUS) or pool is None:
        return run(base_url, prompts, streams, max_tokens, route)
    share = [prompts[i::procs] for i in range(procs)]
    parts = [f.result() for f in [pool.submit(run, base_url, part, -(-streams // procs), max_tokens, route)
                                  for part in share]]
    return [r for part in parts for r in part[0]], min(part[1] for part in parts), max(part[2] for part in parts)


def ours(base_url: str, streams: int, max_tokens: int, n_requests: int, client: str = "async",
         route: str = "generate") -> dict:
    global _clients
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_requests)]
    before = _server_ttft(base_url)
    engine_before = _engine_counts(base_url)
    if (streams > CLIENT_STREAMS_PER_PROCESS or CLIENT_CPUS) and _clients is None:
        _clients = client_processes(64)
    results, start, end = run_streams(base_url, prompts, streams, max_tokens, _clients, client, route)
    server_ttft = _server_ttft(base_url) if before is not None else None
    wall = end - start
    tokens = sum(r[2] for r in results)
    out = {"tok_s": tokens / wall, "ttft_median_s": statistics.median(r[0] for r in results),
           "ttft_s": [round(r[0], 5) for r in results], "e2e_s": [round(r[1], 5) for r in results], "tokens": tokens,
           "seconds": wall}
    if before is not None and server_ttft is not None and server_ttft[1] > before[1]:
        # the conductor's own view: from a request's arrival at the conductor to its first token leaving it
        out["server_ttft_mean_s"] = (server_ttft[0] - before[0]) / (server_ttft[1] - before[1])
    time.sleep(ENGINE_STATS_LAG_S)  # untimed: ranks report engine statistics every 0.5 s
    done = {k: _engine_counts(base_url).get(k, 0.0) - engine_before.get(k, 0.0) for k in ENGINE_COUNTS}
    if done["prefill_batches_total"] > 0:  # how well prefills batch, and the decode batch the engine ran
        out["prefill_rows_per_forward"] = done["prefills_total"] / done["prefill_batches_total"]
        out["prefill_replayed_share"] = done["prefill_batches_replayed_total"] / done["prefill_batches_total"]
        # prefills that ran beside a decode step in flight (kv_engine, prefill_stream)
        out["prefill_beside_share"] = done["prefill_batches_beside_decode_total"] / done["prefill_batches_total"]
    if done["decode_steps_total"] > 0:
        out["decode_rows_per_step"] = done["decode_rows_total"] / done["decode_steps_total"]
    return out


ENGINE_COUNTS = ("prefills_total", "prefill_batches_total", "prefill_batches_replayed_total",
                 "prefill_batches_beside_decode_total", "decode_steps_total", "decode_rows_total")
ENGINE_STATS_LAG_S = 1.2


def _engine_counts(base_url: str) -> dict[str, float]:
    """The engine counters of /metrics (``mstar_dist_engine_<key>{rank=...}``), summed over ranks."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {key: sum(per_rank(text, f"mstar_dist_engine_{key}").values()) for key in ENGINE_COUNTS}


def _server_ttft(base_url: str) -> tuple[float, float] | None:
    """(sum, count) of the server's time-to-first-token histogram, or None if /metrics does not have it."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"mstar_dist_time_to_first_token_seconds_{part} "):
                found[part] = float(line.split()[-1])
    return (found["sum"], found["count"]) if len(found) == 2 else None


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(hf_model, ids_list: list[list[int]], max_tokens: int, device: str, batch: int = 1) -> dict:
    """Greedy ``generate`` of every prompt, ``batch`` at a time (left-padded), exactly ``max_tokens`` each."""
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(ids_list), batch):
        group = ids_list[i : i + batch]
        width = max(len(ids) for ids in group)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in group], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in group], device=device)
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(group)
    _sync(device)
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall}


def bare(model, cfg, ids_list: list[list[int]], batch: int, max_tokens: int, device: str, dtype,
         graphs: bool = False, bare_kernel: bool = True) -> dict:
    from mstar_dist.tools.bare_loop import bare_generate
    from mstar_dist.engine import decode_attention
    from mstar_dist.engine.cuda_graphs import DecodeGraphs
    from mstar_dist.engine.kv_cache import StaticKVCache

    # the served engine's context (LlamaChat's default max_seq_len): graph-mode attention reads every position of
    # the cache, so a shorter cache here would make the yardstick's steps cheaper than the engine's
    # the served engine's decode attention too (LlamaChat's decode_attention: auto): the in-place kernel where it runs
    cache = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_slots=batch + (1 if graphs else 0),
                          max_seq_len=min(2048, cfg.max_position_embeddings), dtype=dtype, device=device,
                          decode_kernel=graphs and bare_kernel and decode_attention.available(device))
    captured = None
    if graphs:
        captured = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=batch)
        captured.capture()
    bare_generate(model, cache, ids_list[:batch], 4, graphs=captured)  # warm this batch size
    tokens, wall, decode_tokens, decode_wall = 0, 0.0, 0, 0.0
    for i in range(0, len(ids_list), batch):
        group = ids_list[i : i + batch]
        phases: dict = {}
        out, seconds = bare_generate(model, cache, group, max_tokens, graphs=captured, phases=phases)
        tokens += len(group) * max_tokens
        wall += seconds
        decode_tokens += len(group) * (max_tokens - 1)
        decode_wall += phases["decode_s"]
    decode_tok_s = decode_tokens / decode_wall if decode_wall > 0 else float("nan")
    # the CUDA-graph loop's yardstick is its decode steps alone (the "bare decode loop", made strong): its
    # prefills run eagerly, one forward per prompt length, which the serving engine's batched prefill graphs beat
    return {"tok_s": decode_tok_s if graphs else tokens / wall, "tok_s_with_prefill": tokens / wall,
            "decode_tok_s": decode_tok_s, "tokens": tokens, "seconds": wall, "decode_seconds": decode_wall}


def series(name: str, route: str) -> str:
    """The results' key of deployment ``name`` on ``route`` (``<key>_<streams>``): the config's name for
    ``/generate`` (the keys of every earlier result), ``<name>_chat`` for the chat route."""
    return name if route == "generate" else f"{name}_{route}"


def main() -> None:
    global CLIENT_STREAMS_PER_PROCESS, CLIENT_CPUS
    p = argparse.ArgumentParser()
    p.add_argument("--config", action="append", default=None, metavar="PATH:NPROC",
                   help="a deployment to serve, with its rank count (repeatable; default "
                        "launch/configs/smollm2_pd.yaml:2)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=None,
                   help="engine.max_batch of the served deployments (default: the largest --streams, >= 16)")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu", help="cpu | cuda (the server picks CUDA by itself when present)")
    p.add_argument("--model", default=None, help="registry key override for the served config (e.g. llama)")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate (no transformers here)")
    p.add_argument("--streams-per-process", type=int, default=CLIENT_STREAMS_PER_PROCESS,
                   help="client streams per client process (their threads share its GIL: fewer measure the server "
                        "more closely, more leave the server more of the host's cores)")
    p.add_argument("--client", choices=sorted(CLIENTS), default="async",
                   help="async: every stream of a client process on one asyncio loop; threads: one httpx client "
                        "thread per stream (earlier sessions' client)")
    p.add_argument("--requests-per-stream", type=int, default=2,
                   help="requests per client stream at each concurrency (at least 4 in all): each stream sends its "
                        "next request when the last one ends, so at 32 streams the first wave starts at once and the "
                        "later ones as the earlier ones end; more of them measure the steady state more than the burst")
    p.add_argument("--route", choices=sorted(ROUTES), nargs="+", default=["generate"],
                   help="the streaming route(s) to load, each at every --streams value: generate (native NDJSON; "
                        "results keyed <config>_<streams>) and/or chat (/v1/chat/completions, ignore_eos, the usage "
                        "of the last chunk; keyed <config>_chat_<streams>)")
    p.add_argument("--no-eager-bare", action="store_true",
                   help="on CUDA, skip the eager bare loop (the yardstick there is the CUDA-graph one)")
    p.add_argument("--no-packed-bare", action="store_true",
                   help="on the CPU, the bare loop multiplies with F.linear rather than the oneDNN-packed weights the "
                        "served engine uses by default (for a config with engine.cpu_packed_linear: false)")
    p.add_argument("--bare-sdpa", action="store_true",
                   help="on CUDA, the CUDA-graph bare loop attends with SDPA over copies of the rows' keys and values "
                        "rather than the in-place Triton kernel the served engine uses where it runs "
                        "(for a config with engine.decode_attention: sdpa)")
    p.add_argument("--bare-unfused", action="store_true",
                   help="on CUDA, the bare loops run the blocks' pointwise work as torch ops rather than the fused "
                        "Triton kernels the served engine uses where they run "
                        "(for engine.fused_pointwise: torch)")
    p.add_argument("--client-cpus", type=cpu_list, default=None, metavar="LIST",
                   help="run every client in processes pinned to these CPUs (e.g. 8-15) and the server, this process "
                        "and the bare loops on the others: the clients then take no core from the server, as clients "
                        "on other machines would not (default: no pinning)")
    args = p.parse_args()
    CLIENT_STREAMS_PER_PROCESS = args.streams_per_process
    if args.client_cpus:
        server_cpus = os.sched_getaffinity(0) - args.client_cpus
        if not server_cpus or not args.client_cpus <= os.sched_getaffinity(0):
            p.error(f"--client-cpus {sorted(args.client_cpus)} must be some, not all, of this process's CPUs "
                    f"{sorted(os.sched_getaffinity(0))}")
        CLIENT_CPUS = args.client_cpus
        os.sched_setaffinity(0, server_cpus)  # the servers started from here inherit it
    configs = [(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1])) for c in
               (args.config or [str(REPO / "launch/configs/smollm2_pd.yaml") + ":2"])]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    cuda = args.device.startswith("cuda")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    top = max(args.streams)
    max_batch = args.max_batch or max(16, top)

    from models.common import fused
    from models.common.linear import pack_for_cpu
    from models.llama.tokenizer import ChatTokenizer
    from models.llama.weights import load_llama

    tok = ChatTokenizer(WEIGHTS)
    ids = [chat_ids(tok, PROMPTS[i % len(PROMPTS)]) for i in range(2 * top)]
    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(WEIGHTS, torch_dtype=dtype).to(args.device).eval()
    our_model, cfg = load_llama(WEIGHTS, device=args.device, dtype=dtype)
    if not args.no_packed_bare:
        pack_for_cpu(our_model)  # the bare loop runs the served engine's GEMMs (models/common/linear.py)
    if cuda and not args.bare_unfused and fused.available(args.device):
        our_model.fuse_pointwise()  # and its pointwise kernels (LlamaChat's fused_pointwise: auto)

    rows: dict[str, list[dict]] = collections.defaultdict(list)
    cold: dict[str, float] = {}
    for r in range(args.rounds):
        for path, nproc in configs:  # one deployment up at a time (they share the device)
            name = Path(path).stem
            own = (yaml.safe_load(Path(path).read_text()) or {}).get("engine") or {}
            overrides = {"engine": {**own, "max_batch": max_batch},
                         "limits": {"max_concurrent_requests": max(64, 2 * top), "max_tokens": 4096}}
            if args.model:
                overrides["model"] = args.model
            server = Server(path, nproc=nproc, overrides=overrides)
            cold.setdefault(name, server.ready_seconds)
            try:
                # warm the path with every prompt once: a prompt length's first prefill on a GPU pays for new
                # kernel shapes, which would otherwise land in the 1-stream TTFT (its requests come first)
                ours(server.base_url, 1, 8, len(PROMPTS), args.client)
                for route in args.route:
                    if route != "generate":  # the route's own first requests (the prompts' shapes are warm)
                        ours(server.base_url, 1, 8, 2, args.client, route)
                # the routes side by side at each concurrency, their order swapped every round (noise hits both)
                routes = args.route if r % 2 == 0 else args.route[::-1]
                for n in args.streams:
                    for route in routes:
                        rows[f"{series(name, route)}_{n}"].append(ours(
                            server.base_url, n, args.max_tokens, max(4, args.requests_per_stream * n), args.client,
                            route))
            finally:
                server.stop()
        with torch.inference_mode():
            if hf_model is not None:
                rows["hf_1"].append(hf_generate(hf_model, ids[:2 if cuda else 4], args.max_tokens, args.device))
                rows["hf_8"].append(hf_generate(hf_model, ids[:8], args.max_tokens, args.device, batch=8))
            for n in args.streams:
                if not (cuda and args.no_eager_bare):
                    rows[f"bare_{n}"].append(bare(our_model, cfg, ids[: max(n, 4 if n == 1 else n)], n,
                                                  args.max_tokens, args.device, dtype))
                if cuda:
                    rows[f"bare_graphs_{n}"].append(bare(our_model, cfg, ids[: max(n, 4 if n == 1 else n)], n,
                                                         args.max_tokens, args.device, dtype, graphs=True,
                                                         bare_kernel=not args.bare_sdpa))
        print(f"round {r}: " + ", ".join(f"{k}={v[-1]['tok_s']:.1f}" for k, v in rows.items()), flush=True)

    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in rows.items()}
    ttft = {k: statistics.median(x["ttft_median_s"] for x in v) for k, v in rows.items() if "ttft_median_s" in v[0]}
    server_ttft = {k: statistics.median(x["server_ttft_mean_s"] for x in v) for k, v in rows.items()
                   if all("server_ttft_mean_s" in x for x in v)}
    batching = {k: {stat: statistics.median(x[stat] for x in v) for stat in ("prefill_rows_per_forward",
                                                                            "prefill_replayed_share",
                                                                            "prefill_beside_share",
                                                                            "decode_rows_per_step")
                    if all(stat in x for x in v)} for k, v in rows.items() if "ttft_median_s" in v[0]}
    yard = "bare_graphs" if cuda else "bare"
    ratios, targets = {}, {}
    names = [Path(path).stem for path, _ in configs]
    for name in [series(name, route) for name in names for route in args.route]:
        for n in args.streams:
            ratios[f"{name}_{n}_over_{yard}_{n}"] = med[f"{name}_{n}"] / med[f"{yard}_{n}"]
        if 1 in args.streams and 32 in args.streams:
            ratios[f"{name}_ttft_32_over_ttft_1"] = ttft[f"{name}_32"] / ttft[f"{name}_1"]
            targets[f"{name}: TTFT at 32 streams <= 2x TTFT at 1"] = ratios[f"{name}_ttft_32_over_ttft_1"] <= 2
        if hf_model is not None:
            for n in (1, 8):
                if n in args.streams:
                    ratios[f"{name}_{n}_over_hf_{n}"] = med[f"{name}_{n}"] / med[f"hf_{n}"]
        if cuda:
            for n in (32, 64):
                if n in args.streams:
                    targets[f"{name}: {n} streams >= 0.70 x CUDA-graph bare loop"] = \
                        ratios[f"{name}_{n}_over_{yard}_{n}"] >= 0.70
        else:
            if hf_model is not None:
                for n in (1, 8):
                    if n in args.streams:
                        targets[f"{name}: {n} stream(s) >= HF generate at batch {n}"] = \
                            ratios[f"{name}_{n}_over_hf_{n}"] >= 1.0
            if 8 in args.streams:
                ratios[f"{name}_8_over_{yard}_decode_8"] = med[f"{name}_8"] / statistics.median(
                    x["decode_tok_s"] for x in rows[f"{yard}_8"])
                targets[f"{name}: 8 streams >= 0.85 x bare batched loop"] = ratios[f"{name}_8_over_{yard}_8"] >= 0.85
    # end-to-end request latency, p50 over every request of every round (the same prompts for every deployment)
    e2e = {k: statistics.median(t for x in v for t in x["e2e_s"]) for k, v in rows.items() if "e2e_s" in v[0]}
    if len(names) == 2 and "generate" in args.route:  # split vs colocated, e.g. P/D against single rank
        a, b = names
        for n in args.streams:
            ratios[f"{a}_{n}_over_{b}_{n}"] = med[f"{a}_{n}"] / med[f"{b}_{n}"]
        if 1 in args.streams:
            ratios[f"{a}_e2e_p50_1_over_{b}_e2e_p50_1"] = e2e[f"{a}_1"] / e2e[f"{b}_1"]
            targets[f"split overhead: {a} vs {b}, end-to-end p50 at 1 stream within 1%"] = \
                ratios[f"{a}_e2e_p50_1_over_{b}_e2e_p50_1"] <= 1.01
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "configs": [f"{p}:{n}" for p, n in configs],
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_1m": os.getloadavg()[0], "device": args.device,
                    "gpu": torch.cuda.get_device_name(0) if cuda else None,
                    "gpus": torch.cuda.device_count() if cuda else 0},
        "weights": WEIGHTS,
        "max_tokens": args.max_tokens,
        "max_batch": max_batch,
        "requests_per_stream": args.requests_per_stream,
        "client": args.client,
        "routes": {route: ROUTES[route] for route in args.route},
        "client_cpus": sorted(CLIENT_CPUS) if CLIENT_CPUS else None,
        "bare_loop": {"yardstick": "decode steps alone (CUDA graphs)" if cuda else "prefill and decode",
                      "fused_pointwise": bool(getattr(our_model, "fused", False)),
                      "decode_attention": "sdpa" if args.bare_sdpa or not cuda else "auto"},
        "cold_start_to_health_s": cold,
        "median_tok_s": med,
        "ttft_median_s": ttft,
        "e2e_p50_s": e2e,
        "engine_batching": batching,
        "server_ttft_mean_s": server_ttft,
        "ratios": ratios,
        "targets_met": targets,
        "rounds": rows,
    }
    out = Path(args.out or REPO / f"bench/raw/serving_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("cold_start_to_health_s", "median_tok_s", "ttft_median_s", "e2e_p50_s",
                                             "engine_batching",
                                             "server_ttft_mean_s", "ratios", "targets_met")}, indent=2))


if __name__ == "__main__":
    main()
