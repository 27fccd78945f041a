"""End to end under load: SmolLM2 with prefill on rank 0 and two decode replicas (ranks 1, 2), real launcher.

A failure here means the runtime leaks (tensors or KV slots left behind by completed or abandoned requests), an
abandoned stream is not aborted everywhere, requests are not spread over the decode replicas, or a pinned
request's text depends on which replica (or placement) served it. The DP deployment parses HTTP in 2 intake
processes, which also apply the chat template and tokenize (``prompt_encoder``); the single rank's conductor does
that itself, so equal texts also say both give the same prompt ids.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import re

import httpx
import pytest

from tests.e2e.server import REPO, Server, per_rank, wait_for

DP = REPO / "launch/configs/smollm2_dp.yaml"
SINGLE = REPO / "launch/configs/smollm2_single.yaml"


@pytest.fixture(scope="module")
def dp():
    server = Server(DP, nproc=3, overrides={"server": {"http_processes": 2}})
    yield server
    assert server.stop_clean(3), server.log()


def run_one(base_url: str, i: int, abandon: bool) -> str:
    body = {"prompt": f"Story number {i}: once upon a time", "stream": True,
            "model_kwargs": {"max_tokens": 12, "temperature": 0.8, "seed": i}}
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=120) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        for n, line in enumerate(r.iter_lines()):
            if abandon and n >= 1:
                return "abandoned"  # leaving the with-block closes the connection mid-stream
            if '"error"' in line:
                return "error"
    return "done"


def test_few_hundred_requests_with_a_fifth_abandoned_leave_nothing_behind(dp):
    rng = random.Random(0)
    plan = [(i, rng.random() < 0.2) for i in range(200)]
    with cf.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda p: run_one(dp.base_url, *p), plan))
    assert outcomes.count("done") == sum(1 for _, a in plan if not a), outcomes
    assert outcomes.count("abandoned") == sum(1 for _, a in plan if a)
    wait_for(lambda: per_rank(dp.base_url, "mstar_dist_live_tensors") == {"0": 0, "1": 0, "2": 0}, 30,
             "every rank's live tensors back to 0")
    wait_for(lambda: set(per_rank(dp.base_url, "mstar_dist_engine_kv_slots_used").values()) == {0}, 30,
             "every KV slot freed")
    assert per_rank(dp.base_url, "mstar_dist_live_tensor_bytes") == {"0": 0, "1": 0, "2": 0}
    rows = per_rank(dp.base_url, "mstar_dist_engine_decode_rows_total")
    assert rows["1"] > 100 and rows["2"] > 100, f"both decode replicas should serve: {rows}"
    text = httpx.get(f"{dp.base_url}/metrics", timeout=10).text
    aborted = int(re.search(r'mstar_dist_requests_finished_total\{reason="abort"\} (\d+)', text).group(1))
    assert aborted >= outcomes.count("abandoned") - 2  # a stream may finish before its abandonment lands
    assert httpx.get(f"{dp.base_url}/health", timeout=10).status_code == 200


def pinned(base_url: str, times: int = 4) -> list[str]:
    """A pinned native request and a pinned chat completion, ``times`` each: [native, chat, native, chat, ...]."""
    out = []
    for i in range(times):  # the same pinned request repeatedly: replicas are picked uniformly among ties
        r = httpx.post(f"{base_url}/generate", timeout=120, json={
            "prompt": "The best thing about the ocean is", "request_id": "dp-pin",
            "model_kwargs": {"max_tokens": 24, "temperature": 1.0, "top_p": 0.9}})
        assert r.status_code == 200, r.text
        out.append(r.json()["text"])
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, headers={"X-Request-Id": "dp-pin-chat"},
                       json={"messages": [{"role": "system", "content": "Answer briefly."},
                                          {"role": "user", "content": "Which colour is the sea?"}],
                             "max_tokens": 16, "temperature": 1.0, "top_p": 0.9})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def test_pinned_request_is_identical_on_every_replica_and_colocated(dp):
    texts = pinned(dp.base_url)
    assert len(set(texts[0::2])) == 1 and len(set(texts[1::2])) == 1, texts
    single = Server(SINGLE, nproc=1)
    try:
        assert pinned(single.base_url, times=1) == texts[:2]
    finally:
        single.stop()
