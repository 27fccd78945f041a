"""A host dies under load (docs/architecture.md §10): two hosts on loopback, each with a SmolLM2 prefill and a decode replica
(host A: ranks 0, 1; host B: ranks 2, 3; a request stays on one host); host B's torchrun is killed. A failure means requests on the dead host hang
instead of failing fast with a 5xx naming the rank, new requests still go to it, the service does not stay up
on the surviving replica, or host B, started again with the same torchrun command, does not rejoin and serve.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import httpx

from tests.e2e.server import REPO, Server, descendants, per_rank, wait_for

CONFIG = {
    "node_groups": [
        {"node_names": ["LLM"], "ranks": [0, 2], "graph_walks": ["prefill"]},
        {"node_names": ["LLM"], "ranks": [1, 3], "graph_walks": ["decode"]},
    ],
    "cluster": {"hosts": [{"name": "host-a", "addr": "127.0.0.1", "devices": [0, 1]},
                          {"name": "host-b", "addr": "127.0.0.2", "devices": [0, 1]}]},
    "limits": {"max_concurrent_requests": 16, "request_timeout_s": 120, "max_tokens": 512, "rank_timeout_s": 6},
}


def stream(base_url: str, i: int, decoding: set[int] | None = None) -> str:
    """The request's last output line; ``i`` joins ``decoding`` at its second (prefill samples the first token)."""
    body = {"prompt": f"Tell me a long story number {i}.", "stream": True,
            "model_kwargs": {"max_tokens": 400, "temperature": 0.9, "seed": i}}
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=120) as r:
        last, n = "", 0
        for line in r.iter_lines():
            if line.strip():
                last, n = line, n + 1
                if n == 2 and decoding is not None:
                    decoding.add(i)
    return last


def test_requests_on_a_dead_host_fail_fast_and_the_survivor_serves():
    server = Server(REPO / "launch/configs/smollm2_dp.yaml", 0, nodes=[2, 2], overrides=CONFIG)
    try:
        with cf.ThreadPoolExecutor(6) as pool:
            decoding: set[int] = set()
            futures = [pool.submit(stream, server.base_url, i, decoding) for i in range(6)]
            wait_for(lambda: all(i in decoding or f.done() for i, f in enumerate(futures)), 60,
                     "every request decoding (a second streamed line each) or ended")
            server.kill_node(1)  # host B: its agent and its ranks
            t_kill = time.monotonic()
            finals = [f.result(timeout=120) for f in futures]
        elapsed = time.monotonic() - t_kill
        errors = [f for f in finals if '"error"' in f]
        assert errors, f"some of the 6 requests were on host B: {finals}"
        assert all(re.search(r"rank [23] on host host-b died", e) for e in errors), errors
        assert len(errors) < 6, "the requests on host A must complete"
        assert elapsed < 60, "the requests on the dead host must fail fast, not wait for their timeout"
        def host_b_down() -> bool:  # both of host B's ranks went silent at once; each is declared in turn
            up = per_rank(server.base_url, "mstar_dist_rank_up")
            assert sorted(rank for rank, value in up.items() if value == 0) == ["2", "3"], up
            return True

        wait_for(host_b_down, 20, "ranks 2 and 3 declared down", interval=0.2)
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200  # host A still serves
        for i in range(3):
            r = httpx.post(f"{server.base_url}/generate", timeout=60, json={
                "prompt": "Hello", "model_kwargs": {"max_tokens": 8, "seed": i}})
            assert r.status_code == 200, r.text
        # host B comes back: its torchrun, started again as before, rejoins the running deployment
        rows_before = per_rank(server.base_url, "mstar_dist_engine_decode_rows_total").get("3", 0)
        server.restart_node(1)
        wait_for(lambda: all(f"rank {r} on host-b serves again" in server.log() for r in (2, 3)), 180,
                 "host B's ranks rejoining")
        with cf.ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda i: httpx.post(f"{server.base_url}/generate", timeout=120, json={
                "prompt": f"Hello {i}", "model_kwargs": {"max_tokens": 8, "seed": i}}), range(12)))
        assert all(r.status_code == 200 for r in again), [r.text for r in again]
        rows = per_rank(server.base_url, "mstar_dist_engine_decode_rows_total")
        assert rows.get("3", 0) > rows_before, f"host B's decode replica must serve again: {rows}"
    finally:
        server.stop()


def test_ranks_of_other_hosts_exit_when_the_conductor_host_dies():
    server = Server(REPO / "launch/configs/smollm2_dp.yaml", 0, nodes=[2, 2], overrides=CONFIG)
    try:
        # a few heartbeats arm the ranks' watchdog (a rank arms it on its first message from the conductor, which
        # nothing outside the rank shows: a fixed wait)
        time.sleep(2)
        host_b = descendants(server.procs[1].pid)  # its ranks, their supervisors and their children
        server.kill_node(0)  # host A: rank 0 (conductor, HTTP) and rank 1
        t_kill = time.monotonic()
        status = server.procs[1].wait(timeout=30)  # host B's torchrun ends instead of serving nobody forever
        elapsed = time.monotonic() - t_kill
        assert status != 0
        log = server.log()
        assert "rank 0's host (host-a) is gone" in log, log
        assert elapsed < 10, f"host B's ranks took {elapsed:.1f} s to notice (limits.rank_timeout_s is 6)"
        wait_for(lambda: not [pid for pid in host_b if _alive(pid)], 10, "every process of host B gone (no orphan)")
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
