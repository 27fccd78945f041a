"""Soak: many mixed requests against a deployment this script starts; outcomes, per-rank RSS, leaks, latency.

    python scripts/soak.py --config launch/configs/smollm2_pd.yaml --nproc 2 [--requests 1000] [--concurrency 8]
        [--max-seconds 3600] [--out bench/raw/soak_smollm2_pd.json]

The plan is deterministic (``--seed``): native ``/generate`` and OpenAI ``/v1/chat/completions``, streamed and
not, short and long (``max_tokens`` 4..64), greedy, sampled and seeded, some with stop strings, and one request in
ten streamed and abandoned after its first text chunk (the connection is closed, which aborts it in the server).
At most ``--concurrency`` requests are in flight; no new request starts after ``--max-seconds``.

While it runs it samples every rank's resident memory every ``--sample-s`` seconds from ``/metrics``
(``mstar_dist_process_resident_memory_bytes{rank}``, from the ``Stats`` each rank sends about every 0.5 s), plus
one sample when ``--baseline-after`` requests have completed (the baseline). Afterwards it waits for every rank's
live tensors and KV slots to reach 0, takes the end sample and compares it with the baseline: ``rss_growth`` is
``end / baseline - 1`` per rank and passes when it is at most ``--rss-tolerance`` (a drop is not a leak).
A request *fails* when it gets a non-200, an error line or event, an exception, or a malformed or inconsistent
answer (no finish reason, more tokens than asked, a stop string left in the text).
``tests/e2e/test_soak.py`` runs :func:`run_soak` with a smaller plan.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import json
import os
import platform
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a steam engine works.",
    "What is the capital of France?",
    "List three colours of the rainbow.",
    "Describe a busy market in a medieval town.",
    "Translate 'good morning' into French, German and Japanese (おはよう).",
    "Give me a recipe for crêpes, with the quantities.",
    "Why is the sky blue? Answer in one paragraph.",
    "Write a haiku about the sea.",
    "Count from one to twenty in words.",
]
STOPS = [["."], ["\n"], [" the", "The"], [",", "!"]]


@dataclass(frozen=True)
class Planned:
    """One request of the plan."""

    index: int
    route: str
    """"native" (``/generate``) or "openai" (``/v1/chat/completions``)."""
    stream: bool
    abandon: bool
    """Close the stream after the first text chunk (always a streamed request)."""
    max_tokens: int
    prompt: str
    messages: bool
    """Native route only: send ``messages`` (chat template) instead of a raw ``prompt``."""
    temperature: float
    seed: int | None
    stop: list[str] | None


@dataclass
class Result:
    index: int
    outcome: str
    """"ok", "abandoned" or "failed"."""
    seconds: float
    ttft: float | None = None
    """Seconds to the first text chunk (streamed requests that got one)."""
    completion_tokens: int | None = None
    error: str | None = None


def plan(n: int, seed: int = 0) -> list[Planned]:
    """``n`` mixed requests; every tenth (index 9, 19, ...) is streamed and abandoned."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        abandon = i % 10 == 9
        long = rng.random() < 0.5
        sampled = rng.random() < 0.6
        out.append(Planned(
            index=i, route=rng.choice(["native", "openai"]), stream=abandon or rng.random() < 0.5, abandon=abandon,
            max_tokens=rng.randint(32, 64) if long else rng.randint(4, 16),
            prompt=f"{rng.choice(PROMPTS)} (request {i})", messages=rng.random() < 0.5,
            temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
            seed=rng.randrange(2**31) if sampled and rng.random() < 0.7 else None,
            stop=rng.choice(STOPS) if rng.random() < 0.3 else None,
        ))
    return out


# ------------------------------------------------------------------------------------------------ requests


def _knobs(p: Planned) -> dict:
    knobs: dict = {"max_tokens": p.max_tokens, "temperature": p.temperature}
    if p.seed is not None:
        knobs["seed"] = p.seed
    if p.stop is not None:
        knobs["stop"] = p.stop
    return knobs


