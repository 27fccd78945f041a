"""A walk whose loop body spans two ranks, through the real launcher (2 ranks, gloo pairs): the toy STEP node on
rank 0 and CHECK on rank 1 (tests/toy_span_deploy.yaml). A failure here points at the NodeDone protocol over
real sockets and pair groups (descriptor order, p2p receives posted on arrival), or at cleanup after a walk that
spans ranks; tests/unit/test_walk_spans.py checks the same behaviour in one process.
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.e2e.server import REPO, Server, per_rank, wait_for
from tests.toy_model import span_text


@pytest.fixture(scope="module")
def spans():
    server = Server(REPO / "tests/toy_span_deploy.yaml", nproc=2)
    yield server
    assert server.stop_clean(2), server.log()


def gen(base_url: str, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{base_url}/generate", timeout=60,
                      json={"prompt": prompt, "model_kwargs": {"max_tokens": max_tokens}})


def test_loop_across_two_ranks_equals_the_colocated_answer(spans):
    cases = [(5, 12), (95, 20), (130, 20), (0, 1), (236, 3), (400, 40)]
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda c: gen(spans.base_url, f"start={c[0]}", c[1]), cases))
    assert [r.status_code for r in responses] == [200] * len(cases), [r.text for r in responses]
    assert [r.json()["text"] for r in responses] == [span_text(s, n) for s, n in cases]
    assert [r.json()["finish_reason"] for r in responses] == ["length", "stop", "stop", "length", "stop", "stop"]


def test_values_cross_on_the_pair_and_nothing_is_left_behind(spans):
    before = per_rank(spans.base_url, "mstar_dist_edge_bytes_sent_total")
    assert gen(spans.base_url, "start=1000", 30).json()["text"] == span_text(1000, 30)
    def settled() -> bool:  # gauges arrive every 0.5 s
        sent = per_rank(spans.base_url, "mstar_dist_edge_bytes_sent_total")
        live = per_rank(spans.base_url, "mstar_dist_live_tensors")
        assert sent.get("0", 0) - before.get("0", 0) >= 30 * 80_000, (before, sent)  # y went 0 -> 1 on the pair
        assert not any(live.values()), live
        return True

    wait_for(settled, 10, "y's bytes counted on the pair and live tensors at 0", interval=0.2)
