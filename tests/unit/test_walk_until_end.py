"""Inputs read until their stream ends (``GraphNode.until_end``, docs/architecture.md §4): a loop node that takes one
value of a stream per run, waits while the stream lasts and the next value has not come, and runs without it once
the stream has ended. A failure here means a talker-like consumer runs ahead of the text it speaks, stalls after the
producer finished, loses or reorders values, or a graph that feeds such an input from inside the walk is accepted.
"""

import pytest
import torch

from mstar_dist.engine.component import Component
from mstar_dist.events import Finished, GenerationParams, TextDelta
from mstar_dist.graph.io import walk_io
from mstar_dist.graph.model import WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop
from mstar_dist.graph.partitions import Partition, StreamingEdge
from mstar_dist.graph.streaming import Fixed
from mstar_dist.graph.validate import validate
from mstar_dist.graph.walk import GraphError, NodeResult, WalkRun
from mstar_dist.graph.wiring import wire
from tests.inproc import InProcDeployment
from tests.toy_model import ToyModel

TALK = Loop(GraphNode("TALKER", inputs=("state",), until_end=("text",), outputs=(Edge("state", "TALKER"),)),
            max_iters=100, name="talk")
"""A talker's loop: its own state fed back each step, one text entry per step while the text lasts."""


def run_of(**kw) -> WalkRun:
    return WalkRun("r", "talk", TALK, {"state": 0}, loop_limits={"talk": 6}, streamed_inputs={"text"}, **kw)


def step(run: WalkRun) -> list[dict]:
    """Complete every ready call (state + 1); the inputs each call saw."""
    seen = []
    for call in run.ready():
        seen.append(dict(call.inputs))
        run.complete(call, NodeResult({"state": call.inputs["state"] + 1}))
    return seen


def test_the_node_waits_for_each_value_while_the_stream_lasts():
    run = run_of()
    assert step(run) == []  # no text yet: nothing runs, and the walk does not fail as stalled
    run.deliver("TALKER", "text", "a")
    assert step(run) == [{"state": 0, "text": "a"}]
    assert step(run) == []  # the next run waits for the next value
    run.deliver("TALKER", "text", "b")
    run.deliver("TALKER", "text", "c")  # two may queue: one per run
    assert step(run) == [{"state": 1, "text": "b"}]
    assert step(run) == [{"state": 2, "text": "c"}]
    assert not run.done


def test_after_the_end_the_queued_values_come_first_then_runs_go_on_without():
    run = run_of()
    run.deliver("TALKER", "text", "a")
    run.deliver("TALKER", "text", "b")
    run.end_input("TALKER", "text")
    seen = []
    while not run.done:
        seen += step(run)
    assert [c.get("text") for c in seen] == ["a", "b", None, None, None, None]
    assert [c["state"] for c in seen] == [0, 1, 2, 3, 4, 5]
    assert run.finish_reason == "length"


def test_an_end_with_no_value_lets_the_first_run_go_without_one():
    run = run_of()
    run.end_input("TALKER", "text")
    assert step(run) == [{"state": 0}]
    run.end_input("TALKER", "text")  # twice is harmless
    assert step(run) == [{"state": 1}]


def test_a_stop_ends_the_loop_whatever_the_stream():
    run = run_of()
    run.deliver("TALKER", "text", "a")
    [call] = run.ready()
    run.complete(call, NodeResult({"state": 1}, stop=True))
    assert run.done and run.finish_reason == "stop"
    run.end_input("TALKER", "text")  # a stream that ends after its consumer is a no-op


def test_without_the_stream_declared_streamed_a_missing_value_is_a_stall():
    with pytest.raises(GraphError, match="cannot proceed"):
        WalkRun("r", "talk", TALK, {}, loop_limits={"talk": 3})


def test_an_until_end_input_is_an_external_optional_port_and_no_self_loop():
    ports = {(p.node, p.signal): p.required for p in walk_io(TALK).external_inputs}
    assert ports == {("TALKER", "state"): True, ("TALKER", "text"): False}
    assert "TALKER" not in wire(TALK).self_loops  # the fast path would not wait for the stream


def test_end_input_names_what_does_not_exist():
    run = run_of()
    with pytest.raises(GraphError, match="no such until_end input"):
        run.end_input("TALKER", "state")