def _request(p: Planned) -> tuple[str, dict]:
    """(path, JSON body) of a planned request."""
    chat = [{"role": "user", "content": p.prompt}]
    if p.route == "openai":
        return "/v1/chat/completions", {"model": "smollm2", "messages": chat, "stream": p.stream, **_knobs(p)}
    body: dict = {"stream": p.stream, "model_kwargs": _knobs(p)}
    body.update({"messages": chat} if p.messages else {"prompt": p.prompt})
    return "/generate", body


class Failed(Exception):
    """The answer was an error or is inconsistent with the request."""


def _check_finish(p: Planned, text: str, finish_reason: str | None, tokens: int | None) -> None:
    if finish_reason not in ("stop", "length"):
        raise Failed(f"finish_reason {finish_reason!r}")
    if tokens is None or tokens > p.max_tokens:
        raise Failed(f"{tokens} completion tokens for max_tokens {p.max_tokens}")
    for s in p.stop or []:
        if s in text:
            raise Failed(f"stop string {s!r} left in the text {text!r:.200}")


def _stream_events(r: httpx.Response, route: str):
    """(text, finish_reason, completion_tokens) per event of a streamed response; raises Failed on an error."""
    for line in r.iter_lines():
        if not line.strip():
            continue
        if route == "native":
            item = json.loads(line)
            meta = item.get("metadata", {})
            if item["modality"] == "error":
                raise Failed(f"error line {meta}")
            usage = meta.get("usage") or {}
            text = item.get("data", "") if meta.get("encoding") == "utf-8" else \
                base64.b64decode(item.get("data", "")).decode()  # a server from before text was sent as itself
            yield text, meta.get("finish_reason"), usage.get("completion_tokens")
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                yield "", "[DONE]", None
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise Failed(f"error event {chunk['error']}")
            usage = chunk.get("usage") or {}
            if not chunk.get("choices"):  # the include_usage chunk
                yield "", None, usage.get("completion_tokens")
            for choice in chunk.get("choices", []):
                yield choice["delta"].get("content") or "", choice.get("finish_reason"), None


