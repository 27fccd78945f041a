"""Walks whose nodes run on different ranks (mstar_dist/worker/spans.py), conductor and workers in one process
(tests/inproc.py): a Loop whose body spans two ranks gives the same emitted values, loop outputs and accumulated
outputs as colocated, and a dynamic stop raised on either rank ends the loop on both. A failure here points at
the lockstep protocol (NodeDone, placeholders, per-node run numbers), not at sockets or process groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar_dist.server.backend import Finished, GenerationParams, TextDelta
from tests.inproc import InProcDeployment
from tests.toy_model import ToySpanModel, span_text

CASES = [  # (start, max_tokens): length-bound, STEP's stop (x -> 100), CHECK's stop (x -> 137), one iteration
    (5, 8), (95, 20), (130, 20), (0, 1), (236, 3),
]
PLACEMENTS = {
    "colocated": ([{"node_names": ["STEP", "CHECK"], "ranks": [0], "graph_walks": ["span"]}], 1),
    "split": ([{"node_names": ["STEP"], "ranks": [0], "graph_walks": ["span"]},
               {"node_names": ["CHECK"], "ranks": [1], "graph_walks": ["span"]}], 2),
    "split_replicas": ([{"node_names": ["STEP"], "ranks": [0, 1], "graph_walks": ["span"]},
                        {"node_names": ["CHECK"], "ranks": [2, 3], "graph_walks": ["span"]}], 4),
}


def deployment(name: str, width: int) -> InProcDeployment:
    groups, world = PLACEMENTS[name]
    cfg = {"model": "tests.toy_model:ToySpanModel", "node_groups": groups,
           "transport": {"inline_max_bytes": 64}}
    return InProcDeployment(ToySpanModel(None, width=width), cfg, world)


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.parametrize("width", [2, 1000], ids=["inline", "p2p"])
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_a_loop_across_ranks_equals_colocated(name, width):
    dep = deployment(name, width)
    events = dep.run([GenerationParams(request_id=f"r{i}", prompt=f"start={s}", messages=None, max_tokens=n)
                      for i, (s, n) in enumerate(CASES)])
    assert [text_of(ev) for ev in events] == [span_text(s, n) for s, n in CASES]
    assert all(isinstance(ev[-1], Finished) for ev in events)
    for worker in dep.workers:  # every copy of every walk ended, nothing is left behind
        assert worker.held_requests() == set() and worker.store.live_tensors == 0


def test_stop_on_either_rank_ends_the_loop_on_both():
    dep = deployment("split", 1000)
    step_stop, check_stop = dep.run([
        GenerationParams(request_id="a", prompt="start=97", messages=None, max_tokens=50),  # STEP (rank 0) stops
        GenerationParams(request_id="b", prompt="start=133", messages=None, max_tokens=50),  # CHECK (rank 1) stops
    ])
    assert text_of(step_stop) == "98 99 100 | last: 100 | rows: 3 | sum: 297"
    assert text_of(check_stop) == "134 135 136 137 | last: 137 | rows: 4 | sum: 542"
    assert step_stop[-1].finish_reason == check_stop[-1].finish_reason == "stop"


def test_a_node_call_crosses_ranks_only_between_the_two_ranks():
    """Values between the loop's nodes go worker to worker: the conductor sees only walk messages."""
    dep = deployment("split", 1000)
    seen = []
    original = dep.conductor.handle

    def spy(sender, payload):
        from mstar_dist.control import messages as m
        body = m.decode(payload).body
        seen.append(type(body).__name__)
        seen.extend(type(done).__name__ for done in getattr(body, "done", ()))  # walks ended in a step's Emits
        original(sender, payload)

    dep.conductor.handle = spy
    (events,) = dep.run([GenerationParams(request_id="a", prompt="start=1", messages=None, max_tokens=6)])
    assert text_of(events) == span_text(1, 6)
    assert "NodeDone" not in seen and seen.count("WalkDone") == 2  # one per rank's copy of the walk


class _Store:
    """The two calls of the torchrun store that the walks check uses, shared by the 'ranks' of one test."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def wait(self, keys, timeout):
        missing = [k for k in keys if k not in self.data]
        assert not missing, missing

    def get(self, key):
        return self.data[key]


def test_ranks_that_derive_different_walks_refuse_to_start_naming_both():
    from mstar_dist.runtime.deployment import check_same_walks

    store = _Store()
    store.set("mstar_dist/walks/0", "aaaa")  # what rank 0 publishes first
    check_same_walks(store, 1, 3, "aaaa", timeout_s=1)  # rank 1 agrees
    with pytest.raises(RuntimeError, match=r"rank 2 and rank 0 derive different walks"):
        check_same_walks(store, 2, 3, "bbbb", timeout_s=1)
    with pytest.raises(RuntimeError, match=r"rank 0 and rank 2 derive different walks"):
        check_same_walks(store, 0, 3, "aaaa", timeout_s=1)


def test_large_streamed_items_travel_on_the_pair_and_keep_their_order():
    """Streaming edges move items like any edge: above inline_max_bytes each item follows its message on the
    pair (here every item: the producing rank's limit is 0) and joins the consumer's buffer in order."""
    import yaml

    from tests.toy_model import ToyAudioModel, audio_text

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "toy_audio_deploy.yaml").read_text())
    cfg["node_groups"] = [{"node_names": ["ADD", "TWICE"], "ranks": [0], "graph_walks": ["start"]},
                          {"node_names": ["COUNT"], "ranks": [1], "graph_walks": ["count"]},
                          {"node_names": ["CODEC"], "ranks": [2], "graph_walks": ["codec"]}]
    dep = InProcDeployment(ToyAudioModel(None, batch_sleep_s=0), cfg, 3)
    dep.workers[1].transport.inline_max_bytes = 0  # the router decides inline vs the data plane
    sent = []
    plane = dep.workers[1].transport.transports["p2p"]
    original = plane.post_send
    plane.post_send = lambda t, dst: sent.append(dst) or original(t, dst)
    cases = [(5, 8), (7, 30)]
    events = dep.run([GenerationParams(request_id=f"r{i}", prompt=f"start={s}", messages=None, max_tokens=n)
                      for i, (s, n) in enumerate(cases)])
    assert [text_of(ev) for ev in events] == [audio_text(s, n) for s, n in cases]
    assert sent.count(2) == sum(n - 1 for _, n in cases)  # every streamed x went 1 -> 2 on the pair
