"""/metrics through prometheus_client, without processes: conductor series, the ranks' Stats (process, edge
histograms), the app's HTTP series. A failure means a dashboard or alert built on our series breaks (a series
without HELP/TYPE, a renamed series, a histogram that stops counting), the leak canary or the per-rank process
metrics disappear, or two conductors in one process share (and corrupt) each other's series.
"""

from __future__ import annotations

import re

import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mstar_dist.control import messages as m
from mstar_dist.server.app import build_app
from mstar_dist.telemetry import process_sample
from tests.fakes import FakeBackend
from mstar_dist.transport.inline import encode_tensor
from tests.unit.test_conductor import emit, from_rank, make, params, submit, walks_sent
from tests.unit.test_worker import make_worker, run_walk, deliver, turn


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample, as Prometheus parses the text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def check_help_and_type(text: str) -> None:
    """Every sample's family has a HELP and a TYPE line (prometheus_client's exposition)."""
    helped = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    typed = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            family = next((f for f in typed if name == f or (name.startswith(f + "_") and
                                                              name[len(f) + 1:] in ("bucket", "sum", "count"))), None)
            assert family in helped and family is not None, f"{name} has no HELP/TYPE"


def stats(rank: int, **fields) -> m.Stats:
    base = dict(live_tensors=0, live_bytes=0, edge_bytes_sent=0, edge_bytes_received=0, host_staging_copies=0)
    return m.Stats(rank=rank, **(base | fields))


def test_a_request_fills_the_request_token_ttft_and_itl_histograms():
    c, ch = make()
    submit(c, params("r", prompt="start=0 pad", max_tokens=3))
    wire = walks_sent(ch)[0][1].request_id
    emit(c, wire, 1)
    from_rank(c, m.WalkDone(request_id=wire, walk="start", rank=0, outputs={"x": encode_tensor(torch.tensor([1]))}))
    emit(c, wire, 2, 3)
    from_rank(c, m.WalkDone(request_id=wire, walk="count", rank=1, outputs={}, finish_reason="length"))
    text = c.metrics.render()
    check_help_and_type(text)
    got = samples(text)
    assert got["mstar_dist_time_to_first_token_seconds_count"] == 1
    assert got["mstar_dist_inter_token_latency_seconds_count"] == 2  # the second emit carried 2 tokens
    assert got["mstar_dist_request_latency_seconds_count"] == 1
    assert got['mstar_dist_request_prompt_tokens_bucket{le="2.0"}'] == 1  # 2 words
    assert got['mstar_dist_request_generation_tokens_sum'] == 3
    assert got["mstar_dist_generated_tokens_total"] == 3 and got["mstar_dist_requests_received_total"] == 1
    assert got['mstar_dist_requests_finished_total{reason="length"}'] == 1
    assert got["mstar_dist_requests_running"] == 0 and got["mstar_dist_requests_queued"] == 0


