"""Overload and timeouts on real ranks (toy model, 2 ranks, tests/toy_deploy.yaml with 2 slots and a queue of 2).

The server logs with ``--log-format json``. A failure means an overloaded server makes clients wait instead of refusing them at once with a 429 and a
``Retry-After``, drops requests it had admitted, or lets a request past ``limits.request_timeout_s`` run on (or
keep its tensors) instead of ending with a 504 / a final error line.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from tests.e2e.server import REPO, Server, metric, per_rank, wait_for

TIMEOUT_S = 5
STEP_S = 0.1  # the toy's steps: sleep-bound, so timings hold on a busy host


@pytest.fixture(scope="module")
def toy():
    server = Server(REPO / "tests/toy_deploy.yaml", nproc=2, args=("--log-format", "json"), overrides={
        "model_kwargs": {"batch_sleep_s": STEP_S},
        "limits": {"max_concurrent_requests": 2, "max_queued_requests": 2, "request_timeout_s": TIMEOUT_S,
                   "max_tokens": 1000}})
    yield server
    assert server.stop_clean(2), server.log()


def gen(base_url: str, start: int, max_tokens: int, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{base_url}/generate", timeout=60, json={
        "prompt": f"start={start}", "stream": stream, "model_kwargs": {"max_tokens": max_tokens}})


def wait_metric(base_url: str, series: str, value: float, timeout: float = 10) -> None:
    wait_for(lambda: metric(base_url, series) == value, timeout, f"{series} reaching {value}", interval=0.05)


def idle(base_url: str) -> None:
    """Nothing running, and every rank's leak canary back at 0 (ranks report every 0.5 s)."""
    wait_metric(base_url, "mstar_dist_requests_running", 0)

    def no_live_tensors() -> bool:
        live = per_rank(base_url, "mstar_dist_live_tensors")
        assert not any(live.values()), live
        return True

    wait_for(no_live_tensors, 5, "every rank's live tensors at 0")


def test_past_the_queue_requests_get_429_at_once_and_admitted_ones_finish(toy):
    with cf.ThreadPoolExecutor(4) as pool:
        admitted = [pool.submit(gen, toy.base_url, i * 100, 12) for i in range(4)]
        wait_metric(toy.base_url, "mstar_dist_requests_queued", 2)
        refused = []
        for i in range(6):
            t0 = time.monotonic()
            r = gen(toy.base_url, 1000 + i, 5)
            refused.append((r, time.monotonic() - t0))
        results = [f.result() for f in admitted]
    for r, seconds in refused:
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert "max_queued_requests" in r.json()["error"]
        assert seconds < 1.0, "a refusal must not wait for a slot"
    for i, r in enumerate(results):
        assert r.status_code == 200, r.text
        assert r.json()["text"].split()[0] == str(i * 100 + 1)
    assert metric(toy.base_url, r'mstar_dist_requests_rejected_total\{reason="queue_full"\}') >= 6
    idle(toy.base_url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_timeout_ends_with_504_and_frees_everything(toy, stream):
    t0 = time.monotonic()
    r = gen(toy.base_url, 0, 100, stream=stream)  # 100 steps of 0.1 s: past the 5 s limit
    elapsed = time.monotonic() - t0
    if stream:
        assert r.status_code == 200
        last = json.loads(r.text.strip().splitlines()[-1])
        assert last["modality"] == "error" and last["metadata"]["status"] == 504
    else:
        assert r.status_code == 504 and "request_timeout_s" in r.json()["error"]
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 5
    idle(toy.base_url)
    assert gen(toy.base_url, 7, 3).json()["text"] == "8 9 10 "


def test_json_logs_are_one_object_a_line_with_rank_and_host(toy):
    text = toy.log_path.read_text(errors="replace")
    ours = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert not [line for line in text.splitlines() if "[rank " in line or "mstar_dist.boot:" in line]
    assert {o["rank"] for o in ours if o["logger"] == "mstar_dist.boot"} == {0, 1}
    assert all(o["host"] == "localhost" and o["time"] and o["level"] for o in ours)
    assert any("mstar_dist: serving" in o["message"] for o in ours)  # the operator's lines too
