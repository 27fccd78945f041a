"""Graph I/O derivation and validation (docs/architecture.md §4). A failure here means the runtime asks for the wrong walk inputs,
treats a same-iteration edge as a loop-back (or the reverse), misses a walk output, or accepts a graph that would
stall or lose values at run time instead of naming the mistake when the model loads."""

import pytest

from mstar_dist.graph.io import Port, walk_io
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Parallel, Sequential
from mstar_dist.graph.validate import validate
from mstar_dist.graph.walk import WalkRun

DECODE = Loop(
    GraphNode("LLM", inputs=("token",), optional_inputs=("kv",),
              outputs=(Edge("token", "LLM"), Edge("token", EMIT_TO_CLIENT))),
    max_iters=100, outputs=("token",), name="decode",
)


def pairs(edges):
    return [(src, e.dst, e.signal) for src, e in edges]


def test_decode_loop_io():
    io = walk_io(DECODE)
    assert io.external_inputs == (Port("LLM", "token", True), Port("LLM", "kv", False))  # loop-back-fed: still external
    assert pairs(io.loopback_edges) == [("LLM", "LLM", "token")] and io.internal_edges == ()
    assert io.outputs == ("token",)


def test_sequential_edges_to_later_members_are_internal_to_earlier_ones_loop_back():
    section = Loop(Sequential(
        GraphNode("A", inputs=("x", "fb"), optional_inputs=("self",), outputs=(Edge("a", "B"), Edge("self", "A"))),
        GraphNode("B", inputs=("a",), outputs=(Edge("fb", "A"), Edge("out"))),
    ), max_iters=2, name="l")
    validate(section)
    io = walk_io(section)
    assert pairs(io.internal_edges) == [("A", "B", "a")]
    assert pairs(io.loopback_edges) == [("A", "A", "self"), ("B", "A", "fb")]
    assert io.external_inputs == (Port("A", "x", True), Port("A", "fb", True), Port("A", "self", False))
    assert io.outputs == ("out",)


def test_parallel_edges_are_internal_and_outside_fed_member_inputs_stay_external():
    section = Sequential(
        GraphNode("pre", inputs=("img",), outputs=(Edge("emb", "llm"),)),
        Parallel(
            GraphNode("llm", inputs=("emb", "ids"), outputs=(Edge("h", "tts"), Edge("text", EMIT_TO_CLIENT))),
            GraphNode("tts", inputs=("h", "voice"), outputs=(Edge("wav", persist=True),)),
        ),
    )
    io = walk_io(section)
    assert pairs(io.internal_edges) == [("pre", "llm", "emb"), ("llm", "tts", "h")]
    assert io.loopback_edges == ()
    assert io.external_inputs == (Port("pre", "img", True), Port("llm", "ids", True), Port("tts", "voice", True))
    assert io.outputs == ("wav",)  # EMIT_TO_CLIENT is not a walk output; persist-only edges are
    run = WalkRun("r", "w", section, {"img": 1, "ids": 2, "voice": 3})
    assert run.external_inputs == io.external_inputs and run.persist_signals == {"wav"}


def test_walk_outputs_include_loop_outputs_and_accumulated_outputs_once():
    inner = Loop(GraphNode("B", inputs=("h",), outputs=(Edge("h", "B"), Edge("frame"))), max_iters=2, name="in",
                 accumulated_outputs=("frame",))
    section = Loop(Sequential(GraphNode("A", inputs=("t",), outputs=(Edge("t", "A"), Edge("h", "B"))), inner),
                   max_iters=3, name="out", outputs=("t",), accumulated_outputs=("h",))
    io = walk_io(section)
    assert io.outputs == ("frame", "t", "h")
    assert pairs(io.internal_edges) == [("A", "B", "h")]
    assert pairs(io.loopback_edges) == [("A", "A", "t"), ("B", "B", "h")]
    assert io.external_inputs == (Port("A", "t", True),)


def invalid(section, *fragments):
    with pytest.raises(ValueError) as info:
        validate(section)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_validate_accepts_a_good_graph():
    validate(DECODE)
    validate(Sequential())


def test_validate_rejects_edges_to_unknown_nodes_and_undeclared_inputs():
    invalid(GraphNode("A", outputs=(Edge("x", "C"),)), "edge 'x' from node 'A' to 'C'", "no node 'C' in this walk")
    invalid(Sequential(GraphNode("A", outputs=(Edge("x", "B"),)), GraphNode("B", inputs=("y",))),
            "node 'B' has no input 'x' (inputs: ['y'], optional: [])")


def test_validate_rejects_a_node_twice_in_one_walk_and_loop_names_twice():
    invalid(Sequential(GraphNode("A"), Parallel(GraphNode("A"))), "node 'A' appears 2 times")
    twice = Loop(GraphNode("B", outputs=(Edge("y"),)), max_iters=1, name="l")
    invalid(Sequential(Loop(GraphNode("A", outputs=(Edge("y"),)), max_iters=1, name="l"), twice),
            "loop name 'l' is used by 2 loops")


def test_validate_rejects_negative_max_iters():
    with pytest.raises(ValueError, match=r"Loop 'l': max_iters must be >= 0, got -1"):
        Loop(GraphNode("A"), max_iters=-1, name="l")
    loop = Loop(GraphNode("A"), max_iters=1, name="l")
    object.__setattr__(loop, "max_iters", -2)  # built around __post_init__ (e.g. decoded): validate still catches it
    invalid(loop, "loop 'l': max_iters must be >= 0, got -2")


def test_validate_rejects_loop_outputs_not_produced_inside_the_loop():
    section = Sequential(GraphNode("pre", outputs=(Edge("z"),)),
                         Loop(GraphNode("A", outputs=(Edge("y"),)), max_iters=2, name="l",
                              outputs=("w",), accumulated_outputs=("z", "y")))
    invalid(section, "loop 'l': output 'w' is not produced inside the loop (produced there: ['y'])",
            "loop 'l': accumulated output 'z' is not produced inside the loop")
    invalid(Loop(GraphNode("A", outputs=(Edge("y"),)), max_iters=1, outputs=("y",), accumulated_outputs=("y",)),
            "'y' is both an output and an accumulated output")


def test_validate_rejects_loop_back_edges_outside_loops_and_empty_loops():
    invalid(Sequential(GraphNode("A", inputs=("x",)), GraphNode("B", outputs=(Edge("x", "A"),))),
            "edge 'x' from node 'B' to 'A' feeds back", "no loop holds both nodes")
    invalid(GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"),)), "edge 'x' from node 'A' to 'A' feeds back")
    invalid(Loop(Sequential(), max_iters=3, name="l"), "loop 'l': holds no node")


def test_validate_lists_every_problem_and_rejects_non_sections():
    invalid(Sequential(GraphNode("A", outputs=(Edge("x", "C"),)), GraphNode("A")),
            "node 'A' appears 2 times")
    invalid(Sequential(GraphNode("A"), "B"), "not a graph section: 'B'")
    invalid(Sequential(Loop(GraphNode("A"), max_iters=1, accumulated_outputs=("q",)),
                       GraphNode("B", outputs=(Edge("x", "C"),))),
            "accumulated output 'q'", "no node 'C'")


def test_walk_run_refuses_an_invalid_graph():
    with pytest.raises(ValueError, match="node 'A' appears 2 times"):
        WalkRun("r", "w", Sequential(GraphNode("A"), GraphNode("A")), {})
