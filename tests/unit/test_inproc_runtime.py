"""Conductor + workers wired in one process (tests/inproc.py): partitions, streaming edges across ranks, Parallel
walks, replicas, and the leak canary, with the real message encoding and no processes. A failure here points at
the runtime's request lifecycle rather than at sockets or process groups.
"""

from __future__ import annotations

import pytest
import yaml

from mstar_dist.server.backend import BackendError, Finished, GenerationParams, TextDelta
from tests.inproc import InProcDeployment
from tests.toy_model import ToyAudioModel, ToyModel
from tests.toy_model import audio_text as expected

REPO_TESTS = __import__("pathlib").Path(__file__).resolve().parents[1]


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def params(rid, prompt, max_tokens):
    return GenerationParams(request_id=rid, prompt=prompt, messages=None, max_tokens=max_tokens)


def audio_deployment(placement: list[dict], world_size: int) -> InProcDeployment:
    cfg = yaml.safe_load((REPO_TESTS / "toy_audio_deploy.yaml").read_text())
    cfg["node_groups"] = placement
    return InProcDeployment(ToyAudioModel(None, batch_sleep_s=0), cfg, world_size)


PLACEMENTS = {
    "colocated": ([{"node_names": ["ADD", "TWICE"], "ranks": [0], "graph_walks": ["start"]},
                   {"node_names": ["COUNT"], "ranks": [0], "graph_walks": ["count"]},
                   {"node_names": ["CODEC"], "ranks": [0], "graph_walks": ["codec"]}], 1),
    "split": ([{"node_names": ["ADD", "TWICE"], "ranks": [0], "graph_walks": ["start"]},
               {"node_names": ["COUNT"], "ranks": [1], "graph_walks": ["count"]},
               {"node_names": ["CODEC"], "ranks": [2], "graph_walks": ["codec"]}], 3),
    "replicas": ([{"node_names": ["ADD", "TWICE"], "ranks": [0], "graph_walks": ["start"]},
                  {"node_names": ["COUNT"], "ranks": [1, 2], "graph_walks": ["count"]},
                  {"node_names": ["CODEC"], "ranks": [0, 3], "graph_walks": ["codec"]}], 4),
}


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_streaming_partition_gives_the_same_text_on_every_placement(name):
    dep = audio_deployment(*PLACEMENTS[name])
    cases = [(5, 8), (0, 7), (100, 2), (40, 1), (7, 30)]
    events = dep.run([params(f"r{i}", f"start={s}", n) for i, (s, n) in enumerate(cases)])
    assert [text_of(ev) for ev in events] == [expected(s, n) for s, n in cases]
    assert all(isinstance(ev[-1], Finished) for ev in events)
    for worker in dep.workers:  # nothing left behind on any rank
        assert worker.held_requests() == set()
        assert worker.store.live_tensors == 0


def test_partition_that_starts_done_does_not_block_the_request():
    dep = audio_deployment(*PLACEMENTS["split"])
    (events,) = dep.run([params("n", "start=3 no-audio", 5)])
    assert text_of(events) == expected(3, 5, audio=False)


def test_failure_in_one_request_leaves_the_batch_mates_alone():
    cfg = yaml.safe_load((REPO_TESTS / "toy_deploy.yaml").read_text())
    dep = InProcDeployment(ToyModel(None, batch_sleep_s=0), cfg, 2)
    events = dep.run([params("ok1", "start=0", 6), params("bad", "fail-forward", 6), params("ok2", "start=50", 6),
                      params("stop", "fail-stop", 6)])
    assert text_of(events[0]) == "1 2 3 4 5 6 " and text_of(events[2]) == "51 52 53 54 55 56 "
    assert isinstance(events[1][-1], BackendError) and "injected forward failure" in str(events[1][-1])
    assert isinstance(events[3][-1], BackendError) and "stop-check" in str(events[3][-1])


@pytest.mark.parametrize("use_rank, peek_rank", [(1, 0), (1, 2), (0, 0)])
def test_kept_tensor_serves_every_consumer_then_is_freed(use_rank, peek_rank):
    from mstar_dist.control import messages as m
    from tests.toy_model import ToyFanoutModel

    cfg = {"model": "tests.toy_model:ToyFanoutModel", "node_groups": [
        {"node_names": ["MAKE"], "ranks": [0], "graph_walks": ["make"]},
        {"node_names": ["USE"], "ranks": [use_rank], "graph_walks": ["use"]},
        {"node_names": ["PEEK"], "ranks": [peek_rank], "graph_walks": ["peek"]}]}
    dep = InProcDeployment(ToyFanoutModel(None), cfg, 3)
    sent = []
    bus_send = dep.conductor.channel.send
    dep.conductor.channel.send = lambda peer, payload: (sent.append(m.decode(payload).body), bus_send(peer, payload))
    (events,) = dep.run([params("f", "start=3", 4)])
    assert text_of(events) == "60000 3 "
    pushes = [b for b in sent if isinstance(b, m.Push)]
    walks = {b.walk: b for b in sent if isinstance(b, m.RunWalk)}
    # the first consumer keeps it (no release), the last one consumes the producer's one persist count
    expect = [(use_rank, False), (peek_rank, True)]
    assert [(p.dst, p.release) for p in pushes] == [(r, rel) for r, rel in expect if r != 0]
    assert walks["peek"].release == (["blob"] if peek_rank == 0 else [])
    assert walks["use"].release == []
    for worker in dep.workers:
        assert worker.store.live_tensors == 0


def test_served_requests_leave_no_reference_cycles():
    """What a request's walks leave behind is freed by reference counting as it ends (its tensors with it), not by
    the cyclic collector, whose pauses stop a rank's GPU loop mid-wave (1.5 ms pauses at 32 streams when every
    finished walk was a cycle of its frames): served requests, successful and failed, leave no garbage the collector
    must find."""
    import gc

    cfg = yaml.safe_load((REPO_TESTS / "toy_deploy.yaml").read_text())
    dep = InProcDeployment(ToyModel(None), cfg, 2)
    dep.run([params(f"warm{i}", "hello", 4) for i in range(4)])  # caches and lazily built tables of the first requests
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        events = dep.run([params(f"r{i}", "hello there", 12) for i in range(6)] + [params("bad", "fail-forward", 6)])
        assert all(isinstance(ev[-1], Finished) for ev in events[:-1])
        assert isinstance(events[-1][-1], BackendError)
        assert gc.collect() == 0, sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