def _send_streamed(client: httpx.Client, base_url: str, p: Planned, t0: float) -> Result:
    path, body = _request(p)
    if p.route == "openai":
        body["stream_options"] = {"include_usage": True}
    text, finish, tokens, ttft, done = "", None, None, None, p.route == "native"
    with client.stream("POST", base_url + path, json=body) as r:
        if r.status_code != 200:
            raise Failed(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for delta, reason, n in _stream_events(r, p.route):
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
                if p.abandon:  # leaving the with-block closes the connection mid-stream
                    return Result(p.index, "abandoned", time.perf_counter() - t0, ttft)
            text += delta
            finish = finish if reason in (None, "[DONE]") else reason
            tokens = n if n is not None else tokens
            done = done or reason == "[DONE]"
    if p.abandon:  # ended before any text (e.g. a stop string at once): nothing left to abandon
        return Result(p.index, "abandoned", time.perf_counter() - t0, ttft)
    if not done:
        raise Failed("the SSE stream ended without data: [DONE]")
    _check_finish(p, text, finish, tokens)
    return Result(p.index, "ok", time.perf_counter() - t0, ttft, tokens)


def _send_whole(client: httpx.Client, base_url: str, p: Planned, t0: float) -> Result:
    path, body = _request(p)
    r = client.post(base_url + path, json=body)
    if r.status_code != 200:
        raise Failed(f"HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    if p.route == "openai":
        text, finish = data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]
    else:
        text, finish = data["text"], data["finish_reason"]
    tokens = data["usage"]["completion_tokens"]
    _check_finish(p, text, finish, tokens)
    return Result(p.index, "ok", time.perf_counter() - t0, None, tokens)


def send(client: httpx.Client, base_url: str, p: Planned) -> Result:
    """Run one planned request to its end (or its abandonment); never raises."""
    t0 = time.perf_counter()
    try:
        return (_send_streamed if p.stream else _send_whole)(client, base_url, p, t0)
    except (Failed, httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        return Result(p.index, "failed", time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:500])


# ------------------------------------------------------------------------------------------------ metrics


def per_rank(text: str, name: str) -> dict[str, float]:
    """``{rank: value}`` of a per-rank series in a ``/metrics`` text."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}\{{rank="(\d+)"\}} (\S+)$', text, re.M)}


def counter(text: str, series: str) -> float:
    match = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


class RssSampler:
    """Samples every rank's RSS from ``/metrics`` every ``interval`` seconds on a thread, and on demand."""

    def __init__(self, base_url: str, interval: float, progress: Callable[[], int]) -> None:
        """``progress()``: requests completed so far (recorded with every sample)."""
        self.base_url, self.interval, self.progress = base_url, interval, progress
        self.t0 = time.monotonic()
        self.series: list[dict] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def sample(self, label: str | None = None) -> dict | None:
        try:
            text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        rss = per_rank(text, "mstar_dist_process_resident_memory_bytes")
        row = {"t": round(time.monotonic() - self.t0, 2), "done": self.progress(),
               "rss_mib": {r: round(v / 2**20, 2) for r, v in rss.items()}}
        if label:
            row["label"] = label
        with self._lock:
            self.series.append(row)
        return row

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wait_idle(base_url: str, timeout: float) -> dict:
    """Poll ``/metrics`` until every rank's live tensors and KV slots are 0 (at most ``timeout`` s); the last
    values seen and how long it took."""
    t0 = time.monotonic()
    while True:
        try:
            text = httpx.get(f"{base_url}/metrics", timeout=10).text
        except httpx.HTTPError as exc:
            return {"live_tensors": {}, "kv_slots_used": {}, "idle": False, "error": f"{type(exc).__name__}: {exc}"}
        live = per_rank(text, "mstar_dist_live_tensors")
        slots = per_rank(text, "mstar_dist_engine_kv_slots_used")
        idle = not any(live.values()) and not any(slots.values()) \
            and counter(text, "mstar_dist_requests_running") == 0
        if idle or time.monotonic() - t0 > timeout:
            return {"live_tensors": live, "kv_slots_used": slots, "idle": idle,
                    "seconds_to_idle": round(time.monotonic() - t0, 2)}
        time.sleep(0.5)


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 (nearest rank), mean, max and count, in seconds."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, int(round(p * len(v) + 0.5)) - 1))], 4)

    return {"n": len(v), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": round(sum(v) / len(v), 4),
            "max": round(v[-1], 4)}


# ------------------------------------------------------------------------------------------------ the run


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _drive(base_url: str, todo: list[Planned], concurrency: int, max_seconds: float, on_done,
           gone: threading.Event) -> list[Result]:
    """Send ``todo`` with at most ``concurrency`` in flight; no new request after ``max_seconds`` or once
    ``gone`` is set (the server stopped serving)."""
    deadline = time.monotonic() + max_seconds
    slots = threading.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency)
    futures = []
    with httpx.Client(timeout=httpx.Timeout(300, connect=30), limits=limits) as client, \
            cf.ThreadPoolExecutor(concurrency) as pool:
        for p in todo:
            slots.acquire()
            if time.monotonic() > deadline or gone.is_set():
                slots.release()
                break
            future = pool.submit(send, client, base_url, p)
            future.add_done_callback(lambda f: (slots.release(), on_done(f.result())))
            futures.append(future)
        return [f.result() for f in futures]


