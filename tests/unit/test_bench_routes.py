"""``scripts/bench_serving.py``'s tallies read what the server streams on each route: the first token's time and the
completion tokens, exactly (the chat route's from the usage of its last chunk)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from mstar_dist.server.app import build_app
from scripts.bench_serving import ROUTES, TALLIES, request_body
from tests.fakes import FakeBackend


def tally_of(route: str, max_tokens: int):
    fake = FakeBackend()
    tally = TALLIES[route]("rid-1")
    with TestClient(build_app(fake)) as client:
        with client.stream("POST", ROUTES[route], json=request_body("Tell me a story.", max_tokens, route),
                           headers={"X-Request-Id": tally.rid}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                tally.line(line)
    return tally, fake


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_route_is_tallied_from_its_own_stream(route):
    tally, fake = tally_of(route, 3)
    ttft, total, tokens, rid, _ = tally.result()
    params = fake.calls[-1]
    assert rid == "rid-1" and 0 < ttft <= total
    assert tokens == fake.n_yielded == min(3, len(fake.deltas)) and params.max_tokens == 3
    assert params.messages == [{"role": "user", "content": "Tell me a story."}] and params.temperature == 0
    assert params.ignore_eos is (route == "chat")


def test_a_chat_stream_without_its_usage_or_end_is_an_error():
    tally = TALLIES["chat"]("rid-2")
    tally.line(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}')
    with pytest.raises(RuntimeError, match="DONE"):
        tally.result()
    tally.line(b"data: [DONE]")
    with pytest.raises(RuntimeError, match="usage"):
        tally.result()
    tally.line(b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}')
    assert tally.result()[2] == 7
    with pytest.raises(RuntimeError, match="boom"):
        tally.line(b'data: {"error": {"message": "boom"}}')
