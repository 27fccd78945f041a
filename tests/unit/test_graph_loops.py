"""Loops in depth (docs/architecture.md §4): nested loops, per-run limits, dynamic and named stops, last/accumulated outputs, edges
that leave a loop. A failure here means a multi-level generation (e.g. tokens x codec frames) runs the wrong number
of steps, reuses a stale value from the previous outer iteration, ignores a stop, or reports the wrong finish
reason."""

from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Sequential
from mstar_dist.graph.walk import NodeResult, WalkRun
from tests.helpers import drive

# outer loop over "tokens": tok feeds t back to itself and h into the inner loop, whose step feeds h back to itself
INNER = Loop(GraphNode("step", inputs=("h",), outputs=(Edge("h", "step"),)), max_iters=3, name="inner",
             accumulated_outputs=("h",))
NESTED = Loop(Sequential(GraphNode("tok", inputs=("t",), outputs=(Edge("t", "tok"), Edge("h", "step"))), INNER),
              max_iters=4, name="outer", outputs=("t",))


def nested_fn(call, stop_at=lambda call: False):
    if call.node == "tok":
        t = call.inputs["t"]
        return NodeResult({"t": t + 1, "h": 100 * (t + 1)}, stop=stop_at(call))
    return NodeResult({"h": call.inputs["h"] + 1}, stop=stop_at(call))


def trace(calls):
    return [(c.node, c.inputs.get("t", c.inputs.get("h")), c.iteration) for c in calls]


def test_inner_loop_restarts_fresh_each_outer_iteration_with_limits_by_name():
    run = WalkRun("r", "w", NESTED, {"t": 0}, loop_limits={"inner": 2, "outer": 3})
    calls = drive(run, nested_fn)
    assert trace(calls) == [
        ("tok", 0, 0), ("step", 100, 0), ("step", 101, 1),
        ("tok", 1, 1), ("step", 200, 0), ("step", 201, 1),  # not the stale loop-back 102
        ("tok", 2, 2), ("step", 300, 0), ("step", 301, 1),
    ]
    assert run.outputs == {"t": 3, "h": [301, 302]}  # accumulated per inner run: the last run's list
    assert run.finish_reason == "length"


def test_dynamic_stop_ends_only_the_innermost_loop():
    run = WalkRun("r", "w", NESTED, {"t": 0})
    calls = drive(run, lambda c: nested_fn(c, stop_at=lambda c: c.node == "step"))
    assert [c.node for c in calls] == ["tok", "step"] * 4  # inner stops after one step; outer runs all 4
    assert run.finish_reason == "length"


def test_dynamic_stop_of_the_outer_loop_lets_the_inner_loop_finish_and_sets_reason_stop():
    run = WalkRun("r", "w", NESTED, {"t": 0})
    calls = drive(run, lambda c: nested_fn(c, stop_at=lambda c: c.node == "tok" and c.inputs["t"] == 1))
    assert [c.node for c in calls] == ["tok", "step", "step", "step"] * 2
    assert run.finish_reason == "stop" and run.outputs["t"] == 2


def test_stop_loop_by_name_inner_then_outer():
    def on_call(run, call):
        if call.node == "step" and call.inputs["h"] == 100:
            run.stop_loop("inner")  # while inner runs: ends it after this step; later runs are full
        if call.node == "tok" and call.inputs["t"] == 1:
            run.stop_loop("outer")

    run = WalkRun("r", "w", NESTED, {"t": 0})
    calls = drive(run, nested_fn, on_call)
    assert [c.node for c in calls] == ["tok", "step", "tok", "step", "step", "step"]
    assert run.finish_reason == "stop"


def test_stop_request_for_a_loop_not_running_applies_to_its_next_run_only():
    def on_call(run, call):
        if call.node == "tok" and call.inputs["t"] == 0:
            run.stop_loop("inner")  # inner is not running: its next run does not iterate

    run = WalkRun("r", "w", NESTED, {"t": 0}, loop_limits={"outer": 2, "inner": 2})
    calls = drive(run, nested_fn, on_call)
    assert trace(calls) == [("tok", 0, 0), ("tok", 1, 1), ("step", 200, 0), ("step", 201, 1)]


def test_stop_before_the_loop_starts_skips_it_with_reason_stop():
    section = Sequential(GraphNode("pre", inputs=("x",), outputs=(Edge("t", "A"),)),
                         Loop(GraphNode("A", inputs=("t",), outputs=(Edge("t", "A"),)), max_iters=5, name="l"))
    run = WalkRun("r", "w", section, {"x": 0})
    run.stop_loop("unknown")  # not a loop of this walk: no-op
    [pre] = run.ready()
    run.stop_loop("l")
    run.complete(pre, NodeResult({"t": 1}))
    assert run.done and run.ready() == [] and run.finish_reason == "stop"


