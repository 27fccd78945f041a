"""Generated garbage against every route of a real deployment (toy model, 2 ranks, ``--api-key``), driven by
schemathesis from the server's own OpenAPI document: valid and invalid bodies, headers and parameters.

A failure means some input makes the server answer 5xx, hang, stop being healthy, or leak tensors on a rank; or
the OpenAPI document stopped describing the request bodies (then few generated requests would be admitted).
Also checks /metrics of real ranks: HELP/TYPE everywhere, per-rank process and p2p edge series.
"""

from __future__ import annotations

import collections
import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from tests.e2e.server import REPO, Server, per_rank, wait_for

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CASES = 1000


@pytest.fixture(scope="module")
def toy():
    server = Server(REPO / "tests/toy_deploy.yaml", nproc=2, args=("--api-key", KEY), overrides={
        "model_kwargs": {"batch_sleep_s": 0.0},
        "transport": {"inline_max_bytes": 0},  # every edge tensor on p2p, so its histograms fill
        "limits": {"max_concurrent_requests": 8, "request_timeout_s": 30, "max_tokens": 8}})
    yield server
    assert server.stop_clean(2), server.log()


def test_generated_requests_never_get_5xx_or_hang_and_leave_the_server_clean(toy):
    schema = schemathesis.openapi.from_url(f"{toy.base_url}/openapi.json", headers=AUTH)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    seen: collections.Counter[tuple[str, str, int]] = collections.Counter()
    failures: list[str] = []

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case):
        mode = "positive" if case.meta is None or case.meta.generation.mode.is_positive else "negative"
        t0 = time.monotonic()
        response = case.call(base_url=toy.base_url, headers=AUTH, timeout=30)
        seen[(f"{case.method} {case.path}", mode, response.status_code)] += 1
        if response.status_code >= 500 or time.monotonic() - t0 > 20:
            failures.append(f"{case.method} {case.path} -> {response.status_code} in {time.monotonic() - t0:.1f} s:"
                            f" {response.text[:300]}\n  body: {str(case.body)[:300]}\n  headers: {case.headers}")

    run()
    assert not failures, "\n".join(failures[:10])
    total = sum(seen.values())
    routes = {route for route, _, _ in seen}
    assert total >= 1000 and len(routes) == 10, (total, sorted(routes))
    for route in ("POST /generate", "POST /v1/chat/completions", "POST /v1/completions"):
        positive = [(code, n) for (r, mode, code), n in seen.items() if r == route and mode == "positive"]
        ok = sum(n for code, n in positive if code < 300)
        assert ok >= 0.5 * sum(n for _, n in positive), (route, sorted(positive))
    assert httpx.get(f"{toy.base_url}/health", timeout=10).status_code == 200
    wait_idle(toy.base_url)


def test_without_the_key_every_route_but_health_is_401(toy):
    for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/generate"),
                         ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                         ("GET", "/openapi.json")):
        assert httpx.request(method, f"{toy.base_url}{path}", timeout=10).status_code == 401, path
    assert httpx.get(f"{toy.base_url}/health", timeout=10).status_code == 200


def test_metrics_of_real_ranks_have_help_type_process_and_edge_series(toy):
    r = httpx.post(f"{toy.base_url}/generate", headers=AUTH, timeout=30, json={"prompt": "start=3"})
    assert r.status_code == 200, r.text

    def series_of_every_rank() -> bool:
        text = httpx.get(f"{toy.base_url}/metrics", headers=AUTH, timeout=10).text
        typed = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
        for name in {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in text.splitlines()
                     if line and not line.startswith("#")}:
            assert name in typed or re.sub(r"_(bucket|sum|count)$", "", name) in typed, name
        for rank in ("0", "1"):
            rss = re.search(rf'^mstar_dist_process_resident_memory_bytes{{rank="{rank}"}} (\S+)$', text, re.M)
            assert rss and float(rss.group(1)) > 10e6, (rank, rss)
            assert re.search(rf'^mstar_dist_process_open_fds{{rank="{rank}"}} [1-9]', text, re.M)
        sends = re.findall(r'^mstar_dist_edge_transfer_bytes_count\{direction="send",rank="\d",transport="p2p"\} '
                           r'(\S+)$', text, re.M)
        assert sends and sum(float(v) for v in sends) > 0, "the toy's x moves rank 0 -> 1 over p2p"
        assert re.search(r'^mstar_dist_edge_transfer_seconds_count\{direction="recv",rank="1",transport="p2p"\} '
                         r'[1-9]', text, re.M)
        assert re.search(r'^mstar_dist_control_messages_rejected_total\{receiver="conductor"\} 0\.0$', text, re.M)
        return True

    wait_for(series_of_every_rank, 15, "the ranks' series in /metrics")  # ranks report every 0.5 s


def wait_idle(base_url: str) -> None:
    """Nothing running and every rank's live tensors back at 0 (ranks report every 0.5 s)."""
    def idle() -> bool:
        text = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=10).text
        live = {m.group(1): float(m.group(2))
                for m in re.finditer(r'^mstar_dist_live_tensors\{rank="(\d+)"\} (\S+)$', text, re.M)}
        running = float(re.search(r"^mstar_dist_requests_running (\S+)$", text, re.M).group(1))
        assert running == 0 and live and not any(live.values()), (running, live)
        return True

    wait_for(idle, 15, "nothing running and every rank's live tensors at 0", interval=0.2)


__all__ = ["per_rank"]
