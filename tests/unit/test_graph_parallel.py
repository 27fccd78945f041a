"""Parallel sections, outside deliveries and stall detection of a walk (docs/architecture.md §4). A failure here means concurrent
nodes run serially or too early, a streamed chunk or loop-back value is lost, overwritten or used in the wrong
iteration, or a request whose input can never arrive hangs instead of failing with the node's name."""

import pytest

from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Parallel, Sequential
from mstar_dist.graph.walk import GraphError, NodeResult, WalkRun
from tests.helpers import drive_batches

FAN = Sequential(
    GraphNode("split", inputs=("x",), outputs=(Edge("x", "left"), Edge("x", "right"))),
    Parallel(
        GraphNode("left", inputs=("x",), outputs=(Edge("l", "join"),)),
        GraphNode("right", inputs=("x",), outputs=(Edge("r", "join"),)),
    ),
    GraphNode("join", inputs=("l", "r"), outputs=(Edge("y"),)),
)


def fan_fn(call):
    return {
        "split": lambda i: {"x": i["x"]},
        "left": lambda i: {"l": i["x"] * 10},
        "right": lambda i: {"r": i["x"] + 1},
        "join": lambda i: {"y": (i["l"], i["r"])},
    }[call.node](call.inputs)


def drive(run: WalkRun, fn) -> list[list[str]]:
    """Complete every ready call with NodeResult(fn(call)) until done; returns the node names of each ready batch."""
    return [[call.node for call in batch] for batch in drive_batches(run, lambda call: NodeResult(fn(call)))]


def test_fan_out_runs_members_concurrently_and_fan_in_waits_for_all():
    run = WalkRun("r", "w", FAN, {"x": 3})
    assert drive(run, fan_fn) == [["split"], ["left", "right"], ["join"]]
    assert run.outputs == {"y": (30, 4)} and run.finish_reason is None


def test_parallel_members_complete_in_any_order():
    run = WalkRun("r", "w", FAN, {"x": 3})
    [split] = run.ready()
    run.complete(split, NodeResult({"x": 3}))
    left, right = run.ready()
    assert set(run.outstanding) == {left, right}  # two calls of one request outstanding at once
    run.complete(right, NodeResult({"r": 4}))
    assert run.ready() == [] and not run.done  # join still needs l
    run.complete(left, NodeResult({"l": 30}))
    [join] = run.ready()
    assert join.inputs == {"l": 30, "r": 4}
    assert run.ready() == []  # each call is handed out once


def test_data_driven_readiness_inside_parallel():
    section = Parallel(
        GraphNode("a", inputs=("x",), outputs=(Edge("a", "c"),)),
        GraphNode("b", inputs=("x",), outputs=(Edge("b", "c"),)),
        GraphNode("c", inputs=("a", "b"), outputs=(Edge("c"),)),
    )
    run = WalkRun("r", "w", section, {"x": 1})
    assert drive(run, lambda c: {"a": 1} if c.node == "a" else {"b": 2} if c.node == "b" else {"c": 3}) == [
        ["a", "b"], ["c"]]


def test_optional_input_from_a_parallel_sibling_waits_for_the_sibling():
    section = Parallel(
        GraphNode("enc", inputs=("img",), outputs=(Edge("emb", "llm"),)),
        GraphNode("llm", inputs=("ids",), optional_inputs=("emb",), outputs=(Edge("tok"),)),
    )
    run = WalkRun("r", "w", section, {"img": 1, "ids": 2})
    [enc] = run.ready()  # llm has its required input but waits for enc, which may feed it emb
    run.complete(enc, NodeResult({"emb": 9}))
    [llm] = run.ready()
    assert llm.inputs == {"ids": 2, "emb": 9}

    run = WalkRun("r", "w", section, {"img": 1, "ids": 2})
    [enc] = run.ready()
    run.complete(enc, NodeResult({}))  # emb not emitted: llm runs without it
    [llm] = run.ready()
    assert llm.inputs == {"ids": 2}


def test_external_input_of_a_parallel_member_arrives_by_deliver():
    section = Parallel(
        GraphNode("A", inputs=("x",), outputs=(Edge("a"),)),
        GraphNode("B", inputs=("chunk",), outputs=(Edge("b"),)),
    )
    run = WalkRun("r", "w", section, {"x": 1}, streamed_inputs={"chunk"})
    [a] = run.ready()
    run.complete(a, NodeResult({"a": 1}))
    assert not run.done and run.ready() == []  # B waits for its streamed input
    run.deliver("B", "chunk", 7)
    [b] = run.ready()
    assert b.inputs == {"chunk": 7}
    run.complete(b, NodeResult({"b": 2}))
    assert run.done and run.outputs == {"a": 1, "b": 2}