def run_soak(base_url: str, todo: list[Planned], *, concurrency: int = 8, max_seconds: float = 3600.0,
             baseline_after: int = 100, sample_s: float = 2.0, rss_tolerance: float = 0.05,
             idle_timeout: float = 60.0, log=lambda line: print(line, flush=True)) -> dict:
    """Send ``todo`` to ``base_url`` (see the module docstring) and return the report (JSON-ready). A failed
    request while ``/health`` is not 200 stops the run (``stopped_early``): the server is gone or a rank died."""
    done = {"n": 0}
    lock = threading.Lock()
    gone = threading.Event()
    stopped: list[str] = []
    t0 = time.perf_counter()
    with RssSampler(base_url, sample_s, lambda: done["n"]) as sampler:
        first = sampler.sample("start")

        def on_done(result: Result) -> None:
            with lock:
                done["n"] += 1
                n = done["n"]
            if n == baseline_after:
                sampler.sample("baseline")
            if result.outcome == "failed":
                log(f"request {result.index} failed: {result.error}")
                if not gone.is_set() and not healthy(base_url):
                    with lock:
                        if not gone.is_set():
                            stopped.append(f"after request {result.index} failed ({result.error}) /health was not "
                                           f"200 at {time.perf_counter() - t0:.0f} s")
                            gone.set()
                            log(f"stopping: {stopped[0]}")
            if n % 100 == 0:
                log(f"{n}/{len(todo)} done in {time.perf_counter() - t0:.0f} s")

        results = _drive(base_url, todo, concurrency, max_seconds, on_done, gone)
        wall = time.perf_counter() - t0
        idle = wait_idle(base_url, idle_timeout)
        time.sleep(2 * sample_s)  # every rank has sent fresh Stats since it went idle
        end = sampler.sample("end")
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        text = ""
    report = _report(todo, results, sampler.series, first, end, idle, text, wall=wall, concurrency=concurrency,
                     baseline_after=baseline_after, rss_tolerance=rss_tolerance)
    return {"stopped_early": stopped[0] if stopped else None, **report}


def _report(todo, results, series, first, end, idle, metrics_text, *, wall, concurrency, baseline_after,
            rss_tolerance) -> dict:
    by_index = {p.index: p for p in todo}
    counts: dict[str, int] = {}
    kinds: dict[str, dict[str, int]] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
        p = by_index[r.index]
        kind = f"{p.route} {'stream' if p.stream else 'whole'}"
        kinds.setdefault(kind, {}).setdefault(r.outcome, 0)
        kinds[kind][r.outcome] += 1
    baseline = next((row for row in series if row.get("label") == "baseline"), None)
    growth = {rank: round(end["rss_mib"][rank] / mib - 1, 4) if rank in end["rss_mib"] else None
              for rank, mib in baseline["rss_mib"].items()} if baseline and end else {}
    ok = [r for r in results if r.outcome == "ok"]
    server = {reason: counter(metrics_text, f'mstar_dist_requests_finished_total{{reason="{reason}"}}')
              for reason in ("stop", "length", "abort", "error")}
    return {
        "requests_planned": len(todo), "requests_sent": len(results), "truncated": len(results) < len(todo),
        "concurrency": concurrency, "wall_s": round(wall, 1),
        "planned": {"abandoned": sum(p.abandon for p in todo[:len(results)]),
                    "streamed": sum(p.stream for p in todo[:len(results)]),
                    "openai": sum(p.route == "openai" for p in todo[:len(results)]),
                    "with_stop": sum(p.stop is not None for p in todo[:len(results)]),
                    "with_seed": sum(p.seed is not None for p in todo[:len(results)]),
                    "long (max_tokens >= 32)": sum(p.max_tokens >= 32 for p in todo[:len(results)])},
        "counts": counts, "counts_by_kind": kinds,
        "failures": [asdict(r) for r in results if r.outcome == "failed"][:50],
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "latency_s": {"request (ok)": percentiles([r.seconds for r in ok]),
                      "ttft (streamed, first text chunk)": percentiles([r.ttft for r in results
                                                                        if r.ttft is not None])},
        "server_finished": server,
        "server_rejected_429": counter(metrics_text, 'mstar_dist_requests_rejected_total{reason="queue_full"}'),
        "after": idle,
        "rss": {"start_mib": first["rss_mib"] if first else None,
                "baseline_after_requests": baseline_after, "baseline_mib": baseline["rss_mib"] if baseline else None,
                "end_mib": end["rss_mib"] if end else None, "growth": growth, "tolerance": rss_tolerance,
                "within_tolerance": bool(growth) and all(g is not None and g <= rss_tolerance for g in growth.values()),
                "late_mib_per_1k_requests": late_slope(series),
                "series": series},
    }


