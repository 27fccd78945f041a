"""Tensor parallelism through the real launcher (gloo on CPU): the Qwen3-MoE-shaped family (tiny random weights
prepared on first start) at TP1, TP2, P/D with TP2 on both sides and TP2 across two hosts; SmolLM2 at TP3.

A failure here means a TP replica does not run in lockstep (followers replay a different batch, the KV shards of a
P/D split do not reach their counterparts), sharding changes the greedy text, or losing a member of a TP replica
hangs or fails its requests with something other than a 503 naming the rank.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
import yaml

from tests.e2e.server import REPO, WEIGHTS, Server, metric, per_rank, wait_for

MOE = {"weights": "~/.cache/mstar_dist/qwen3-moe-tiny"}
PROMPTS = ["Tell me a story", "The capital of France is", "Count to ten:"]


def greedy(base_url: str, n: int = 16, prompts: list[str] = PROMPTS) -> list[str]:
    out = []
    for prompt in prompts:
        r = httpx.post(f"{base_url}/generate", timeout=120, json={
            "prompt": prompt, "model_kwargs": {"max_tokens": n, "temperature": 0}})
        assert r.status_code == 200, r.text
        out.append(r.json()["text"])
    return out


def keep_busy(base_url: str, stop_at: list[float]) -> None:
    """Requests back to back until the server goes (they fail then: that is what is being done to them)."""
    while not stop_at or time.monotonic() < stop_at[0] + 30:
        try:
            httpx.post(f"{base_url}/generate", timeout=30, json={
                "prompt": "Tell me a story", "model_kwargs": {"max_tokens": 64, "temperature": 0}})
        except httpx.HTTPError:
            return


def serve(config: str, nproc: int, overrides: dict, nodes: list[int] | None = None, busy_at_stop: bool = False,
          **ask) -> list[str]:
    """The greedy text of ``ask``; the server stops with SIGTERM and every rank must exit 0, with
    ``busy_at_stop`` while requests are running (a TP follower that left before its leader's last step would leave
    the leader blocked in that step's collectives)."""
    # float32 everywhere (on CUDA the default is bfloat16, whose TP sums differ from TP1's in the last bits and
    # then change greedy text): the comparison means the same on a GPU as on this CPU
    own = yaml.safe_load((REPO / config).read_text()).get("model_kwargs") or {}
    overrides = {**overrides, "model_kwargs": {**own, **overrides.get("model_kwargs", {}), "dtype": "float32"}}
    server = Server(REPO / config, nproc, overrides=overrides, nodes=nodes)
    pool, stop_at = cf.ThreadPoolExecutor(4), []
    try:
        text = greedy(server.base_url, **ask)
        served = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": served, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] > 0, chat.text
        def no_live_tensors() -> bool:  # per-rank gauges arrive every 0.5 s (later on a loaded machine)
            live = per_rank(server.base_url, "mstar_dist_live_tensors")
            assert not any(live.values()), live
            return True

        wait_for(no_live_tensors, 15, "every rank's live tensors at 0", interval=0.3)
        if busy_at_stop:
            for _ in range(4):
                pool.submit(keep_busy, server.base_url, stop_at)
            # stop while generations run, not before the first one starts
            wait_for(lambda: metric(server.base_url, "mstar_dist_requests_running"), 30, "a generation running",
                     interval=0.05)
    finally:
        stop_at.append(time.monotonic())
        clean = server.stop_clean(sum(nodes or [nproc]))
        pool.shutdown(wait=True)
        assert clean, server.log()
    return text


@pytest.fixture(scope="module")
def moe_tp1() -> list[str]:
    one_rank = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]}]
    return serve("launch/configs/moe_tp2.yaml", 1, {**MOE, "node_groups": one_rank})


def test_moe_tp2_gives_the_tp1_text_and_stops_cleanly_under_load(moe_tp1):
    assert serve("launch/configs/moe_tp2.yaml", 2, MOE, busy_at_stop=True) == moe_tp1


def test_moe_pd_with_tp2_on_both_sides_gives_the_same_text(moe_tp1):
    assert serve("launch/configs/moe_pd_tp2.yaml", 4, MOE) == moe_tp1


def test_moe_tp2_across_two_hosts_serves_the_same_text(moe_tp1):
    assert serve("launch/configs/moe_tp2_2host.yaml", 0, MOE, nodes=[1, 1]) == moe_tp1


def test_smollm2_tp3_gives_the_tp1_text():
    tp3 = [{"node_names": ["LLM"], "ranks": [0, 1, 2], "tp_size": 3, "graph_walks": ["prefill", "decode"],
            "cpu_threads": 1}]
    one = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"], "cpu_threads": 1}]
    base, ask = {"weights": WEIGHTS}, {"n": 8, "prompts": PROMPTS[1:]}  # 30 layers x 2 gloo all-reduces per token
    assert serve("launch/configs/smollm2_single.yaml", 3, {**base, "node_groups": tp3}, **ask) == \
        serve("launch/configs/smollm2_single.yaml", 1, {**base, "node_groups": one}, **ask)


def test_losing_rank_0s_tp_partner_fails_its_requests_with_a_503_naming_it_and_the_launch_exits():
    server = Server(REPO / "launch/configs/moe_tp2_2host.yaml", 0, nodes=[1, 1],
                    overrides={**MOE, "limits": {"max_concurrent_requests": 8, "request_timeout_s": 120,
                                                 "max_tokens": 256, "rank_timeout_s": 6}})
    try:
        def long_one(i: int) -> httpx.Response:
            return httpx.post(f"{server.base_url}/generate", timeout=60, json={
                "prompt": f"story {i}", "model_kwargs": {"max_tokens": 250, "temperature": 0.8, "seed": i}})

        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(long_one, i) for i in range(3)]
            wait_for(lambda: metric(server.base_url, "mstar_dist_requests_running") == 3, 30,
                     "the 3 long requests running")
            server.kill_node(1)  # host node-b: rank 1, the follower
            t_kill = time.monotonic()
            futures.append(pool.submit(long_one, 99))  # reaches the leader before rank 1 is declared dead
            responses = [f.result(timeout=60) for f in futures]
        assert time.monotonic() - t_kill < 6 + 5, "requests must end within rank_timeout_s, never hang"
        failed = [r for r in responses if r.status_code != 200]
        assert failed and all(r.status_code == 503 and "rank 1" in r.text for r in failed), \
            [(r.status_code, r.text[:200]) for r in responses]
        # the replica holds rank 0, which is not restarted in place: it can never serve again, and with no other
        # replica the launch exits non-zero (for its scheduler to start it again) instead of answering 503 forever
        status = server.proc.wait(timeout=30)
        assert status != 0
        log = server.log_path.read_text(errors="replace")
        assert "share a TP replica with rank 0, which is not restarted in place" in log, log[-5000:]
        assert "telling rank 0 to restart" not in log, log[-5000:]
    finally:
        server.stop()