def test_graphs_that_misuse_until_end_are_refused():
    both = GraphNode("A", inputs=("x",), until_end=("x",))
    with pytest.raises(ValueError, match="until_end inputs and also"):
        validate(both)
    fed = Loop(GraphNode("A", inputs=("s",), until_end=("x",), outputs=(Edge("s", "A"), Edge("x", "A"))),
               max_iters=2)
    with pytest.raises(ValueError, match="only a streaming edge feeds one"):
        validate(fed)


# ---- through the worker: a stream's end reaches the consuming walk after its last value ------------------------

class Reader(Component):
    """READER: emits (its step, the streamed value it got or -1), and feeds its step back."""

    name = "READER"

    def run_batch(self, calls):
        out = []
        for call in calls:
            step_no = int(call.inputs["step"])
            got = int(call.inputs["x"]) if "x" in call.inputs else -1
            out.append(NodeResult({"step": torch.tensor([step_no + 1]), "seen": torch.tensor([step_no, got])}))
        return out


class ToyReaderModel(ToyModel):
    """ToyModel's COUNT loop streams each x into READER, which reads one x per step until the count ends and then
    goes on without: it runs ``max_tokens + 2`` steps, so its last steps come after the stream's end."""

    name = "toy_reader"

    def graphs(self):
        graphs = super().graphs()
        graphs["count"] = Loop(GraphNode("COUNT", inputs=("x",), outputs=(
            Edge("x", "COUNT"), Edge("x", EMIT_TO_CLIENT), Edge("x", "READER", stream=True))),
            max_iters=10_000, outputs=("x",), name="count")
        graphs["read"] = Loop(GraphNode("READER", inputs=("step",), until_end=("x",), outputs=(
            Edge("step", "READER"), Edge("seen", EMIT_TO_CLIENT))), max_iters=10_000, name="read")
        return graphs

    def partitions(self):
        return [Partition("text", ("start", "count")), Partition("read", ("read",))]

    def streaming_edges(self):
        return [StreamingEdge("x", "text", "read", "READER", Fixed(1, continue_after_done=True))]

    def build_component(self, node, *, device, walks, engine=None):
        return Reader() if node == "READER" else super().build_component(node, device=device, walks=walks)

    def preprocess(self, state, prompt, messages):
        super().preprocess(state, prompt, messages)
        state.data["reads"] = []

    def start(self, state):
        return [super().start(state), WalkStep("read", {"step": torch.tensor([0])},
                                               loop_limits={"read": state.max_tokens + 2})]

    def after_walk(self, state, walk, outputs):
        return None if walk == "read" else super().after_walk(state, walk, outputs)

    def postprocess(self, state, signal, values):
        if signal == "seen":
            state.data["reads"] += [tuple(int(x) for x in v) for v in values]
            return ""
        return super().postprocess(state, signal, values)

    def finish_text(self, state):
        return "| " + " ".join(f"{s}:{x}" for s, x in state.data["reads"])


@pytest.mark.parametrize("ranks", [(0, 0, 0), (0, 1, 2)], ids=["colocated", "split"])
def test_the_reader_takes_every_streamed_value_in_order_then_runs_on_past_the_end(ranks):
    config = {"model": "tests.toy_model:ToyModel", "limits": {"max_tokens": 64},
              "node_groups": [{"node_names": ["ADD"], "ranks": [ranks[0]], "graph_walks": ["start"]},
                              {"node_names": ["COUNT"], "ranks": [ranks[1]], "graph_walks": ["count"]},
                              {"node_names": ["READER"], "ranks": [ranks[2]], "graph_walks": ["read"]}]}
    dep = InProcDeployment(ToyReaderModel(None, batch_sleep_s=0), config, max(ranks) + 1)
    [events] = dep.run([GenerationParams(request_id="r", prompt="start=10", messages=None, max_tokens=4)])
    assert isinstance(events[-1], Finished), events
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    # the count streams 12, 13, 14 (its loop's values; the start walk's 11 is not streamed)
    assert text.endswith("| 0:12 1:13 2:14 3:-1 4:-1 5:-1"), text
    for worker in dep.workers:
        assert worker.held_requests() == set() and worker.store.live_tensors == 0
