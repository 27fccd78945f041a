"""A rank killed under load restarts in place and rejoins (docs/architecture.md §10): SmolLM2 with prefill on rank 0
and two decode replicas (ranks 1, 2); rank 2's process is killed with SIGKILL while both replicas stream. A failure
means the other replica's streams were disturbed, the killed replica's requests hung instead of ending at once with a
503 naming the rank and the cause, the rank never came back, came back without serving (its pairs with rank 0 not
formed again), or something was left behind."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time
from pathlib import Path

import httpx

from tests.e2e.server import REPO, Server, per_rank, wait_for

DP = REPO / "launch/configs/smollm2_dp.yaml"


def stream(url: str, i: int, started: set[int], max_tokens: int = 160) -> dict:
    """One streamed request: its lines' arrival times and its last line."""
    body = {"prompt": f"Tell me a long story number {i}.", "stream": True,
            "model_kwargs": {"max_tokens": max_tokens, "temperature": 0.9, "seed": i}}
    times, last = [], ""
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if line.strip():
                times.append(time.monotonic())
                last = line
                if len(times) == 2:
                    started.add(i)
    return {"times": times, "last": json.loads(last) if last else {}}


def test_a_decode_replica_killed_under_load_comes_back_and_serves_while_the_other_streams_on():
    server = Server(DP, nproc=3, overrides={"limits": {"max_concurrent_requests": 16, "max_tokens": 512}})
    try:
        with cf.ThreadPoolExecutor(6) as pool:
            started: set[int] = set()
            futures = [pool.submit(stream, server.base_url, i, started) for i in range(6)]
            wait_for(lambda: len(started) == 6 or any(f.done() for f in futures), 120, "every stream decoding")
            os.kill(server.rank_pid(2), signal.SIGKILL)
            t_kill = time.monotonic()
            results = [f.result(timeout=180) for f in futures]
        failed = [r for r in results if r["last"].get("modality") == "error"]
        served = [r for r in results if r["last"].get("modality") != "error"]
        assert failed and served, f"both replicas had streams: {[r['last'] for r in results]}"
        for r in failed:  # ended at once, naming the rank and the cause
            assert "rank 2 on host localhost died (killed by SIGKILL)" in r["last"]["metadata"]["message"], r["last"]
            assert r["times"][-1] - t_kill < 5
        for r in served:  # the other replica's streams went on to their end
            assert r["last"]["metadata"].get("finish_reason") in ("length", "stop"), r["last"]
            gaps = [b - a for a, b in zip(r["times"], r["times"][1:]) if a > t_kill]
            assert max(gaps, default=0) < 5, f"a stream of rank 1 stalled {max(gaps):.1f} s"
        wait_for(lambda: "rank 2 on localhost serves again" in server.log(), 120, "rank 2 rejoining")
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        with cf.ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda i: httpx.post(f"{server.base_url}/generate", timeout=120, json={
                "prompt": f"Hello {i}", "model_kwargs": {"max_tokens": 8, "seed": i}}), range(12)))
        assert all(r.status_code == 200 for r in again), [r.text for r in again]
        rows = per_rank(server.base_url, "mstar_dist_engine_decode_rows_total")
        assert rows.get("2", 0) > 0, f"the restarted replica must decode again: {rows}"
        wait_for(lambda: per_rank(server.base_url, "mstar_dist_live_tensors") == {"0": 0, "1": 0, "2": 0}, 30,
                 "every rank's live tensors back to 0")
    finally:
        assert server.stop_clean(3), server.log()


def test_a_replica_stopped_past_the_timeout_has_its_requests_run_elsewhere_and_rejoins_after_sigcont():
    """Two SmolLM2 replicas (ranks 0 and 1, each prefill and decode) with ``restart.retry_in_flight``: rank 1's
    process is stopped (SIGSTOP) past ``limits.rank_timeout_s``. The requests it held, none of which streamed
    anything, must run again on rank 0 and succeed; once it is continued (SIGCONT) the old process, which its peers
    gave up, must be told to restart, and its new process must rejoin and serve. A failure means a stopped replica's
    requests were lost (a 503 or a hang) or the rank never came back."""
    overrides = {"node_groups": [{"node_names": ["LLM"], "ranks": [0, 1], "graph_walks": ["prefill", "decode"]}],
                 "limits": {"max_concurrent_requests": 16, "max_tokens": 512, "rank_timeout_s": 4},
                 "restart": {"retry_in_flight": True, "backoff_s": 0.5}}
    server = Server(DP, nproc=2, overrides=overrides)
    pid = server.rank_pid(1)
    try:
        os.kill(pid, signal.SIGSTOP)

        def ask(i: int) -> httpx.Response:
            return httpx.post(f"{server.base_url}/generate", timeout=120, json={
                "prompt": f"Hello {i}", "model_kwargs": {"max_tokens": 8, "seed": i}})

        with cf.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        log = server.log()
        assert "rank 1 declared dead: silent for" in log, log
        assert "runs again on another replica" in log, "no request was routed to the stopped replica"
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: "rank 1 on localhost serves again" in server.log(), 120, "rank 1 rejoining")
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower(), \
            "the stopped process must be gone: its peers gave up its pairs"
        with cf.ThreadPoolExecutor(4) as pool:
            again = list(pool.map(ask, range(100, 112)))
        assert all(r.status_code == 200 for r in again), [r.text for r in again]
        rows = per_rank(server.base_url, "mstar_dist_engine_decode_rows_total")
        assert rows.get("1", 0) > 0, f"the restarted replica must decode again: {rows}"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()
    text = server.log_path.read_text(errors="replace")
    assert text.count("exits with status 0 (SIGTERM") == 2, text[-6000:]


def test_a_killed_tp_member_restarts_with_its_whole_replica_and_the_replica_serves_the_same_text():
    """Qwen3-MoE with prefill on TP ranks 0, 1 and decode on TP ranks 2, 3: rank 3's process is killed with SIGKILL.
    Its TP partner (rank 2) must be restarted with it, both must rejoin (a fresh TP group between them, fresh pairs
    with the prefill ranks), and greedy answers afterwards must be the ones before. A failure means a TP replica came
    back half (a hang in its first all-reduce), with shards that disagree (other text), or not at all."""
    moe = REPO / "launch/configs/moe_pd_tp2.yaml"
    weights = os.path.expanduser("~/.cache/mstar_dist/qwen3-moe-tiny")
    server = Server(moe, nproc=4, overrides={"weights": weights, "restart": {"backoff_s": 0.5}})

    def texts() -> list[str]:
        out = []
        for i in range(3):
            r = httpx.post(f"{server.base_url}/generate", timeout=120, json={
                "prompt": f"Count with me {i}:", "model_kwargs": {"max_tokens": 12, "temperature": 0}})
            assert r.status_code == 200, r.text
            out.append(r.json()["text"])
        return out

    try:
        before = texts()
        os.kill(server.rank_pid(3), signal.SIGKILL)
        wait_for(lambda: all(f"rank {r} on localhost serves again" in server.log() for r in (2, 3)), 180,
                 "ranks 2 and 3 rejoining")
        assert "restarting with its TP replica (rank 3 died)" in server.log()
        assert texts() == before
    finally:
        server.stop()
    text = server.log_path.read_text(errors="replace")
    assert text.count("exits with status 0 (SIGTERM") == 4, text[-6000:]
