"""scripts/ttft_trace.py's analysis on a hand-made trace: segments joined across processes by the wire id, prefill
batching, the decode steps a prefill waited behind (before it, and between its end and its first Emits), and the
garbage collectors' pauses per process kind."""

from scripts.ttft_trace import analyse, client_events


def _e(t: float, phase: str, rid: str = "", proc: str = "frontend", **extra) -> dict:
    return {"t": t, "phase": phase, "rid": rid, "proc": proc, "extra": extra}


def _trace() -> list[dict]:
    """Request c1 (wire c1#1) and c2 (wire c2#2) in one prefill forward of 2 rows; rank 0 was in a decode step when
    their RunWalks were sent, and ran another one after the prefill, before the turn's Emits left."""
    ms = 1e-3
    events = []
    for client, wire, t0 in (("c1", "c1#1", 0.0), ("c2", "c2#2", 1 * ms)):
        events += [_e(t0, "http_arrived", client), _e(t0 + 0.5 * ms, "http_submitted", client),
                   _e(t0 + 1 * ms, "cond_received", client),
                   _e(t0 + 2 * ms, "cond_admitted", wire, client=client),
                   _e(t0 + 3 * ms, "cond_dispatch", wire, walk="prefill", rank=0)]
    events += [
        _e(0.0, "eng_decode_start", proc="rank0", rows=5), _e(10 * ms, "eng_decode_end", proc="rank0", rows=5),
        _e(11 * ms, "rank_runwalk", "c1#1", "rank0", walk="prefill"),
        _e(11 * ms, "rank_runwalk", "c2#2", "rank0", walk="prefill"),
        _e(12 * ms, "eng_prefill_start", proc="rank0", rows=2, tokens=40, ids=["c1#1", "c2#2"]),
        _e(32 * ms, "eng_prefill_end", proc="rank0", rows=2, ids=["c1#1", "c2#2"]),
        _e(32 * ms, "eng_decode_start", proc="rank0", rows=5), _e(40 * ms, "eng_decode_end", proc="rank0", rows=5),
        _e(41 * ms, "rank_emits_sent", "c1#1", "rank0", n=7), _e(41 * ms, "rank_emits_sent", "c2#2", "rank0", n=7),
        _e(41.5 * ms, "gc", proc="frontend", generation=1, collected=3, ms=0.25),
        _e(41.6 * ms, "gc", proc="frontend", generation=2, collected=90, ms=3.5),
        _e(20 * ms, "gc", proc="intake1", generation=0, collected=0, ms=0.05),
    ]
    for client, wire, t in (("c1", "c1#1", 42 * ms), ("c2", "c2#2", 43 * ms)):
        events += [_e(t, "cond_first_emit", wire), _e(t + 1 * ms, "http_first_chunk", client)]
    return sorted(events, key=lambda e: e["t"])


def test_segments_batching_and_waits():
    report = analyse(_trace(), -1.0, 1.0)
    assert report["requests"] == 2 and report["requests_with_first_chunk"] == 2
    seg = report["segments_ms"]
    assert seg["cond_dispatch -> rank_runwalk"]["median"] == 7.5  # 8 and 7 ms (c2 was sent 1 ms later)
    assert seg["eng_prefill_start -> eng_prefill_end"]["median"] == 20.0
    assert seg["eng_prefill_end -> rank_emits_sent"]["median"] == 9.0
    assert report["totals_ms"]["http_arrived -> http_first_chunk"]["median"] == 43.0
    assert report["prefill"]["forwards"] == 1 and report["prefill"]["rows_per_forward"]["median"] == 2
    assert report["decode"]["steps"] == 2 and report["decode"]["step_ms"]["median"] == 9.0
    wait = report["waiting_behind_decode"]
    assert wait["decode_steps_between_rank_runwalk_and_prefill"]["median"] == 0
    assert wait["decode_steps_between_cond_dispatch_and_prefill"]["median"] == 1
    assert wait["decode_ms_between_cond_dispatch_and_prefill"]["median"] == 6.5  # 7 and 6 ms of it in the window
    assert wait["decode_steps_between_prefill_end_and_emits"]["median"] == 1
    assert wait["decode_ms_between_prefill_end_and_emits"]["median"] == 8.0
    assert report["requests_per_intake"] == {"frontend": 2}  # both parsed by the front end's HTTP thread
    assert report["gc_pauses"] == {  # which process stood still, how often and how long
        "frontend": {"collections": 2, "by_generation": {"1": 1, "2": 1}, "ms_total": 3.75, "ms_max": 3.5},
        "intake": {"collections": 1, "by_generation": {"0": 1}, "ms_total": 0.05, "ms_max": 0.05}}


def test_a_window_keeps_only_the_requests_that_arrived_in_it():
    report = analyse(_trace(), 0.5e-3, 1.0)
    assert report["requests"] == 1
    assert report["requests_per_intake"] == {"frontend": 1}


def test_waves_measure_how_far_apart_a_bursts_requests_travel():
    """Two waves 100 ms apart: c1 and c2 (1 ms apart, one prefill forward), then c3 and c4 (2 ms apart)."""
    ms = 1e-3
    events = _trace()
    for client, wire, t0 in (("c3", "c3#3", 100 * ms), ("c4", "c4#4", 102 * ms)):
        events += [_e(t0, "http_arrived", client), _e(t0 + 1 * ms, "cond_received", client),
                   _e(t0 + 2 * ms, "cond_admitted", wire, client=client),
                   _e(t0 + 3 * ms, "cond_dispatch", wire, walk="prefill", rank=0)]
    events += [_e(105 * ms, "eng_prefill_start", proc="rank0", rows=1, tokens=20, ids=["c3#3"]),
               _e(108 * ms, "eng_prefill_start", proc="rank0", rows=1, tokens=20, ids=["c4#4"])]
    report = analyse(sorted(events, key=lambda e: e["t"]), -1.0, 1.0)["waves"]
    assert report["waves"] == 2 and report["requests_per_wave"]["median"] == 2
    assert report["spread_ms"]["http_arrived"]["median"] == 1.5  # 1 and 2 ms
    assert report["spread_ms"]["eng_prefill_start"]["median"] == 1.5  # 0 (one forward) and 3 ms
    assert report["prefill_forwards_per_wave"]["median"] == 1.5  # 1 and 2
    assert report["spread_ms"]["http_first_chunk"]["n"] == 1  # only the first wave got its first chunks


def test_the_clients_stamps_frame_the_servers_by_request_id():
    """The client's send and first read (``bench_serving``'s results, same clock) join the server's HTTP events by
    the X-Request-Id: the way in before the route handler ran and the way out after the first chunk was written are
    segments of their own, and the client's TTFT is a total. A request whose first line never came has no read."""
    ms = 1e-3
    results = [(45.5 * ms, 0.3, 7, "c1", -1.5 * ms), (44.5 * ms, 0.3, 7, "c2", 1 * ms), (0.0, 0.0, 0, "gone", 0.0)]
    events = sorted(_trace() + client_events(results), key=lambda e: e["t"])
    report = analyse(events, -1.0, 1.0)
    seg, totals = report["segments_ms"], report["totals_ms"]
    assert seg["client_sent -> http_arrived"]["median"] == 0.75  # 1.5 ms for c1, 0 for c2
    assert seg["http_first_chunk -> client_first_line"]["median"] == 1.25  # 1 ms for c1, 1.5 for c2
    assert totals["client_sent -> client_first_line"]["median"] == 45.0
    assert [e["phase"] for e in client_events(results[2:])] == ["client_sent"]
