"""Static checks of one walk's graph (docs/architecture.md §4). Run once per walk when a model's graphs are loaded; ``WalkRun``
runs them too (cached per section), so a bad graph fails with names instead of stalling a request."""

from __future__ import annotations

import collections

from mstar_dist.graph.io import common_loops, edge_kind, node_trails, routed_edges
from mstar_dist.graph.nodes import (
    EMIT_TO_CLIENT, GraphNode, Loop, Parallel, Section, Sequential, iter_loops, iter_nodes,
)


def validate(section: Section) -> None:
    """Raise ``ValueError`` listing every problem of a walk's graph, each with the node, loop and signal names:
    a non-section member, a node name used twice (a node may appear once per walk), a loop name used twice, a loop
    with ``max_iters < 0``, a loop output or accumulated output no node inside the loop produces (or one listed as
    both), an edge to an unknown node or to an input the node does not declare (or to an ``until_end`` input, which
    only a streaming edge feeds), an input listed both as ``until_end`` and as an input, and a loop-back edge
    outside any loop (its value could never be consumed)."""
    bad = _bad_members(section)
    if bad:
        raise ValueError("invalid walk graph: " + "; ".join(bad))
    duplicates = _duplicates(section)
    problems = duplicates + _loop_problems(section)
    if not duplicates:  # an edge's ends are only well defined with unique node names
        problems += _edge_problems(section)
    if problems:
        raise ValueError("invalid walk graph: " + "; ".join(problems))


def _bad_members(section: object) -> list[str]:
    if isinstance(section, GraphNode):
        return []
    if isinstance(section, (Sequential, Parallel)):
        return [p for member in section.members for p in _bad_members(member)]
    if isinstance(section, Loop):
        return _bad_members(section.section)
    return [f"not a graph section: {section!r}"]


def _duplicates(section: Section) -> list[str]:
    problems = []
    for name, n in collections.Counter(node.name for node in iter_nodes(section)).items():
        if n > 1:
            problems.append(f"node {name!r} appears {n} times (a node may appear once per walk)")
    loop_names = collections.Counter(loop.name for loop in iter_loops(section) if loop.name is not None)
    for name, n in loop_names.items():
        if n > 1:
            problems.append(f"loop name {name!r} is used by {n} loops (stop_loop and loop_limits need one)")
    return problems


def _loop_problems(section: Section) -> list[str]:
    problems = []
    for loop in iter_loops(section):
        label = f"loop {loop.name!r}" if loop.name else f"unnamed loop over {sorted(n.name for n in iter_nodes(loop))}"
        if not any(True for _ in iter_nodes(loop)):
            problems.append(f"{label}: holds no node")
        if loop.max_iters < 0:
            problems.append(f"{label}: max_iters must be >= 0, got {loop.max_iters}")
        produced = {e.signal for node in iter_nodes(loop.section) for e in node.outputs}
        for kind, signals in (("output", loop.outputs), ("accumulated output", loop.accumulated_outputs)):
            for signal in signals:
                if signal not in produced:
                    problems.append(f"{label}: {kind} {signal!r} is not produced inside the loop "
                                    f"(produced there: {sorted(produced)})")
        for signal in sorted(set(loop.outputs) & set(loop.accumulated_outputs)):
            problems.append(f"{label}: {signal!r} is both an output and an accumulated output")
    return problems


def _edge_problems(section: Section) -> list[str]:
    nodes = {node.name: node for node in iter_nodes(section)}
    problems = []
    for node in nodes.values():
        if twice := sorted(set(node.until_end) & {*node.inputs, *node.optional_inputs}):
            problems.append(f"node {node.name!r}: {twice} are until_end inputs and also listed as (optional) inputs")
        for e in node.outputs:
            if e.dst is None or e.dst == EMIT_TO_CLIENT or e.stream:
                continue  # a streaming edge's consumer is in another walk: checked by StreamingEdge.check
            where = f"edge {e.signal!r} from node {node.name!r} to {e.dst!r}"
            if e.dst not in nodes:
                problems.append(f"{where}: no node {e.dst!r} in this walk (nodes: {sorted(nodes)})")
            elif e.signal in nodes[e.dst].until_end:
                problems.append(f"{where}: {e.signal!r} is an until_end input of {e.dst!r}: only a streaming edge "
                                f"feeds one")
            elif e.signal not in nodes[e.dst].inputs + nodes[e.dst].optional_inputs:
                dst = nodes[e.dst]
                problems.append(f"{where}: node {e.dst!r} has no input {e.signal!r} "
                                f"(inputs: {list(dst.inputs)}, optional: {list(dst.optional_inputs)})")
    trails = node_trails(section)
    for src, e in routed_edges(section):
        if edge_kind(trails[src], trails[e.dst]) == "loopback" and not common_loops(trails[src], trails[e.dst]):
            problems.append(f"edge {e.signal!r} from node {src!r} to {e.dst!r} feeds back (to an earlier member or "
                            f"itself) but no loop holds both nodes, so its value would never be consumed")
    return problems