def test_per_rank_series_come_from_the_ranks_stats():
    c, _ = make()
    hist = m.EdgeHistogram(transport="p2p", direction="send", unit="bytes", bounds=[256.0, 1024.0],
                           counts=[1, 2, 3], total=9000.0)
    c.metrics.rank_stats[1] = stats(1, live_tensors=2, edge_bytes_sent=4096, rss_bytes=5e8, cpu_seconds=1.5,
                                    open_fds=42, engine={"decode_steps_total": 7, "kv_slots_used": 1},
                                    edge_histograms=[hist])
    text = c.metrics.render()
    check_help_and_type(text)
    got = samples(text)
    assert got['mstar_dist_live_tensors{rank="1"}'] == 2 and got['mstar_dist_live_tensors{rank="0"}'] == 0
    assert got['mstar_dist_edge_bytes_sent_total{rank="1"}'] == 4096
    assert got['mstar_dist_process_resident_memory_bytes{rank="1"}'] == 5e8
    assert got['mstar_dist_process_cpu_seconds_total{rank="1"}'] == 1.5
    assert got['mstar_dist_process_open_fds{rank="1"}'] == 42
    assert got['mstar_dist_engine_decode_steps_total{rank="1"}'] == 7
    assert got['mstar_dist_engine_kv_slots_used{rank="1"}'] == 1
    bucket = 'mstar_dist_edge_transfer_bytes_bucket{direction="send",le="%s",rank="1",transport="p2p"}'
    assert got[bucket % "256.0"] == 1 and got[bucket % "1024.0"] == 3 and got[bucket % "+Inf"] == 6
    edge = 'direction="send",rank="1",transport="p2p"'
    assert got[f'mstar_dist_edge_transfer_bytes_count{{{edge}}}'] == 6
    assert got[f'mstar_dist_edge_transfer_bytes_sum{{{edge}}}'] == 9000
    assert 'mstar_dist_rank_up{rank="2"} 1.0' in text  # the series names and labels dashboards use
    assert got["process_resident_memory_bytes"] > 0  # rank 0's own process, prometheus_client's collector


def test_two_conductors_in_one_process_keep_their_own_series():
    a, _ = make()
    b, _ = make()
    a.metrics.requests_received = 5
    assert samples(a.metrics.render())["mstar_dist_requests_received_total"] == 5
    assert samples(b.metrics.render())["mstar_dist_requests_received_total"] == 0


def test_the_app_metrics_have_help_and_type_and_count_routes():
    class Backend(FakeBackend):
        def metrics_text(self) -> str:
            return make()[0].metrics.render()

    client = TestClient(build_app(Backend()))
    client.post("/generate", json={"prompt": "hi"})
    text = client.get("/metrics").text
    check_help_and_type(text)
    assert samples(text)['mstar_http_requests_total{code="200",route="/generate"}'] == 1


def test_the_http_metrics_of_several_intakes_are_summed():
    from mstar_dist.conductor.metrics import render_counts
    from mstar_dist.server.http_metrics import HttpStats

    a, b = HttpStats(), HttpStats()
    a.requests.labels(route="/generate", code="200").inc(3)
    b.requests.labels(route="/generate", code="200").inc(2)
    b.requests.labels(route="/v1/chat/completions", code="400").inc()
    b.in_flight.inc()
    a.disconnected()
    text = render_counts([a.counts(), b.counts()])
    check_help_and_type(text)
    got = samples(text)
    assert got['mstar_http_requests_total{code="200",route="/generate"}'] == 5
    assert got['mstar_http_requests_total{code="400",route="/v1/chat/completions"}'] == 1
    assert got["mstar_http_requests_in_flight"] == 1 and got["mstar_http_client_disconnects_total"] == 1
    assert "_created" not in text  # the time of the summing is no counter's start


