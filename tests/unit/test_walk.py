"""Walk execution rules (docs/architecture.md §4). A failure here means requests run the wrong number of steps, lose the token
fed back by a loop, never stop at EOS / max_tokens, or stream the wrong values to the client."""

import pytest

from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Sequential, node_names
from mstar_dist.graph.walk import GraphError, NodeResult, WalkRun
from tests.helpers import drive

LLM_DECODE = Loop(
    GraphNode("LLM", inputs=("token",), optional_inputs=("kv",),
              outputs=(Edge("token", "LLM"), Edge("token", EMIT_TO_CLIENT))),
    max_iters=100,
    outputs=("token",),
    name="decode",
)


def test_decode_loop_feeds_token_back_and_emits_each_iteration():
    emitted = []
    run = WalkRun("r", "decode", LLM_DECODE, {"token": 5, "kv": "KV"}, loop_limits={"decode": 4},
                  on_emit=lambda s, v: emitted.append(v))
    calls = drive(run, lambda c: NodeResult({"token": c.inputs["token"] + 1}))
    assert [c.inputs["token"] for c in calls] == [5, 6, 7, 8]
    # kv is an optional input delivered once: only the first iteration sees it
    assert ["kv" in c.inputs for c in calls] == [True, False, False, False]
    assert [c.iteration for c in calls] == [0, 1, 2, 3]
    assert emitted == [6, 7, 8, 9]
    assert run.outputs == {"token": 9}
    assert run.finish_reason == "length"


def test_dynamic_stop_ends_loop_with_reason_stop():
    run = WalkRun("r", "decode", LLM_DECODE, {"token": 0}, loop_limits={"decode": 50})
    calls = drive(run, lambda c: NodeResult({"token": c.inputs["token"] + 1}, stop=c.inputs["token"] == 2))
    assert len(calls) == 3
    assert run.finish_reason == "stop"
    assert run.outputs["token"] == 3


def test_stop_loop_by_name_from_outside():
    run = WalkRun("r", "decode", LLM_DECODE, {"token": 0})
    [call] = run.ready()
    run.complete(call, NodeResult({"token": 1}))
    run.stop_loop("decode")
    assert not run.done  # the pending call of the current iteration still completes
    [call] = run.ready()
    run.complete(call, NodeResult({"token": 2}))
    assert run.done and run.finish_reason == "stop"


def test_zero_iterations_finishes_without_calls():
    run = WalkRun("r", "decode", LLM_DECODE, {"token": 0}, loop_limits={"decode": 0})
    assert run.done and run.outputs == {} and run.finish_reason == "length"


def test_loop_limit_cannot_exceed_declared_max_iters():
    loop = Loop(GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"),)), max_iters=3, name="l", outputs=("x",))
    run = WalkRun("r", "w", loop, {"x": 0}, loop_limits={"l": 10})
    assert len(drive(run, lambda c: NodeResult({"x": c.inputs["x"] + 1}))) == 3


def test_sequential_routes_internal_edges_and_persist_outputs():
    section = Sequential(
        GraphNode("enc", inputs=("img",), outputs=(Edge("emb", "llm"),)),
        GraphNode("llm", inputs=("emb", "ids"), outputs=(Edge("tok", EMIT_TO_CLIENT), Edge("kv", persist=True))),
    )
    emitted = []
    run = WalkRun("r", "prefill", section, {"img": 1, "ids": 2}, on_emit=lambda s, v: emitted.append((s, v)))
    calls = drive(run, lambda c: NodeResult({"emb": 10} if c.node == "enc" else {"tok": 7, "kv": "K"}))
    assert [c.node for c in calls] == ["enc", "llm"]
    assert calls[1].inputs == {"emb": 10, "ids": 2}
    assert emitted == [("tok", 7)]
    assert run.outputs == {"kv": "K"} and run.persist_signals == {"kv"}
    assert node_names(section) == {"enc", "llm"}


def test_declared_but_not_emitted_outputs_are_skipped():
    node = GraphNode("A", inputs=("x",), outputs=(Edge("y"), Edge("z", EMIT_TO_CLIENT)))
    emitted = []
    run = WalkRun("r", "w", node, {"x": 1}, on_emit=lambda s, v: emitted.append(s))
    drive(run, lambda c: NodeResult({"y": 3}))
    assert run.outputs == {"y": 3} and emitted == []


def test_missing_required_input_names_node_and_input():
    node = GraphNode("A", inputs=("x", "y"))
    with pytest.raises(GraphError, match=r"node 'A' needs input 'y'"):
        WalkRun("r", "w", node, {"x": 1})


def test_accumulated_outputs_collect_every_iteration():
    loop = Loop(GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"),)), max_iters=3, name="l",
                accumulated_outputs=("x",))
    run = WalkRun("r", "w", loop, {"x": 0})
    drive(run, lambda c: NodeResult({"x": c.inputs["x"] + 1}))
    assert run.outputs == {"x": [1, 2, 3]}