def test_streamed_loop_input_waits_for_the_next_iteration_and_third_value_is_rejected():
    codec = Loop(GraphNode("codec", inputs=("chunk",), outputs=(Edge("audio", EMIT_TO_CLIENT),)),
                 max_iters=10, name="codec")
    run = WalkRun("r", "w", codec, {}, streamed_inputs={"chunk"})
    assert run.ready() == []
    run.deliver("codec", "chunk", "c0")
    [call0] = run.ready()
    run.deliver("codec", "chunk", "c1")  # the current iteration consumed c0: c1 waits for the next one
    run.deliver("codec", "chunk", "c2")  # one already waits: c2 is for the iteration after
    assert run.ready() == []
    with pytest.raises(GraphError, match=r"node 'codec' input 'chunk' .* rejected a third from outside the walk"):
        run.deliver("codec", "chunk", "c3")
    run.complete(call0, NodeResult({}))
    [call1] = run.ready()
    run.complete(call1, NodeResult({}))
    [call2] = run.ready()
    assert [(c.inputs["chunk"], c.iteration) for c in (call0, call1, call2)] == [("c0", 0), ("c1", 1), ("c2", 2)]


def test_delivery_while_a_loop_back_value_is_pending_waits_and_is_not_overwritten():
    loop = Loop(Sequential(GraphNode("pre", inputs=("p",), outputs=(Edge("p", "pre"),)),
                           GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"),))),
                max_iters=4, name="l")
    run = WalkRun("r", "w", loop, {"p": 0, "x": 0})
    seen = []

    def step():
        [call] = run.ready()
        seen.append((call.node, call.iteration, dict(call.inputs)))
        run.complete(call, NodeResult({"p": 0} if call.node == "pre" else {"x": call.inputs["x"] + 1}))

    step(), step()  # pre 0, A 0: x=0 -> loop-back x=1 pending for iteration 1, where pre runs first
    run.deliver("A", "x", 100)  # A has x=1 pending for this iteration: 100 waits for the next
    with pytest.raises(GraphError, match="rejected a third"):
        run.deliver("A", "x", 200)
    step(), step(), step(), step()
    assert [inputs for node, _, inputs in seen if node == "A"] == [{"x": 0}, {"x": 1}, {"x": 100}]


def test_deliver_errors_name_node_and_signal():
    run = WalkRun("r", "w", FAN, {"x": 1})
    with pytest.raises(GraphError, match=r"no node 'nope'"):
        run.deliver("nope", "x", 1)
    with pytest.raises(GraphError, match=r"cannot deliver 'z': node 'join' has no such input"):
        run.deliver("join", "z", 1)
    [split] = run.ready()
    run.complete(split, NodeResult({"x": 1}))
    with pytest.raises(GraphError, match=r"node 'split' already ran and is in no loop"):
        run.deliver("split", "x", 2)
    drive(run, fan_fn)
    with pytest.raises(GraphError, match="is done"):
        run.deliver("join", "l", 1)


def test_complete_rejects_a_call_that_is_not_outstanding():
    run = WalkRun("r", "w", FAN, {"x": 1})
    [split] = run.ready()
    run.complete(split, NodeResult({"x": 1}))
    with pytest.raises(GraphError, match=r"node 'split' that is not outstanding"):
        run.complete(split, NodeResult({"x": 1}))


def test_stall_when_a_parallel_sibling_does_not_emit_a_required_input():
    section = Parallel(GraphNode("A", inputs=("x",), outputs=(Edge("y", "B"),)), GraphNode("B", inputs=("y", "z")))
    run = WalkRun("r", "w", section, {"x": 1})
    [a] = run.ready()
    with pytest.raises(GraphError, match=r"cannot proceed: node 'B' needs inputs 'y', 'z'"):
        run.complete(a, NodeResult({}))


def test_stall_in_a_later_iteration_names_the_loop():
    loop = Loop(GraphNode("A", inputs=("x", "cfg"), outputs=(Edge("x", "A"),)), max_iters=5, name="l")
    run = WalkRun("r", "w", loop, {"x": 0, "cfg": 1})
    [call] = run.ready()
    with pytest.raises(GraphError, match=r"node 'A' needs input 'cfg'.*\(iteration 1 of loop 'l'\)"):
        run.complete(call, NodeResult({"x": 1}))  # cfg is a walk input: only the first iteration gets it


def test_stall_is_not_declared_while_a_streamed_input_can_still_arrive():
    section = Sequential(GraphNode("A", inputs=("x",), outputs=(Edge("y", "B"),)), GraphNode("B", inputs=("y", "s")))
    run = WalkRun("r", "w", section, {"x": 1}, streamed_inputs={"s"})
    [a] = run.ready()
    run.complete(a, NodeResult({"y": 2}))  # B misses only the streamed s: no error
    with pytest.raises(GraphError, match=r"node 'B' needs inputs 'y', 's'"):
        run2 = WalkRun("r", "w", section, {"x": 1}, streamed_inputs={"s"})
        [a] = run2.ready()
        run2.complete(a, NodeResult({}))  # y never comes: streaming s cannot help
    run.deliver("B", "s", 3)
    [b] = run.ready()
    assert b.inputs == {"y": 2, "s": 3}