def test_the_summed_http_metrics_are_the_series_one_http_process_exports():
    """The conductor sums the intakes' counts without importing HTTP code: its series must stay those of
    ``HttpStats`` (names, help, type)."""
    from mstar_dist.conductor.metrics import render_counts
    from mstar_dist.server.http_metrics import HttpStats

    def heads(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#") and "_created" not in line]

    assert heads(render_counts([])) == heads(HttpStats().render())


def test_process_sample_reads_this_process():
    got = process_sample()
    assert got["rss_bytes"] > 10e6 and got["cpu_seconds"] > 0 and got["open_fds"] > 2


class _Transfer:
    def __init__(self, tensor):
        self.tensor, self.finished = tensor, False

    def done(self):
        return self.finished


class _Plane:
    """A data-plane transport (post_send / post_recv, mstar_dist/transport/base.py) whose transfers end on demand."""

    name = "p2p"

    def __init__(self):
        self.sends, self.recvs = [], []

    def post_send(self, tensor, dst):
        self.sends.append(_Transfer(tensor))
        return self.sends[-1], None

    def post_recv(self, wire, src, device=None):
        self.recvs.append(_Transfer(torch.zeros(wire.shape, dtype=getattr(torch, wire.dtype))))
        return self.recvs[-1]

    def stats(self):
        return {}

    def is_dead(self, peer):
        return False


def test_the_router_meters_bytes_and_times_each_transfer_of_a_transport_once():
    from mstar_dist.control import messages as m
    from mstar_dist.transport.router import Router

    inner = _Plane()
    router = Router(global_rank=1, rank_hosts={1: "h", 2: "h"}, intra_host="p2p", inter_host="p2p",
                    transports={"p2p": inner}, inline_max_bytes=0, device=torch.device("cpu"))
    sent, wire = router.post_send(torch.zeros(300, dtype=torch.float32), 2)  # 1200 bytes
    got = router.post_recv(m.WireTensor(shape=[10], dtype="int64"), 2)  # 80 bytes
    assert wire.at is None and not sent.done() and got.tensor.shape == (10,)  # the transfers' tensors pass through
    inner.sends[0].finished = inner.recvs[0].finished = True
    assert sent.done() and sent.done() and got.done()
    hists = {(h.direction, h.unit): h for h in router.stats()["histograms"]}
    assert all(h.transport == "p2p" for h in hists.values())
    assert hists["send", "bytes"].total == 1200 and sum(hists["send", "bytes"].counts) == 1
    assert hists["send", "bytes"].counts[hists["send", "bytes"].bounds.index(4096.0)] == 1
    assert hists["recv", "bytes"].counts[0] == 1
    assert sum(hists["send", "seconds"].counts) == 1 and sum(hists["recv", "seconds"].counts) == 1
    assert router.is_dead(2) is False  # everything else reaches the transport


def test_the_worker_reports_process_metrics_and_edge_histograms_in_stats():
    from mstar_dist.transport.router import Router

    worker, channel, transport, *_ = make_worker()
    worker.transport = Router(global_rank=1, rank_hosts={0: "h", 1: "h", 2: "h"}, intra_host="p2p",
                              inter_host="p2p", transports={"p2p": transport},
                              inline_max_bytes=1024, device=torch.device("cpu"))
    deliver(worker, channel, run_walk("a", 0))
    turn(worker)
    worker.stats_every_s = 0.0
    worker.poll_once()
    (st,) = [b for _, b in channel.sent if isinstance(b, m.Stats)]
    assert st.rss_bytes > 0 and st.cpu_seconds > 0 and st.open_fds > 0
    assert {(h.transport, h.direction, h.unit) for h in st.edge_histograms} == {
        ("p2p", d, u) for d in ("send", "recv") for u in ("bytes", "seconds")}


def test_inter_token_latency_buckets_hold_values_up_to_their_bound():
    """The per-token histogram (filled without prometheus_client's lock): a gap split over the tokens it brought, each
    counted in the first bucket whose bound it does not exceed, cumulative in the exposition, and nothing for a
    request's first tokens."""
    from mstar_dist.conductor.metrics import Metrics

    metrics = Metrics(world_size=1)
    metrics.observe_tokens(1, None)  # a first token: no gap
    metrics.observe_tokens(2, 0.002)  # two tokens 1 ms apart: exactly the first bound
    metrics.observe_tokens(1, 0.003)
    got = samples(metrics.render())
    assert got['mstar_dist_inter_token_latency_seconds_bucket{le="0.001"}'] == 2
    assert got['mstar_dist_inter_token_latency_seconds_bucket{le="0.0025"}'] == 2
    assert got['mstar_dist_inter_token_latency_seconds_bucket{le="0.005"}'] == 3
    assert got['mstar_dist_inter_token_latency_seconds_bucket{le="+Inf"}'] == 3
    assert got["mstar_dist_inter_token_latency_seconds_count"] == 3
    assert abs(got["mstar_dist_inter_token_latency_seconds_sum"] - 0.005) < 1e-12
    assert got["mstar_dist_generated_tokens_total"] == 4
