"""Runtime behaviour through the real launcher with the toy model family (tests/toy_model.py, 2 ranks).

A failure here means one request's exception (in preprocess, forward, stop check or postprocess) takes other
requests or the service down, a failing rank is not named to the client, the admission limit loses requests,
or a client that goes away leaves its request running.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from tests.e2e.server import REPO, Server, metric, wait_for


@pytest.fixture(scope="module")
def toy():
    server = Server(REPO / "tests/toy_deploy.yaml", nproc=2)
    yield server
    assert server.stop_clean(2), server.log()


def gen(base_url: str, prompt: str, max_tokens: int = 8, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base_url}/generate", timeout=timeout,
                      json={"prompt": prompt, "model_kwargs": {"max_tokens": max_tokens}})


def test_each_failure_fails_only_its_request(toy):
    prompts = ["start=0", "start=10 fail-pre", "start=20", "fail-forward", "start=40", "fail-stop",
               "start=60 fail-post", "start=70"]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        responses = dict(zip(prompts, pool.map(lambda p: gen(toy.base_url, p), prompts)))
    for start in (0, 20, 40, 70):
        r = responses[f"start={start}"]
        assert r.status_code == 200, r.text
        assert r.json()["text"] == "".join(f"{start + i} " for i in range(1, 9))
    expected = {
        "start=10 fail-pre": "injected preprocess failure",
        "fail-forward": "injected forward failure",
        "fail-stop": "injected stop-check failure",
        "start=60 fail-post": "injected postprocess failure",
    }
    for prompt, words in expected.items():
        r = responses[prompt]
        assert r.status_code == 500, (prompt, r.status_code, r.text)
        assert words in r.text
    assert "rank 1" in responses["fail-forward"].text  # the client learns which rank failed
    assert httpx.get(f"{toy.base_url}/health", timeout=10).status_code == 200
    assert gen(toy.base_url, "start=5", 3).json()["text"] == "6 7 8 "


def test_streamed_failure_ends_with_an_error_line(toy):
    r = httpx.post(f"{toy.base_url}/generate", timeout=60, json={
        "prompt": "fail-forward", "stream": True, "model_kwargs": {"max_tokens": 8}})
    lines = [line for line in r.text.splitlines() if line.strip()]
    assert '"modality": "error"' in lines[-1] or '"modality":"error"' in lines[-1], lines


def test_admission_queue_serves_everything_beyond_the_limit(toy):
    # limits.max_concurrent_requests is 4 in tests/toy_deploy.yaml: 12 at once must queue and all complete
    seen_queued = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen_queued.append(metric(toy.base_url, "mstar_dist_requests_queued"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with cf.ThreadPoolExecutor(12) as pool:
            rs = list(pool.map(lambda i: gen(toy.base_url, f"start={i * 100 + 5}", 30), range(12)))
    finally:
        stop.set()
        watcher.join()
    assert [r.status_code for r in rs] == [200] * 12
    assert all(r.json()["text"].split()[0] == str(i * 100 + 6) for i, r in enumerate(rs))
    assert max(seen_queued) > 0, "with 12 requests and a limit of 4 some must have waited"


def test_client_disconnect_aborts_the_request_everywhere(toy):
    before = metric(toy.base_url, r'mstar_dist_requests_finished_total\{reason="abort"\}')
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up while it runs
        gen(toy.base_url, "start=0", 250, timeout=0.5)
    wait_for(lambda: metric(toy.base_url, r'mstar_dist_requests_finished_total\{reason="abort"\}') > before, 10,
             "the abandoned request's abort")
    # it stopped counting: far fewer than 250 steps ran on the COUNT rank. The deadline stays short on purpose:
    # a request that kept running its 250 steps would outlast it
    wait_for(lambda: metric(toy.base_url, r'mstar_dist_requests_running') == 0, 1.0,
             "mstar_dist_requests_running back at 0 after the abort")
