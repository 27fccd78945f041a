"""Overload and timeouts without processes: the conductor's bounded admission queue (429 with a retry hint, at
once) and its request timeout (504 for running and queued requests), and how the app shows them to clients.

A failure means an overloaded server queues without bound (memory grows, every client waits), refuses requests
it could have admitted, sends a 429 without ``Retry-After``, or lets a stuck request hold its ranks forever.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from mstar_dist.config.deployment import Limits
from mstar_dist.config.schema import ConfigError
from mstar_dist.control import messages as m
from mstar_dist.server.app import build_app
from mstar_dist.server.backend import BackendError, Finished
from tests.fakes import FakeBackend
from tests.unit.test_conductor import emit, make, params, submit, walks_sent


def test_max_queued_requests_is_validated_and_documented():
    assert Limits().max_queued_requests == 256
    assert Limits(max_queued_requests=0).max_queued_requests == 0  # 0: nobody waits
    with pytest.raises(ConfigError, match="max_queued_requests = -1"):
        Limits(max_queued_requests=-1)
    with pytest.raises(ConfigError, match="must be an integer"):
        Limits(max_queued_requests=True)


def test_a_full_queue_refuses_at_once_with_429_and_admitted_requests_go_on():
    c, ch = make(max_concurrent=2)
    c.admission.max_queued = 1
    running = [submit(c, params(rid, max_tokens=3)) for rid in ("a", "b")]
    queued = submit(c, params("c"))
    refused = submit(c, params("d"))
    assert queued == [] and c.queue_depth == 1
    (err,) = refused
    assert isinstance(err, BackendError) and err.status == 429
    assert "max_queued_requests" in err.message and 1 <= err.retry_after_s <= 60
    assert c.metrics.rejected["queue_full"] == 1
    wire_a = walks_sent(ch, "start")[0][1].request_id
    emit(c, wire_a, 1)  # the admitted request keeps being served
    assert running[0] and running[0][-1].n_tokens == 1
    c.abort("a")
    assert [b.request_id.split("#")[0] for _, b in walks_sent(ch, "start")] == ["a", "b", "c"]
    assert submit(c, params("e")) == []  # room in the queue again


def test_no_queue_means_refuse_when_every_slot_is_busy():
    c, _ = make(max_concurrent=1)
    c.admission.max_queued = 0
    assert submit(c, params("a")) == []
    assert submit(c, params("b"))[0].status == 429


def test_retry_after_grows_with_the_queue_and_recent_latency():
    c, _ = make(max_concurrent=2)
    c.admission.latency_ewma_s = 4.0
    assert c.admission.retry_after_s() == 2  # (0 + 1) / 2 waves x 4 s
    for i in range(7):
        c.admission.queue.append(object())
    assert c.admission.retry_after_s() == 16
    c.admission.latency_ewma_s = 1000.0
    assert c.admission.retry_after_s() == 60


def test_queued_request_times_out_with_504_and_leaves_the_queue():
    c, ch = make(max_concurrent=1, timeout=5.0)
    submit(c, params("run"))
    waiting = submit(c, params("wait"))
    arrived = c.admission.queue[0].arrived
    c.check_timeouts(now=arrived + 6)
    assert waiting[-1].status == 504 and "waiting for admission" in waiting[-1].message
    assert c.queue_depth == 0 and c.active_count == 0  # the running one timed out too
    removed = [b.request_id for _, b in ch.sent if isinstance(b, m.RemoveRequest)]
    assert removed and all(rid.startswith("run#") for rid in removed)  # only the admitted one had ranks


def test_queued_time_counts_towards_the_timeout_after_admission():
    c, ch = make(max_concurrent=1, timeout=5.0)
    submit(c, params("first"))
    late = submit(c, params("late"))
    arrived = c.admission.queue[0].arrived
    c.abort("first")  # "late" is admitted now, with its original arrival time
    assert c.running("late").arrived == arrived
    c.check_timeouts(now=arrived + 5.5)
    assert late[-1].status == 504


# ------------------------------------------------------------------------------------------------- HTTP


@pytest.mark.parametrize("path,body,shape", [
    ("/generate", {"prompt": "hi"}, "native"),
    ("/generate", {"prompt": "hi", "stream": True}, "native"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, "openai"),
])
def test_429_reaches_the_client_with_retry_after_even_when_streaming(path, body, shape):
    fake = FakeBackend(fail_at=0, error=BackendError(429, "the server is at capacity", retry_after_s=7))
    with TestClient(build_app(fake), raise_server_exceptions=False) as client:
        resp = client.post(path, json=body)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "7"
    error = resp.json()["error"]
    assert (error if shape == "native" else error["message"]) == "the server is at capacity"


def test_timeout_mid_stream_is_a_final_error_line():
    fake = FakeBackend(fail_at=2, error=BackendError(504, "request timed out after 5 s"))
    with TestClient(build_app(fake), raise_server_exceptions=False) as client:
        resp = client.post("/generate", json={"prompt": "hi", "stream": True})
    assert resp.status_code == 200
    last = resp.text.strip().splitlines()[-1]
    assert '"modality":"error"' in last and '"status":504' in last and fake.closed.is_set()


def test_finished_requests_feed_the_latency_estimate():
    c, ch = make()
    events = submit(c, params("x", max_tokens=1))
    wire = walks_sent(ch)[0][1].request_id
    before = c.admission.latency_ewma_s
    emit(c, wire, 1)
    c.handle("rank0", m.encode("tok", "rank0", m.WalkDone(request_id=wire, walk="start", rank=0, outputs={})))
    assert isinstance(events[-1], Finished) and c.admission.latency_ewma_s != before