def test_walk_input_goes_only_to_inputs_no_internal_edge_feeds():
    section = Sequential(
        Loop(GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"), Edge("x", "B"))), max_iters=2),
        GraphNode("B", inputs=("x",), outputs=(Edge("y"),)),
    )
    run = WalkRun("r", "w", section, {"x": 0})
    drive(run, lambda c: NodeResult({"x": c.inputs["x"] + 1} if c.node == "A" else {"y": c.inputs["x"]}))
    assert run.outputs == {"y": 2}  # B's x comes from the loop, not from the walk input x=0


def test_edge_leaving_a_loop_carries_the_last_iteration_value():
    section = Sequential(
        Loop(GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"), Edge("v", "B"))), max_iters=3),
        GraphNode("B", inputs=("v",), outputs=(Edge("y"),)),
    )
    run = WalkRun("r", "w", section, {"x": 0})
    calls = drive(run, lambda c: NodeResult({"x": c.inputs["x"] + 1, "v": c.inputs["x"] + 1} if c.node == "A"
                                            else {"y": c.inputs["v"]}))
    assert [c.node for c in calls] == ["A", "A", "A", "B"]
    assert run.outputs == {"y": 3} and run.finish_reason == "length"


def test_outputs_keep_the_latest_value_and_accumulated_only_iterations_that_emitted():
    loop = Loop(GraphNode("A", inputs=("i",), outputs=(Edge("i", "A"), Edge("even"), Edge("sq"))),
                max_iters=5, name="l", outputs=("even",), accumulated_outputs=("sq",))
    run = WalkRun("r", "w", loop, {"i": 0})

    def fn(c):
        i = c.inputs["i"]
        return NodeResult({"i": i + 1, **({"even": i, "sq": i * i} if i % 2 == 0 else {})})

    drive(run, fn)
    assert run.outputs == {"even": 4, "sq": [0, 4, 16]}


def test_walk_without_loops_has_no_finish_reason():
    run = WalkRun("r", "w", GraphNode("A", inputs=("x",), outputs=(Edge("y"),)), {"x": 1})
    drive(run, lambda c: NodeResult({"y": 2}))
    assert run.done and run.finish_reason is None and run.outputs == {"y": 2}


def test_many_empty_outer_iterations_do_not_recurse():
    section = Loop(Loop(GraphNode("A", inputs=("x",), outputs=(Edge("x", "A"),)), max_iters=3, name="inner"),
                   max_iters=5000, name="outer")
    run = WalkRun("r", "w", section, {"x": 0}, loop_limits={"inner": 0})
    assert run.done and run.ready() == [] and run.finish_reason == "length"


# an AR decode loop: the node is the loop's whole body and feeds its own input (WalkRun's one-pass self-loop step)
AR = Loop(GraphNode("LLM", inputs=("token",), optional_inputs=("kv",),
                    outputs=(Edge("token", "LLM"), Edge("token", EMIT_TO_CLIENT))),
          max_iters=6, name="decode", outputs=("token",))


def ar_run(scenario: str) -> tuple[list, list, dict, str | None]:
    """Drive ``AR`` through ``scenario``: (calls as (inputs, iteration), emitted tokens, outputs, finish reason)."""
    emitted: list[int] = []
    run = WalkRun("r", "w", AR, {"token": 0}, loop_limits={"decode": 5},
                  on_emit=lambda signal, value: emitted.append(value))
    seen = []
    while not run.done:
        (call,) = run.ready()
        seen.append((dict(call.inputs), call.iteration))
        if scenario == "kv" and call.iteration == 1:
            run.deliver("LLM", "kv", "kv-from-elsewhere")  # for the node's next run
        if scenario == "stop_loop" and call.iteration == 2:
            run.stop_loop("decode")
        token = call.inputs["token"] + 1
        run.complete(call, NodeResult({"token": token}, stop=scenario == "eos" and token == 2))
    return seen, emitted, run.outputs, run.finish_reason


def test_a_self_loop_runs_its_iterations_with_limits_stops_and_delivered_inputs():
    seen, emitted, outputs, reason = ar_run("limit")
    assert seen == [({"token": i}, i) for i in range(5)] and emitted == [1, 2, 3, 4, 5]
    assert outputs == {"token": 5} and reason == "length"
    seen, emitted, _, reason = ar_run("eos")
    assert emitted == [1, 2] and reason == "stop"
    seen, emitted, _, reason = ar_run("stop_loop")
    assert emitted == [1, 2, 3] and reason == "stop"  # ends after the iteration it was asked in
    seen, _, _, _ = ar_run("kv")
    assert seen[2] == ({"token": 2, "kv": "kv-from-elsewhere"}, 2) and "kv" not in seen[3][0]


def test_the_self_loop_step_in_one_pass_is_the_general_path(monkeypatch):
    one_pass = WalkRun._iterate
    taken = []
    monkeypatch.setattr(WalkRun, "_iterate", lambda self, *args: taken.append(one_pass(self, *args)) or taken[-1])
    fast = {s: ar_run(s) for s in ("limit", "eos", "stop_loop", "kv")}
    assert taken.count(True) >= 8  # most steps took the one pass (not the loop's last, a stop, a delivered value)
    monkeypatch.setattr(WalkRun, "_iterate", lambda self, *args: False)
    assert {s: ar_run(s) for s in fast} == fast