def late_slope(series: list[dict]) -> dict[str, float]:
    """Per rank, RSS growth in MiB per 1,000 completed requests over the second half of the samples after the
    baseline (informative, not a criterion): a leak keeps its slope to the end, a one-time step (a cache or an
    allocator arena filling once) does not."""
    start = next((i for i, row in enumerate(series) if row.get("label") == "baseline"), None)
    after = series[start:] if start is not None else []
    if len(after) < 3:
        return {}
    mid, last = after[len(after) // 2], after[-1]
    done = last["done"] - mid["done"]
    if done <= 0:
        return {}
    return {rank: round((last["rss_mib"][rank] - mib) * 1000 / done, 3)
            for rank, mib in mid["rss_mib"].items() if rank in last["rss_mib"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "launch/configs/smollm2_pd.yaml"))
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: the config's highest rank + 1)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=3600.0, help="no new request after this many seconds")
    p.add_argument("--baseline-after", type=int, default=100, help="completed requests before the RSS baseline")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default bench/raw/soak_<config name>.json")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import yaml

    from tests.e2e.server import Server

    config = Path(args.config)
    nproc = args.nproc or 1 + max(r for g in yaml.safe_load(config.read_text())["node_groups"] for r in g["ranks"])
    load_before = os.getloadavg()
    server = Server(config, nproc=nproc)
    try:
        report = run_soak(server.base_url, plan(args.requests, args.seed), concurrency=args.concurrency,
                          max_seconds=args.max_seconds, baseline_after=args.baseline_after,
                          sample_s=args.sample_s, rss_tolerance=args.rss_tolerance)
    finally:
        clean = server.stop_clean(nproc)
    report = {
        "command": " ".join(["python", *sys.argv]), "config": str(config), "nproc": nproc,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_1m_before": round(load_before[0], 2), "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "cold_start_to_health_s": round(server.ready_seconds, 1), "ranks_exited_cleanly": clean, **report,
    }
    report["checks"] = checks(report)
    if not all(report["checks"].values()):
        report["server_log_tail"] = server.log()
    out = Path(args.out or REPO / f"bench/raw/soak_{config.stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    summary = {k: report[k] for k in ("requests_sent", "counts", "latency_s", "after", "checks")}
    print(json.dumps(summary | {"rss_growth": report["rss"]["growth"]}, indent=1))


def checks(report: dict) -> dict[str, bool]:
    """The soak's pass conditions, by name."""
    after = report["after"]
    return {
        "every planned request sent": not report["truncated"],
        "no failed requests": report["counts"].get("failed", 0) == 0,
        "every request ok or abandoned": report["counts"].get("ok", 0) + report["counts"].get("abandoned", 0)
        == report["requests_sent"],
        "0 live tensors on every rank": after["idle"] and bool(after["live_tensors"])
        and not any(after["live_tensors"].values()),
        "0 KV slots used on every rank": after["idle"] and bool(after["kv_slots_used"])
        and not any(after["kv_slots_used"].values()),
        f"RSS growth <= {report['rss']['tolerance']:.0%} on every rank": report["rss"]["within_tolerance"],
        "server counted no errored request": report["server_finished"]["error"] == 0,
    }


if __name__ == "__main__":
    main()
